"""vLLM generation as an SPMD program inside a worker group's torch.distributed world.

Every rank of the group builds one ``vllm.LLM`` with ``distributed_executor_backend=
"external_launcher"``: vLLM then runs in this process and reuses the already-initialised world
instead of spawning its own workers. Consecutive ranks form one generation TP group
(``tp_g = rollout.tensor_model_parallel_size``); each group is one engine and one generation-DP
rank. All ranks of a TP group must be given the same prompts (the controller dispatches by
``dp_rank``) and are seeded alike, so they sample the same tokens.

What differs from plain ``LLM.generate``:
- prompts go in as token ids and the engine never loads a tokenizer (``skip_tokenizer_init``):
  transformers 5 builds the wrong tokenizer class for custom tokenizers (docs/environment.md). EOS
  ids are therefore passed as ``stop_token_ids`` on every request.
- log-probs come from ``logprobs_mode="processed_logprobs"``: the distribution after temperature
  and top-k/top-p, i.e. what the token was sampled from (vLLM's default reports raw logits'
  log-probs, which ignores the temperature).
- ``update_weights`` copies HF-named full tensors into the engine's weights in place. On CPU the
  engine keeps its linears' plain weights ("live weights", workers/rollout/vllm_weight_sync.py)
  so a sync is one ``load_weights`` plus a repack, without vLLM's rebuild of every layer from
  meta tensors; elsewhere it is vLLM's ``reload_weights``.
- on CPU, generation runs under ``torch.compiler.set_stance("force_eager")``. vLLM's sampler
  wraps two tiny helpers in ``torch.compile`` (the sampled token's rank for ``logprobs``, and the
  random sample); on CPU their first call traces them and builds C++ kernels with the system
  compiler: 4 s with a warm inductor cache, about 60 s on a fresh machine, in every worker
  process, for kernels that run in microseconds eagerly. Tokens and log-probs are identical.
- ``generate`` runs as its two halves (enqueue, then the engine stepped as it steps it), so that
  each sample's finish is timed: ``meta_info["metrics"]["perf/gen_tail_share"]`` is the share of
  the call spent after the median sample finished (workers/rollout/vllm_stepping.py).

Memory policy: on GPU ``release_memory`` puts the engine to sleep (level 1: weights offloaded to
host, KV cache freed) and ``resume_memory`` wakes it. vLLM ignores sleep on CPU, so there both
are no-ops: the KV cache is one allocation made at start-up (``rollout.kv_cache_gib``; by default
what the engine can use at once, at most 1 GiB: workers/rollout/kv_cache_size.py), and weights stay
resident; size ``kv_cache_gib`` so that it and the training state fit in RAM.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Iterable

import torch
import torch.distributed as dist

from hybridflow.device import device_type
from hybridflow.model_overrides import apply_overrides, load_hf_config
from hybridflow import shm_names
from hybridflow.shm_group import unlink_shm_segment
from hybridflow.protocol import DataProto
from workers.rollout.hf_class_guard import give_back_transformers_classes
from workers.rollout.kv_cache_size import auto_kv_cache_bytes
from workers.rollout.base import (RolloutConfig, build_rollout_batch, generation_layout,
                                  prompt_token_lists, resolve_sampling, special_token_ids,
                                  truncate_at_stop)
from workers.rollout.vllm_partial import (POLL_S, TOKEN_VERSIONS, Switch, WeightSwitcher,
                                          switch_metrics, token_versions)
from workers.rollout.vllm_speculative import Speculation, speculative_kwargs
from workers.rollout.vllm_stepping import TAIL_SHARE, generate_per_sample
from workers.rollout.vllm_weight_sync import (ExpectedReloadWarnings, linears_keep_weights,
                                              load_live_weights, quiet_per_sync_logs,
                                              retie_lm_head, use_live_weights)

GiB = 1 << 30
log = logging.getLogger(__name__)


def check_generation_tp(tp_size: int, world_size: int, num_attention_heads: int) -> None:
    """Fail early, in one line, on a generation TP size vLLM cannot shard the model with."""
    if world_size % tp_size:
        raise ValueError(f"rollout.tensor_model_parallel_size={tp_size} must divide the worker "
                         f"group's world size {world_size}; pick a divisor of {world_size}")
    if num_attention_heads % tp_size:
        raise ValueError(f"rollout.tensor_model_parallel_size={tp_size} must divide the model's "
                         f"num_attention_heads={num_attention_heads}")


_ENGINES_IN_PROCESS = 0
_VLLM_INIT_CPU_SHM = None  # vLLM's own _CPUSHMDistributed._init_cpu_shm, once wrapped


def _isolate_cpu_shm_names(engine_ordinal: int) -> None:
    """Give vLLM's CPU shared-memory TP communicator a name unique to this world and engine, and
    leave nothing behind in /dev/shm.

    vLLM derives the name from the init method, which under external_launcher is always
    "env://", so two worlds on one machine or two TP engines in one process collide
    (``create shm in SHMManager failed. errno: 17``). MASTER_PORT identifies the world (same on
    all its ranks, distinct between live worlds); the ordinal separates engines built one after
    another in the same processes.

    vLLM never unlinks its segments (4 MiB per rank and engine), so they also piled up in
    /dev/shm across runs, holding RAM, until a later world drew a port already used and
    collided with a dead one's segment. Each rank now removes a stale segment of its name before
    creating it (no live world shares the name), and unlinks its own once every rank has joined:
    the mappings stay valid and the memory is freed when the engine's processes exit.

    A rank killed between creating and unlinking leaves its segment: the name carries rank 0's
    owner tag (a collective, like the engine build), so the next run removes it once that
    process is gone (hybridflow/shm_names.py), whether or not its CPU has the shared-memory kernels.
    """
    from vllm.distributed.device_communicators import cpu_communicator

    shm_names.sweep_stale()
    owner = [shm_names.owner_tag() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(owner, src=0)
    world_id = f"hf{os.environ.get('MASTER_PORT', '0')}e{engine_ordinal}-{owner[0]}"

    def make_group_name(communicator) -> str:
        ranks = "-".join(str(r) for r in communicator.ranks)
        return f"{world_id}-{communicator.unique_name}-[{ranks}]-cpushm"

    shm_distributed = cpu_communicator._CPUSHMDistributed
    shm_distributed.make_group_name = staticmethod(make_group_name)
    global _VLLM_INIT_CPU_SHM
    if _VLLM_INIT_CPU_SHM is None:
        _VLLM_INIT_CPU_SHM = shm_distributed._init_cpu_shm
        shm_distributed._init_cpu_shm = _init_cpu_shm_unlinked


def _init_cpu_shm_unlinked(self) -> int:
    unlink_shm_segment(self.group_name, self.communicator.rank)  # a dead world's, of the same name
    handle = _VLLM_INIT_CPU_SHM(self)  # ends with a barrier after every rank joined every segment
    unlink_shm_segment(self.group_name, self.communicator.rank)
    return handle


def _unlink_broadcast_rings() -> None:
    """vLLM's TP group broadcasts through a 24 MiB shared-memory ring (``MessageQueue``) that only
    its writer's garbage collection unlinks: every TP>1 run whose workers Ray killed at the end
    (what a worker group's shutdown does) left one in /dev/shm, holding RAM. Every reader mapped
    the ring while the group was built, so its name can go once the engine is up."""
    from vllm.distributed import parallel_state

    for get_group in list(parallel_state._groups.values()):
        buffer = getattr(getattr(get_group(), "mq_broadcaster", None), "buffer", None)
        if buffer is not None and getattr(buffer, "is_creator", False):
            buffer.shared_memory.unlink()
            buffer.is_creator = False  # else its __del__ unlinks the name a second time


class _NoTokenizerWarnings(logging.Filter):
    """Drops what vLLM warns on every engine build because the engine has no tokenizer by design
    (``skip_tokenizer_init``): a traceback from its chat-template warm-up, and "Using None for
    EOS token id" (EOS ids go in as ``stop_token_ids`` instead). A user reading ``make run``'s
    output took the traceback for a failure. Other warnings of these loggers still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "Chat template warmup failed" and record.exc_info:
            return "skip_tokenizer_init" not in str(record.exc_info[1])
        return not (isinstance(record.msg, str) and record.msg.startswith("Using None for ")
                    and record.msg.endswith("because tokenizer is not initialized"))


def _filter_once(logger_name: str, log_filter: logging.Filter) -> None:
    """Add ``log_filter`` to the logger unless one of its kind is there (an engine per process
    each calls this)."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, type(log_filter)) for f in logger.filters):
        logger.addFilter(log_filter)


def _engine_dtype(dtype: str, hf_config) -> str:
    """``auto`` means the checkpoint's dtype here (vLLM's own ``auto`` picks bfloat16 on CPU,
    which would silently diverge from an fp32 trainer)."""
    if dtype != "auto":
        return dtype
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return str(ckpt).removeprefix("torch.") if ckpt is not None else "auto"


def llm_kwargs(config: RolloutConfig, model_path: str, hf_config, dp_rank: int, on_gpu: bool) -> dict:
    """Every argument hybridflow itself gives vLLM's ``LLM(...)``. ``config.vllm_engine_kwargs``
    may add others but never replace these (hybridflow/config/rules.py names the key that
    sets each, for the check before any worker starts)."""
    kwargs = dict(
        model=model_path,
        tensor_parallel_size=config.tensor_model_parallel_size,
        distributed_executor_backend="external_launcher",
        enforce_eager=config.enforce_eager,
        dtype=_engine_dtype(config.dtype, hf_config),
        # same seed within a TP group (its ranks must sample identical tokens), a different
        # stream per generation-DP rank.
        seed=config.seed + dp_rank,
        skip_tokenizer_init=True,
        logprobs_mode="processed_logprobs",
        max_model_len=config.context_length,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_chunked_prefill=config.enable_chunked_prefill,
        # explicit, with vLLM's own defaults for a decoder LM as the config's defaults
        enable_prefix_caching=config.enable_prefix_caching,
        disable_log_stats=config.disable_log_stats,
        load_format=config.load_format,
        speculative_config=speculative_kwargs(config.speculative, config.max_num_seqs),
    )
    if config.hf_overrides:
        # vLLM calls it on the checkpoint's config: the training engines' function, so both build
        # one model (vLLM's dict form would drop a rope_theta override and replace rope_scaling whole)
        kwargs["hf_overrides"] = functools.partial(apply_overrides, overrides=dict(config.hf_overrides))
    if on_gpu:
        kwargs.update(gpu_memory_utilization=config.gpu_memory_utilization, enable_sleep_mode=True)
    elif config.kv_cache_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(config.kv_cache_gib * GiB)
    else:
        kwargs["kv_cache_memory_bytes"] = _auto_kv_cache_bytes(config, hf_config, kwargs["dtype"])
    return kwargs


def _auto_kv_cache_bytes(config: RolloutConfig, hf_config, dtype: str) -> int:
    """``rollout.kv_cache_gib=null``: what the engine can ever use at once (workers/rollout/kv_cache_size.py)."""
    spec = config.speculative if config.speculative.get("enable") else {}
    draft = None
    if spec.get("method") == "draft_model" and spec.get("draft_model_path"):
        draft = load_hf_config(spec["draft_model_path"], {})
    return auto_kv_cache_bytes(hf_config, dtype, config.max_num_seqs, config.context_length,
                               lookahead=int(spec.get("num_speculative_tokens", 0)), draft_hf_config=draft)


@contextlib.contextmanager
def _without_env(names: list[str]):
    """Hide environment variables while vLLM builds an engine, then put them back, so that other
    engines and libraries in this process still see the caller's values."""
    saved = {k: os.environ.pop(k) for k in names if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


class VLLMRollout:
    """The Rollout protocol (workers/rollout/base.py) on one vLLM engine per generation TP group.

    Several instances may live in one process (built one after another, same TP size), but keep
    each alive while any is in use: an engine's teardown destroys vLLM's process-wide parallel
    groups, which the others share.
    """

    def __init__(self, config: RolloutConfig, model_path: str):
        from transformers import GenerationConfig
        from vllm import LLM

        if not dist.is_initialized():
            raise RuntimeError("VLLMRollout needs the worker group's torch.distributed world: "
                               "call hybridflow.device.init_distributed() first")
        self.config = config
        rank, world = dist.get_rank(), dist.get_world_size()
        hf_config = load_hf_config(model_path, config.hf_overrides)
        tp = config.tensor_model_parallel_size
        check_generation_tp(tp, world, hf_config.num_attention_heads)
        self.dp_rank, self.dp_size, self.is_collect = generation_layout(rank, world, tp)
        try:
            gen_config = GenerationConfig.from_pretrained(model_path)
        except OSError:  # no generation_config.json
            gen_config = None
        self.pad_token_id, self.eos_token_ids = special_token_ids(hf_config, gen_config)
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self._on_gpu = device_type() == "cuda"

        engine_kwargs = llm_kwargs(config, model_path, hf_config, self.dp_rank, self._on_gpu)
        overridden = sorted(set(engine_kwargs) & set(config.vllm_engine_kwargs))
        if overridden:
            raise ValueError(f"rollout.vllm_engine_kwargs {overridden}: hybridflow sets these from its own "
                             "settings; remove them there and use those settings")
        global _ENGINES_IN_PROCESS
        _ENGINES_IN_PROCESS += 1
        hidden_env = []
        if not self._on_gpu:
            _isolate_cpu_shm_names(_ENGINES_IN_PROCESS)
            if "kv_cache_memory_bytes" in engine_kwargs:
                # vLLM's legacy whole-GiB VLLM_CPU_KVCACHE_SPACE would override the exact size
                hidden_env.append("VLLM_CPU_KVCACHE_SPACE")
        _filter_once("vllm.renderers.base", _NoTokenizerWarnings())
        live = config.cpu_live_weights and not self._on_gpu
        build = linears_keep_weights() if live else contextlib.nullcontext()
        with build, _without_env(hidden_env):
            self.llm = LLM(**engine_kwargs, **config.vllm_engine_kwargs)
        give_back_transformers_classes(self.llm)  # the training engine in this process builds them too
        _unlink_broadcast_rings()
        # after the engine: building it re-applies vLLM's logging config, levels included
        _filter_once("vllm.model_executor.model_loader.reload.layerwise",
                     ExpectedReloadWarnings(self.tied))
        quiet_per_sync_logs()
        # None: syncs copy into live weights; else why this engine needs vLLM's full reload
        if live:
            self.why_full_reload = self.llm.collective_rpc(use_live_weights)[0]
            if self.why_full_reload:
                log.info("vLLM weight sync: full reload on every sync (%s)", self.why_full_reload)
        else:
            self.why_full_reload = "GPU" if self._on_gpu else "rollout.cpu_live_weights=false"
        self._warned_missing = False
        self._asleep = False
        # drafts verified by the policy (workers/rollout/vllm_speculative.py)
        self.speculation = Speculation(self.llm, config.speculative) if config.speculative.get("enable") else None
        # multi-turn, tool-using trajectories (workers/rollout/vllm_agent.py); None: single-turn
        self.agent = None
        if config.multi_turn.get("enable"):
            from workers.rollout.vllm_agent import AgentRunner

            self.agent = AgentRunner.from_config(config.multi_turn, config.prompt_length, config.response_length)

    # ------------------------------------------------------------------ generation
    def generate_sequences(self, prompts: DataProto, switch: Switch | None = None, version: int = 0,
                           poll_s: float = POLL_S) -> DataProto:
        """Generate n responses per prompt for this generation-DP rank's share of the batch.

        Partial rollout (workers/rollout/vllm_partial.py): with ``switch``, polled between engine
        steps, unfinished samples go on with the weights it offers; the batch then also holds
        ``rollout_token_versions`` (the version that sampled each response token, -1 at padding;
        ``version`` is the engine's weights' at the start) and the metrics
        ``rollout/partial_samples`` and ``rollout/weight_switches``. Every rank of a TP group
        passes a switch or none."""
        from vllm import SamplingParams

        settings = resolve_sampling(self.config, prompts.meta_info, self.eos_token_ids)
        if self.agent is not None:
            from workers.rollout.vllm_agent import generate_agent_sequences

            eager = contextlib.nullcontext() if self._on_gpu else torch.compiler.set_stance("force_eager")
            with eager:
                return generate_agent_sequences(self.llm, self.agent, prompts, settings, self.pad_token_id,
                                                self.config.context_length)
        token_lists = prompt_token_lists(prompts, self.config.prompt_length)
        params = SamplingParams(
            n=settings.n,
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
            max_tokens=settings.max_tokens,
            stop_token_ids=list(settings.stop_token_ids),
            # vLLM would also stop at the EOS ids of the checkpoint's generation_config
            ignore_eos=settings.ignore_eos,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,
        )
        eager = contextlib.nullcontext() if self._on_gpu else torch.compiler.set_stance("force_eager")
        switcher = None
        hook = {}
        if switch is not None:
            switcher = WeightSwitcher(self, switch, version, poll_s)
            hook = {"before_step": switcher}
        spec_since = self.speculation.snapshot() if self.speculation else None
        with eager:
            # generate() with each sample's finish timed (workers/rollout/vllm_stepping.py)
            completions, tail = generate_per_sample(self.llm, token_lists, params, **hook)
        samples = []
        for per_prompt_completions in completions:
            per_prompt = []
            for comp in per_prompt_completions:
                tokens = list(comp.token_ids)
                lps = [step[tok].logprob for tok, step in zip(tokens, comp.logprobs)]
                per_prompt.append(truncate_at_stop(tokens, lps, settings.stop_token_ids,
                                                   settings.max_tokens))
            samples.append(per_prompt)
        out = build_rollout_batch(prompts, samples, self.config.response_length, self.pad_token_id)
        out.meta_info["metrics"] = {TAIL_SHARE: tail}
        if spec_since is not None:
            out.meta_info["metrics"].update(self.speculation.metrics(spec_since))
        if switcher is not None:
            versions = token_versions(completions, out.batch["response_mask"].sum(1), self.config.response_length)
            out.batch[TOKEN_VERSIONS] = versions
            out.meta_info["metrics"].update(switch_metrics(versions, switcher))
        return out

    # ------------------------------------------------------------------ weights and memory
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named full tensors in place (vLLM shards them for this TP rank)."""
        if self._asleep:
            raise RuntimeError("VLLMRollout.update_weights: call resume_memory() first")
        # external_launcher runs the RPC in this process, so a lazy iterator is passed through
        # as is: the caller's tensors are consumed one at a time, never all held at once
        weights = ((name, t.detach()) for name, t in weights)
        if self.why_full_reload is None:
            missing = self.llm.collective_rpc(load_live_weights, kwargs={"weights": weights})[0]
            if missing and not self._warned_missing:
                self._warned_missing = True
                log.warning("vLLM weight sync loaded nothing into %d parameters: %s",
                            len(missing), ", ".join(missing[:8]))
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            if self.tied:
                self.llm.collective_rpc(retie_lm_head)
        # cached KV blocks were computed with the old weights
        self.llm.reset_prefix_cache()

    def release_memory(self) -> None:
        """GPU: sleep (offload weights, free KV cache). CPU: no-op (see module docstring)."""
        if self._on_gpu and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def resume_memory(self) -> None:
        if self._on_gpu and self._asleep:
            self.llm.wake_up()
            self._asleep = False
