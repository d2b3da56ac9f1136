"""The rollout contract (docs/contracts.md "Rollout") and the post-processing every backend shares.

A backend only has to turn a list of prompt token ids into, per prompt, ``n`` lists of generated
token ids with the sampler's log-prob of each; :func:`build_rollout_batch` turns those into the
padded RL batch (``responses``, ``response_mask``, ``input_ids``, ``attention_mask``,
``position_ids``, ``rollout_log_probs``) so vLLM and transformers produce byte-identical layouts.

"Sampler's log-prob" means the log-prob under the distribution the token was actually drawn from:
``log_softmax(logits / temperature)`` after top-k/top-p truncation (with top_k/top_p off this is
exactly the contract's formula). Greedy decoding (``do_sample=False``) reports temperature-1
log-probs.

``ignore_eos`` (vLLM's ``SamplingParams.ignore_eos``): EOS is generated like any other token and
is no stop token here either, so responses run to ``max_tokens`` (or a caller's extra stop id).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence

import torch

from hybridflow.protocol import DataProto

ROLLOUT_NAMES = ("vllm", "hf")
# meta_info keys a caller may set per generate_sequences call to override the config.
SAMPLING_OVERRIDE_KEYS = ("n", "temperature", "top_p", "top_k", "max_tokens", "do_sample",
                          "ignore_eos", "stop_token_ids")


@dataclass
class RolloutConfig:
    """Settings of ``actor_rollout_ref.rollout`` (verl's key names).

    ``response_length`` is the padded response width R and the default ``max_tokens``;
    ``max_tokens`` in meta_info may lower it per call, never raise it. ``top_k=-1`` and
    ``top_p=1.0`` disable truncation. ``kv_cache_gib`` sizes vLLM's KV cache on CPU, to the byte (it
    takes precedence over vLLM's whole-GiB ``VLLM_CPU_KVCACHE_SPACE``; None: what ``max_num_seqs``
    sequences of the whole context need, at most 1 GiB, workers/rollout/kv_cache_size.py); on GPU
    ``gpu_memory_utilization`` does.
    ``cpu_live_weights`` (CPU, vLLM) keeps plain weights beside vLLM's packed kernels so weight
    syncs skip vLLM's rebuild (workers/rollout/vllm_weight_sync.py); off saves that RAM.
    ``free_cache_engine`` tells the hybrid worker to call ``release_memory()`` after each
    generation phase and ``resume_memory()`` before the next weight sync.
    ``do_sample=False`` makes every call greedy unless its meta_info says otherwise; ``ignore_eos``
    likewise (see the module docstring). vLLM only: ``max_model_len`` is the engine's context
    (None: ``prompt_length + response_length``); ``enable_prefix_caching``, ``disable_log_stats``
    and ``load_format`` are vLLM's arguments of those names (``"dummy"``: random weights, which the
    hybrid worker replaces by syncing the actor's before the first generation);
    ``vllm_engine_kwargs`` go to vLLM's ``LLM(...)`` as given. ``hf_overrides`` is the actor's
    ``model.override_config``: vLLM builds its model from the checkpoint's config with the same
    attributes replaced as the training engines (``hybridflow/model_overrides.py``).
    """

    name: str = "vllm"
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    prompt_length: int = 512
    response_length: int = 512
    tensor_model_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    kv_cache_gib: float | None = None
    cpu_live_weights: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # vLLM's tokens per engine step; None: its default
    enable_chunked_prefill: bool = True
    enforce_eager: bool = True
    dtype: str = "auto"
    seed: int = 0
    free_cache_engine: bool = True
    stop_token_ids: list[int] = field(default_factory=list)
    do_sample: bool = True
    ignore_eos: bool = False
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    disable_log_stats: bool = True
    load_format: str = "auto"
    vllm_engine_kwargs: dict = field(default_factory=dict)
    hf_overrides: dict = field(default_factory=dict)
    # rollout.speculative's keys (hybridflow/config/speculative.py); empty: off
    speculative: dict = field(default_factory=dict)
    # rollout.multi_turn's keys plus agent.default_agent_loop, the tokenizer's folder and chat template
    # (recipes/engine_settings.py; workers/rollout/vllm_agent.py); empty or enable false: single-turn
    multi_turn: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.name not in ROLLOUT_NAMES:
            raise ValueError(f"rollout.name={self.name!r} is unknown: use one of {ROLLOUT_NAMES}")
        for key in ("n", "prompt_length", "response_length", "tensor_model_parallel_size",
                    "max_num_seqs"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"rollout.{key}={getattr(self, key)} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"rollout.temperature={self.temperature} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"rollout.top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"rollout.top_k={self.top_k} must be -1 (off) or >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"rollout.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        longest = self.prompt_length + self.response_length
        if self.max_model_len is not None and self.max_model_len < longest:
            raise ValueError(f"rollout.max_model_len={self.max_model_len} must be >= prompt_length + "
                             f"response_length = {longest}: raise it or set it to None")

    @property
    def context_length(self) -> int:
        """The engine's maximum tokens per sequence (vLLM's max_model_len)."""
        return self.max_model_len or self.prompt_length + self.response_length

    @classmethod
    def from_dict(cls, cfg: dict) -> "RolloutConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(cfg) - known - {"max_tokens"})
        if unknown:
            raise ValueError(f"rollout: unknown settings {unknown}; known: {sorted(known)}")
        cfg = dict(cfg)
        if "max_tokens" in cfg:  # vLLM's name for the response length
            cfg.setdefault("response_length", cfg.pop("max_tokens"))
            cfg.pop("max_tokens", None)
        return cls(**cfg)


@dataclass(frozen=True)
class SamplingSettings:
    """The sampling settings of one generate call: the config, overridden by meta_info."""

    n: int
    temperature: float  # 0 means greedy
    top_p: float
    top_k: int
    max_tokens: int
    stop_token_ids: tuple[int, ...]  # EOS ids first (none with ignore_eos), then the caller's extra stop ids
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def resolve_sampling(config: RolloutConfig, meta_info: dict, eos_token_ids: Sequence[int]
                     ) -> SamplingSettings:
    """Merge per-call overrides (meta_info) into the config's sampling settings.

    ``do_sample=False`` (validation, or the config's greedy training rollouts) means greedy with
    one sample per prompt unless the caller also passes ``n``; top-k/top-p are then irrelevant
    and reset. ``ignore_eos`` leaves the EOS ids out of the stop tokens.
    """
    meta = meta_info or {}
    n = int(meta.get("n", config.n))
    temperature = float(meta.get("temperature", config.temperature))
    top_p = float(meta.get("top_p", config.top_p))
    top_k = int(meta.get("top_k", config.top_k))
    max_tokens = int(meta.get("max_tokens", config.response_length))
    if not meta.get("do_sample", config.do_sample):
        temperature, top_p, top_k = 0.0, 1.0, -1
        n = int(meta.get("n", 1))
    if n < 1:
        raise ValueError(f"rollout: n={n} must be >= 1")
    if not 1 <= max_tokens <= config.response_length:
        raise ValueError(f"rollout: max_tokens={max_tokens} must be in [1, rollout.response_length="
                         f"{config.response_length}]; raise response_length to generate more")
    ignore_eos = bool(meta.get("ignore_eos", config.ignore_eos))
    extra = meta.get("stop_token_ids", config.stop_token_ids) or []
    eos = [] if ignore_eos else [int(t) for t in eos_token_ids]
    stops = tuple(dict.fromkeys(eos + [int(t) for t in extra]))
    return SamplingSettings(n, temperature, top_p, top_k, max_tokens, stops, ignore_eos)


def prompt_token_lists(prompts: DataProto, prompt_length: int) -> list[list[int]]:
    """Real (unpadded) token ids of each left-padded prompt; too-long prompts are an error.

    Filtering overlong prompts is the data layer's job (``data.filter_overlong_prompts``); a long
    prompt reaching the rollout would silently change the P+R layout, so it fails here.
    """
    input_ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    out = []
    for row, (ids, m) in enumerate(zip(input_ids.tolist(), mask.tolist())):
        tokens = [t for t, keep in zip(ids, m) if keep]
        if len(tokens) > prompt_length:
            raise ValueError(
                f"rollout: prompt {row} has {len(tokens)} tokens > rollout.prompt_length="
                f"{prompt_length}; raise data.max_prompt_length or filter overlong prompts in data")
        if not tokens:
            raise ValueError(f"rollout: prompt {row} is empty (attention_mask all zero)")
        out.append(tokens)
    return out


def truncate_at_stop(tokens: Sequence[int], log_probs: Sequence[float], stop_ids: Sequence[int],
                     max_tokens: int) -> tuple[list[int], list[float]]:
    """Keep tokens up to and including the first stop token, and at most max_tokens."""
    stops = set(stop_ids)
    for i, tok in enumerate(tokens[:max_tokens]):
        if tok in stops:
            return list(tokens[: i + 1]), list(log_probs[: i + 1])
    return list(tokens[:max_tokens]), list(log_probs[:max_tokens])


def build_rollout_batch(prompts: DataProto, samples: Sequence[Sequence[tuple[list[int], list[float]]]],
                        response_length: int, pad_token_id: int) -> DataProto:
    """Assemble the RL batch from generated tokens.

    ``samples[i]`` holds the n ``(token_ids, log_probs)`` of prompt i (already cut at the stop
    token). Output rows are prompt-major (the n samples of one prompt adjacent); non-tensor
    columns and meta_info of ``prompts`` are repeated/kept.
    """
    n = len(samples[0]) if samples else 1
    if any(len(s) != n for s in samples):
        raise ValueError("build_rollout_batch: every prompt needs the same number of samples")
    rows = [pair for per_prompt in samples for pair in per_prompt]
    responses = torch.full((len(rows), response_length), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((len(rows), response_length), dtype=torch.long)
    log_probs = torch.zeros((len(rows), response_length), dtype=torch.float32)
    for r, (tokens, lps) in enumerate(rows):
        if len(tokens) != len(lps):
            raise ValueError(f"row {r}: {len(tokens)} tokens but {len(lps)} log-probs")
        if len(tokens) > response_length:
            raise ValueError(f"row {r}: {len(tokens)} tokens > response_length={response_length}")
        k = len(tokens)
        responses[r, :k] = torch.tensor(tokens, dtype=torch.long)
        response_mask[r, :k] = 1
        log_probs[r, :k] = torch.tensor(lps, dtype=torch.float32)

    repeated = prompts.repeat(n, interleave=True)
    tensors = rl_batch_tensors(repeated.batch["input_ids"].long(), repeated.batch["attention_mask"].long(),
                               responses, response_mask, log_probs)
    return DataProto.from_dict(tensors=tensors, non_tensors=repeated.non_tensor_batch,
                               meta_info=dict(prompts.meta_info))


def rl_batch_tensors(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor,
                     response_mask: torch.Tensor, log_probs: torch.Tensor,
                     response_attention: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The RL batch's tensors from left-padded prompts and right-padded responses.
    ``response_attention`` marks the response's real tokens where they are more than the trained
    ones (a trajectory's tool tokens: attended to, not trained); by default ``response_mask``."""
    attention_mask = torch.cat([prompt_mask, response_mask if response_attention is None else response_attention],
                               dim=1)
    return {
        "prompts": prompt_ids,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0),
        "rollout_log_probs": log_probs,
    }


