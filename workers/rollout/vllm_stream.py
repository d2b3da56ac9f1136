"""Streaming generation with tail migration (issue 34, RLHFuse inter-stage fusion) on a VLLMRollout.

The controller drives one session per engine in slices of engine steps: ``step(k)`` returns the
samples that finished since the last call as rows of exactly generate_sequences' layout (plus
``row_index``), so reward/reference/critic can start on them while the long tail still generates.
When few samples are left, ``export()`` aborts them (``export(count)``: some of them, to even out
the ranks' work: sample reallocation) and hands each over as a :class:`Partial`
(prompt row + generated prefix + its log-probs); another engine's ``adopt()`` enqueues
"prompt + prefix" with the tokens left and, when the sample finishes, reports prefix + new tokens
and log-probs as if the sample had never moved (the receiver recomputes the prefix's KV cache in
one prefill; greedy tokens are those of an unmoved run, log-probs equal to fp32 rounding).

Why one request per sample (``n = 1``) and not vLLM's n > 1 parent requests (vllm_stepping.py):
a parent hands its children's outputs over only once all of them finished, and an unfinished
child's tokens would have to be dug out of the parent for export; with one request per sample
each finish is the step's own RequestOutput and each unfinished sample's tokens and log-probs are
its request's output-processor state. Cost measured on a small batch (tests, report): vLLM
renders and checks each request apart, about +10% per call at n = 8. Sampled tokens therefore
differ from generate_sequences' (another request layout draws other noise); greedy ones do not.

Determinism: a step call runs ``max_steps`` engine steps or until nothing is left, never a
clock, so the ranks of one generation TP group (one engine stepped in lockstep under
external_launcher) stay in step when given the same ``max_steps``. On CPU the engine steps under
``force_eager`` as generate_sequences does (vllm_rollout.py explains the compile it avoids).

vLLM 0.32 internals read here (as vllm_partial.py does): ``OutputProcessor.external_req_ids`` and
``request_states[...].detokenizer.output_token_ids`` / ``.logprobs_processor.logprobs``, the
generated tokens and log-probs an unfinished request holds. ``_check_internals`` fails in one line
on a vLLM that moved them.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from hybridflow.protocol import DataProto
from workers.rollout.base import (SamplingSettings, build_rollout_batch, prompt_token_lists, resolve_sampling,
                                  truncate_at_stop)
from workers.rollout.vllm_stepping import TAIL_SHARE, tail_share

ROW_INDEX = "row_index"
EXPORTED = "rollout/stream_exported"  # samples this session handed to another engine
ADOPTED = "rollout/stream_adopted"  # samples this session took over from another engine


@dataclass
class Partial:
    """An unfinished sample on its way to another engine (pickle-safe, for Ray).

    ``prompt``: its prompt's 1-row DataProto (input_ids, attention_mask, position_ids and the
    prompt's non-tensor columns and meta_info, without ``row_index``); ``row_index``: the sample's
    own row; ``token_ids`` / ``log_probs``: every token generated so far (on any engine) and its
    sampler log-prob; ``settings``: the sampling settings it started with (``max_tokens`` is its
    whole budget, :attr:`tokens_left` what remains)."""

    prompt: DataProto
    row_index: int
    token_ids: list[int]
    log_probs: list[float]
    settings: SamplingSettings

    @property
    def tokens_left(self) -> int:
        return self.settings.max_tokens - len(self.token_ids)


@dataclass
class _Sample:
    prompt: DataProto
    row_index: int
    prefix: list[int]  # tokens generated before this engine took the sample (adopted), else []
    prefix_log_probs: list[float]
    settings: SamplingSettings


def _sampling_params(settings: SamplingSettings, max_tokens: int):
    from vllm import SamplingParams

    # generate_sequences' parameters, one sample per request (module docstring)
    return SamplingParams(n=1, temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                          max_tokens=max_tokens, stop_token_ids=list(settings.stop_token_ids),
                          ignore_eos=settings.ignore_eos, logprobs=0, detokenize=False)


def _check_internals(engine) -> None:
    processor = engine.output_processor
    if not (hasattr(processor, "external_req_ids") and hasattr(processor, "request_states")):
        raise RuntimeError("vLLM's OutputProcessor has no external_req_ids/request_states: this vLLM version keeps "
                           "per-request state elsewhere (workers/rollout/vllm_stream.py needs it for export)")


class VLLMStream:
    """One streaming session on ``rollout``'s engine; only one may be open per engine."""

    def __init__(self, rollout):
        if getattr(rollout, "_open_stream", None) is not None:
            raise RuntimeError("VLLMStream: this engine already has an open stream session; export() or finish it first")
        self.rollout, self.llm = rollout, rollout.llm
        self.engine = self.llm.llm_engine
        _check_internals(self.engine)
        if self.engine.has_unfinished_requests():
            raise RuntimeError("VLLMStream: the engine still holds requests of another call")
        self._samples: dict[str, _Sample] = {}  # vLLM request id -> the sample it generates
        self._finished: list[tuple[_Sample, list[int], list[float]]] = []  # not yet returned by step()
        self._finish_times: list[float] = []
        self._start = time.perf_counter()
        self.exported = self.adopted = 0
        self.closed = False
        speculation = getattr(rollout, "speculation", None)  # rollout.speculative: its metrics over this session
        self._spec_since = speculation.snapshot() if speculation is not None else None
        rollout._open_stream = self

    # ------------------------------------------------------------------ the calls
    def start(self, prompts: DataProto | None) -> int:
        """Enqueue n samples per prompt (None or no rows: a session that only adopts). Returns the
        number of samples queued."""
        if prompts is None or len(prompts) == 0:
            return 0
        if ROW_INDEX not in prompts.batch.keys():
            raise ValueError(f"VLLMStream.start: prompts need an int64 '{ROW_INDEX}' column (the global row of "
                             "each prompt's first sample)")
        config = self.rollout.config
        settings = resolve_sampling(config, prompts.meta_info, self.rollout.eos_token_ids)
        token_lists = prompt_token_lists(prompts, config.prompt_length)
        firsts = prompts.batch[ROW_INDEX].tolist()
        rows = _prompt_rows(prompts)
        samples = [_Sample(rows[i], int(firsts[i]) + j, [], [], settings)
                   for i in range(len(prompts)) for j in range(settings.n)]
        requests = [{"prompt_token_ids": list(tokens)} for tokens in token_lists for _ in range(settings.n)]
        self._enqueue(requests, _sampling_params(settings, settings.max_tokens), samples)
        return len(samples)

    def step(self, max_steps: int) -> tuple[DataProto | None, int, int]:
        """Up to ``max_steps`` engine steps (fewer when nothing is left); returns (the rows finished
        since the last call, sorted by row_index, or None; samples unfinished; steps run)."""
        self._check_open()
        steps = 0
        with self._eager():
            while steps < max_steps and self._samples:
                outputs = self.engine.step()
                steps += 1
                now = time.perf_counter()
                for out in outputs:
                    if out.finished:
                        self._take(out, now)
        return self._rows(), len(self._samples), steps

    def export(self, count: int | None = None, unstarted_only: bool = False) -> list[Partial]:
        """Abort ``count`` unfinished samples (None: every one) and return what another engine needs
        to go on with them; the session goes on with the rest.

        A partial export (sample reallocation) takes the samples with the fewest tokens generated
        (ties: the lowest row_index, so every rank of a TP group picks the same ones): the receiver
        recomputes each moved sample's KV cache over prompt + prefix, so short prefixes are the
        cheapest to move, and a sample that has run long keeps the cache it already paid for.
        ``unstarted_only``: only samples with no token generated yet (:attr:`unstarted`), fewer
        than ``count`` if fewer are left."""
        self._check_open()
        held = [(request_id, sample, self._state(request_id)) for request_id, sample in self._samples.items()]
        if unstarted_only:
            held = [h for h in held if _generated(h[1], h[2]) == 0]
        if count is not None and count < len(held):
            held = sorted(held, key=lambda h: (_generated(h[1], h[2]), h[1].row_index))[:max(0, int(count))]
        partials = []
        for _, sample, state in held:
            tokens = list(state.detokenizer.output_token_ids)
            log_probs = [step[tok].logprob for tok, step in zip(tokens, state.logprobs_processor.logprobs)]
            partials.append(Partial(sample.prompt, sample.row_index, sample.prefix + tokens,
                                    sample.prefix_log_probs + log_probs, sample.settings))
        ids = [request_id for request_id, _, _ in held]
        if ids:
            self.engine.abort_request(ids, internal=False)
        for request_id in ids:
            del self._samples[request_id]
        if not self._samples and self.engine.has_unfinished_requests():
            raise RuntimeError("VLLMStream.export: the engine still has requests after aborting the session's")
        self.exported += len(partials)
        return sorted(partials, key=lambda p: p.row_index)

    def adopt(self, partials: list[Partial], first: bool = False) -> int:
        """Go on with samples another engine exported (prompt + prefix, max_tokens = what is left).
        ``first``: they start before this engine's own waiting samples (vLLM's priority policy,
        which the engine must have been built with: ``scheduling_policy="priority"``); else they
        wait behind them (first come, first served). Returns the number of samples taken."""
        if first and not self._priority_policy():
            raise ValueError("VLLMStream.adopt(first=True) needs an engine built with scheduling_policy='priority' "
                             "(rollout.reallocation.adopted_first sets it)")
        self._check_open()
        requests, params, samples = [], [], []
        now = time.perf_counter()
        for p in partials:
            sample = _Sample(p.prompt, int(p.row_index), list(p.token_ids), list(p.log_probs), p.settings)
            if p.tokens_left <= 0:  # exported on its last token's step: nothing to generate
                self._finished.append((sample, [], []))
                self._finish_times.append(now)
                continue
            prompt = prompt_token_lists(p.prompt, self.rollout.config.prompt_length)[0]
            requests.append({"prompt_token_ids": prompt + list(p.token_ids)})
            params.append(_sampling_params(p.settings, p.tokens_left))
            samples.append(sample)
        if requests:
            self._enqueue(requests, params, samples, priority=[-1] * len(requests) if first else None)
        self.adopted += len(partials)
        return len(partials)

    @property
    def unfinished(self) -> int:
        return len(self._samples)

    def progress(self) -> list[tuple[int, int, int]]:
        """(row_index, tokens generated so far on any engine, the sample's max_tokens) of each
        unfinished sample: what sample reallocation estimates a rank's remaining work from
        (hybridflow/controller/remaining_work.py); 0 tokens: still waiting for a place in the batch."""
        return [(sample.row_index, _generated(sample, self._state(request_id)), sample.settings.max_tokens)
                for request_id, sample in self._samples.items()]

    @property
    def unstarted(self) -> int:
        """Unfinished samples with no token generated yet: those still waiting for a place in the
        engine's batch (or prefilled in the step that ends now). Moving them costs the receiver
        no recomputed prefix and leaves no partly run answer to restart late."""
        return sum(tokens == 0 for _, tokens, _ in self.progress())

    def metrics(self) -> dict[str, float]:
        """``perf/gen_tail_share`` over the samples this session finished, and the moves."""
        out = {TAIL_SHARE: tail_share(self._start, self._finish_times),
               EXPORTED: float(self.exported), ADOPTED: float(self.adopted)}
        if self._spec_since is not None:
            out.update(self.rollout.speculation.metrics(self._spec_since))
        return out

    def close(self) -> None:
        """End the session (aborting anything left: export() first to keep it)."""
        if self.closed:
            return
        if self._samples:
            self.engine.abort_request(list(self._samples), internal=False)
            self._samples.clear()
        self.closed = True
        self.rollout._open_stream = None

    # ------------------------------------------------------------------ internals
    def _state(self, request_id: str):
        processor = self.engine.output_processor
        return processor.request_states[processor.external_req_ids[request_id][0]]

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("VLLMStream: the session is closed")

    def _eager(self):
        return contextlib.nullcontext() if self.rollout._on_gpu else torch.compiler.set_stance("force_eager")

    def _priority_policy(self) -> bool:
        return str(self.engine.vllm_config.scheduler_config.policy) == "priority"

    def _enqueue(self, requests: list[dict], params, samples: list[_Sample], priority=None) -> None:
        internal = self.llm.enqueue(requests, params, priority=priority, use_tqdm=False)
        if len(internal) != len(samples):
            raise RuntimeError(f"vLLM enqueued {len(internal)} requests for {len(samples)} samples")
        # enqueue returns vLLM's internal ids; a step's outputs, and abort, use the external ones
        states = self.engine.output_processor.request_states
        self._samples.update((states[i].external_req_id, s) for i, s in zip(internal, samples))

    def _take(self, out, now: float) -> None:
        sample = self._samples.pop(out.request_id)
        comp = out.outputs[0]
        tokens = list(comp.token_ids)
        log_probs = [step[tok].logprob for tok, step in zip(tokens, comp.logprobs)]
        self._finished.append((sample, tokens, log_probs))
        self._finish_times.append(now)

    def _rows(self) -> DataProto | None:
        if not self._finished:
            return None
        done = sorted(self._finished, key=lambda f: f[0].row_index)
        self._finished = []
        samples = []
        for sample, tokens, log_probs in done:
            s = sample.settings
            # the whole response (prefix from other engines + this one's) cut as generate_sequences cuts it
            samples.append([truncate_at_stop(sample.prefix + tokens, sample.prefix_log_probs + log_probs,
                                             s.stop_token_ids, s.max_tokens)])
        prompts = DataProto.concat([sample.prompt for sample, _, _ in done])
        out = build_rollout_batch(prompts, samples, self.rollout.config.response_length, self.rollout.pad_token_id)
        out.batch[ROW_INDEX] = torch.tensor([sample.row_index for sample, _, _ in done], dtype=torch.int64)
        return out


def _generated(sample: _Sample, state) -> int:
    """Tokens a sample has generated so far, on any engine."""
    return len(sample.prefix) + len(state.detokenizer.output_token_ids)


def _prompt_rows(prompts: DataProto) -> list[DataProto]:
    """Each prompt as its own 1-row DataProto, without ``row_index`` (a sample's row is its own)."""
    base = DataProto(batch=prompts.batch.exclude(ROW_INDEX), non_tensor_batch=prompts.non_tensor_batch,
                     meta_info={k: v for k, v in prompts.meta_info.items() if k != "metrics"})
    return [base[i] for i in range(len(prompts))]
