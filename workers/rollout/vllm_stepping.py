"""``LLM.generate`` by hand, to see when each sample finishes: ``perf/gen_tail_share``.

``LLM.generate`` gathers the n samples of a prompt into one RequestOutput that is returned once the
last of them finishes, and its timestamps (``RequestOutput.metrics``, with log stats on) are that
last sample's: no per-sample finish time can be read from it.

Here ``generate`` is split into its two public halves: ``LLM.enqueue`` adds the requests exactly as
``generate`` does, and the engine is stepped as ``generate`` steps it (``LLM._run_engine``:
``step()`` until no request is unfinished), so tokens and log-probs are those of ``generate``
(tests/workers/rollout/test_vllm_rollout.py replays a call through ``generate`` and compares).
After each step the samples that finished in it are counted: vLLM runs a prompt with ``n > 1`` as
n child requests of a parent request that holds the children not yet finished
(``OutputProcessor.parent_requests``, ``ParentRequest.child_requests``).

Why not other ways: one request of ``n = 1`` per sample gives the same tokens, but renders and
checks every sample's request apart (+8 ms, +10%, on the demo's 32 prompts x 8 samples per rank);
``RequestOutputKind.CUMULATIVE`` or ``DELTA`` report finished children early but build an output
object per running sample per step. Counting costs a dict look-up per unfinished prompt per step.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

# one value per call and generation-DP rank (each times its own share of the prompts); the collected
# batch holds the mean over ranks (DataProto.concat), which is what a step logs
TAIL_SHARE = "perf/gen_tail_share"


def tail_share(start: float, finish_times: Sequence[float]) -> float:
    """(last sample's finish - median sample's finish) / (last finish - start): the share of a
    generate call spent finishing the slowest half of its samples, 0 when all end together.
    The median of an even count is the mean of the middle two."""
    if not finish_times:
        return 0.0
    last = max(finish_times)
    span = last - start
    return (last - statistics.median(finish_times)) / span if span > 0 else 0.0


def generate_per_sample(llm, token_lists: Sequence[Sequence[int]], params,
                        before_step: Callable[[], None] | None = None) -> tuple[list[list], float]:
    """``llm.generate(prompts, params)``, each sample's finish timed; returns, per prompt, its
    samples' CompletionOutputs sorted by ``index`` (what generate's RequestOutput holds), and the
    call's tail share (:func:`tail_share`; a finish is timed when the step that finished it returns).
    ``before_step`` runs before each engine step; it may preempt requests (a weight switch,
    workers/rollout/vllm_partial.py) but must neither add nor abort any."""
    engine = llm.llm_engine
    start = time.perf_counter()
    ids = llm.enqueue([{"prompt_token_ids": list(tokens)} for tokens in token_lists], params, use_tqdm=False)
    # the engine's own ids of the prompts (its parent requests when n > 1), with samples left to finish
    left = dict.fromkeys(ids, params.n)
    parents = engine.output_processor.parent_requests
    if params.n > 1 and not all(request_id in parents for request_id in ids):
        # else every sample would count as finished at the first step: a wrong 0, silently
        raise RuntimeError("vLLM's output processor keeps no parent request under the id enqueue() "
                           "returned: this vLLM version tracks n > 1 differently (workers/rollout/vllm_stepping.py)")
    outputs, finished_at = [], []
    while engine.has_unfinished_requests():
        if before_step is not None:
            before_step()
        step_outputs = engine.step()
        now = time.perf_counter()
        for out in step_outputs:
            if out.finished:
                outputs.append(out)
                if params.n == 1:
                    finished_at.append(now)
        if params.n > 1:
            for request_id, before in list(left.items()):
                # a parent holds its unfinished children; it is dropped once all have finished
                parent = parents.get(request_id)
                still = len(parent.child_requests) if parent is not None else 0
                if still < before:
                    finished_at.extend([now] * (before - still))
                    if still:
                        left[request_id] = still
                    else:
                        del left[request_id]
    if len(outputs) != len(ids):
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(ids)} prompts")
    outputs.sort(key=lambda o: int(o.request_id))  # the order added, as generate() sorts them
    return [sorted(out.outputs, key=lambda c: c.index) for out in outputs], tail_share(start, finished_at)