def generation_layout(rank: int, world_size: int, tp_size: int) -> tuple[int, int, bool]:
    """(dp_rank, dp_size, is_collect) of a rank: generation TP groups are consecutive ranks."""
    if world_size % tp_size:
        raise ValueError(f"rollout.tensor_model_parallel_size={tp_size} must divide the worker "
                         f"group's world size {world_size}")
    return rank // tp_size, world_size // tp_size, rank % tp_size == 0


class Rollout(Protocol):
    """Generation for one worker group; built after its torch.distributed world is initialised."""

    dp_rank: int
    dp_size: int
    is_collect: bool

    def generate_sequences(self, prompts: DataProto) -> DataProto: ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def release_memory(self) -> None: ...

    def resume_memory(self) -> None: ...


def special_token_ids(hf_config, generation_config=None) -> tuple[int, list[int]]:
    """(pad_token_id, eos_token_ids) of a model: generation_config first, then the model config.

    A model without a pad id pads responses with its first EOS id (the mask marks padding).
    """
    def pick(name):
        for cfg in (generation_config, hf_config):
            value = getattr(cfg, name, None) if cfg is not None else None
            if value is not None:
                return value
        return None

    eos = pick("eos_token_id")
    if eos is None:
        raise ValueError("rollout: the model config has no eos_token_id; set it in config.json")
    eos_ids = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    pad = pick("pad_token_id")
    return (int(pad) if pad is not None else eos_ids[0]), eos_ids
