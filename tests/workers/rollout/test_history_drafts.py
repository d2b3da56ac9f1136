"""History drafts and the adaptive draft count, without vLLM: where a draft comes from
(workers/rollout/history_drafts.py) and which count the measurements choose
(workers/rollout/adaptive_drafting.py)."""
from types import SimpleNamespace

import numpy as np
import pytest

from workers.rollout.adaptive_drafting import DraftTuner
from workers.rollout.history_drafts import HistoryDrafter, PromptHistory


def test_an_earlier_answer_at_the_same_position_is_the_draft():
    h = PromptHistory([1, 2, 3], min_n=2, max_n=4)
    old = h.new_doc(h.tail + [7, 8, 9, 7, 8, 5, 6])
    h.finish(old, keep=4)
    now = h.new_doc(h.tail + [7, 8, 9, 7, 8])
    # "7 8" also continues with 9 earlier in the same answers; the aligned place says 5
    assert h.draft(now, 3) == [5, 6]
    assert h.draft(now, 1) == [5]


def test_the_prompt_drafts_when_no_answer_matches():
    h = PromptHistory([4, 5, 6, 7, 4, 5], min_n=2, max_n=3)
    now = h.new_doc(h.tail)
    assert h.draft(now, 2) == [6, 7]  # the prompt's own "4 5" is followed by "6 7"
    h.extend(now, [9, 9])
    assert h.draft(now, 2) == []  # "9 9" occurs nowhere with a continuation


def test_answers_beyond_the_kept_count_stop_drafting():
    h = PromptHistory([1], min_n=1, max_n=2)
    first = h.new_doc(h.tail + [2, 3])
    h.finish(first, keep=1)
    second = h.new_doc(h.tail + [2, 4])
    h.finish(second, keep=1)  # drops the first
    now = h.new_doc(h.tail + [2])
    assert h.draft(now, 1) == [4]


def _runner(requests: dict, running: list[str]):
    """vLLM's model runner as the drafter sees it: each request's state (the prompt and the tokens
    generated so far), the rows of the step, and the hook vLLM calls as it drops a request."""
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=running), requests=requests, removed=[])
    runner._on_request_state_removed = lambda req_id, state: runner.removed.append(req_id)
    return runner


def _finish(runner, req_id):
    """What vLLM's runner does for a finished or aborted request."""
    runner._on_request_state_removed(req_id, runner.requests.pop(req_id))
    runner.input_batch.req_ids.remove(req_id)


def test_the_drafter_keys_history_by_prompt_and_keeps_finished_answers():
    drafter = HistoryDrafter(SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3)))
    requests = {"a": SimpleNamespace(prompt_token_ids=[1, 2], output_token_ids=[5, 6, 7, 8]),
                "b": SimpleNamespace(prompt_token_ids=[3, 4], output_token_ids=[9])}
    runner = _runner(requests, ["a", "b"])
    drafter.bind(runner, 1, 3, answers=4, prompts=8, k_by_batch=[0, 3, 3])
    unused = np.zeros((2, 6), dtype=np.int64)  # the drafter reads vLLM's request state instead
    assert drafter.propose([[8], [9]], [6, 3], unused) == [[], []]  # nothing earlier to draft from
    _finish(runner, "a")
    _finish(runner, "b")
    assert runner.removed == ["a", "b"]  # vLLM's own hook still runs
    requests["c"] = SimpleNamespace(prompt_token_ids=[1, 2], output_token_ids=[5])  # prompt a's again
    runner.input_batch.req_ids = ["c"]
    assert drafter.propose([[5]], [3], unused[:1]) == [[6, 7, 8]]
    drafter.k_by_batch = [0, 0]  # the table says no drafts at one running request
    requests["c"].output_token_ids.append(6)
    assert drafter.propose([[6]], [4], unused[:1]) == [[]]


def test_a_vllm_without_the_removal_hook_is_named_at_bind():
    drafter = HistoryDrafter(SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=2)))
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=[]), requests={})
    with pytest.raises(RuntimeError, match="_on_request_state_removed.*method=ngram"):
        drafter.bind(runner, 1, 2, answers=4, prompts=8, k_by_batch=None)


def test_answers_finished_in_steps_without_drafts_are_history_too():
    drafter = HistoryDrafter(SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=2)))
    requests = {f"r{i}": SimpleNamespace(prompt_token_ids=[1, 2], output_token_ids=[]) for i in range(3)}
    runner = _runner(requests, ["r0", "r1", "r2"])
    table = [0, 2, 0, 0]  # drafts only once one request runs alone
    drafter.bind(runner, 1, 2, answers=4, prompts=8, k_by_batch=table)
    unused = np.zeros((3, 4), dtype=np.int64)
    for token in (4, 5):
        for state in requests.values():
            state.output_token_ids.append(token)
        assert drafter.propose([[token]] * 3, [0] * 3, unused) == [[], [], []]
    assert drafter.live == {}  # a full batch: nothing tracked
    requests["r0"].output_token_ids += [6, 7]  # r0 ran ahead of its siblings
    _finish(runner, "r0")
    requests["r1"].output_token_ids.append(-1)  # a placeholder vLLM had not filled yet
    _finish(runner, "r1")
    assert drafter.propose([[5]], [0], unused[:1]) == [[6, 7]]  # r2 alone: r0's answer continues it
    requests["r2"].output_token_ids[:] = [4]  # vLLM took a token back: the draft follows
    assert drafter.propose([[4]], [0], unused[:1]) == [[5, 6]]


def _sums(points):
    """The tuner's sums of undecayed steps (tokens, seconds[, drafted[, passes]]); passes default
    to 4 per verifying step (a table of one k)."""
    fit = np.zeros((4, 5))
    for x, y, *rest in points:
        drafted = float(rest[0]) if rest else 0.0
        passes = float(rest[1]) if len(rest) > 1 else 4.0 * drafted
        f = np.array([1.0, x, drafted, passes])
        fit[:, :4] += np.outer(f, f)
        fit[:, 4] += f * y
    return fit


def _tuner(k_max=4, adaptive=True, per_pass=True):
    scheduler = SimpleNamespace(dynamic_sd_lookup=[k_max] * 65, schedule=None, update_from_output=None)
    return DraftTuner(scheduler, k_max, adaptive, retune_steps=1, per_pass=per_pass)


def test_drafting_pays_in_the_tail_not_in_a_full_batch():
    tuner = _tuner()
    assert tuner.table[1:] == [0] * 64  # nothing measured: no drafts
    tuner.fit = _sums([(x, 0.01 + 1e-4 * x) for x in (50, 100, 150, 200)])  # steps: (tokens, seconds)
    c0, c1, c2, c3 = tuner.cost_line()
    assert abs(c1 - 1e-4) < 1e-9 and abs(c0 - 0.01) < 1e-6 and c2 == 0 and c3 == 0
    tuner.retune()  # the cost is known, the acceptance is not: explore where drafting is cheap
    assert tuner.table[1] == 4 and tuner.table[64] == 0
    tuner.requests = tuner.with_draft = 100.0
    tuner.tried = [0, 100, 50, 25, 12]
    tuner.accepted = [0, 50, 25, 12, 6]  # half of the drafts at each position
    tuner.retune()
    assert tuner.table[1] == 4 and tuner.table[64] < 4
    assert tuner.table[64] <= tuner.table[8] <= tuner.table[1]
    tuner.accepted = [0, 0, 0, 0, 0]  # drafts never accepted: never worth a step
    tuner.retune()
    assert tuner.table[1:] == [0] * 64


def test_what_a_verifying_step_costs_beyond_its_tokens_counts():
    tuner = _tuner()
    plain = [(x, 0.01 + 1e-4 * x) for x in (10, 50, 100)]
    verifying = [(x, 0.02 + 1e-4 * x, 1) for x in (20, 60, 120)]  # 10 ms more per verifying step
    tuner.fit = _sums(plain + verifying)
    c0, c1, c2, c3 = tuner.cost_line()
    assert abs(c2 - 0.01) < 1e-9 and abs(c0 - 0.01) < 1e-9 and c3 == 0  # one k: c2 carries the passes
    tuner.requests = tuner.with_draft = 100.0
    tuner.tried, tuner.accepted = [0, 100, 50, 25, 12], [0, 50, 25, 12, 6]
    tuner.retune()
    # half the drafts accepted would pay at one running request, not with 10 ms on the step
    assert tuner.table[1] == 0


def test_a_draft_model_forward_per_proposed_token_is_priced_once_counts_vary():
    tuner = _tuner()
    plain = [(x, 0.004 + 1e-4 * x) for x in (10, 50, 100, 130)]
    # a draft model: 1.5 ms per proposed position; tables of several k, so passes vary
    drafting = [(x * (1 + k), 0.004 + 1e-4 * x * (1 + k) + 0.0015 * k, 1, k) for x in (4, 30, 60) for k in (1, 2, 4)]
    tuner.fit = _sums(plain + drafting)
    c0, c1, c2, c3 = tuner.cost_line()
    assert abs(c3 - 0.0015) < 1e-7 and c2 < 1e-7 and abs(c1 - 1e-4) < 1e-9
    tuner.requests = tuner.with_draft = 100.0
    tuner.tried, tuner.accepted = [0, 100, 70, 49, 34], [0, 70, 49, 34, 24]  # 70% at each position
    tuner.retune()
    assert tuner.table[1] > 0  # the tail: a few passes cost less than the tokens they bring
    assert tuner.table[64] < tuner.table[1]  # a fuller batch: they no longer pay
    look_up = _tuner()  # the same steps with free passes (look-ups) draft more there
    look_up.fit = _sums(plain + [(t, y - 0.0015 * k, d, k) for t, y, d, k in drafting])
    look_up.requests = look_up.with_draft = 100.0
    look_up.tried, look_up.accepted = tuner.tried, tuner.accepted
    look_up.retune()
    assert look_up.table[1] == 4 > tuner.table[1] and look_up.table[20] > tuner.table[20]


def test_a_parallel_draft_has_no_cost_per_proposed_position():
    """PARD proposes every position in one forward: a per-position term would only take up the
    curvature of the policy's own cost (here: steps of many tokens dearer than the line)."""
    parallel, sequential = _tuner(per_pass=False), _tuner()
    plain = [(x, 0.004 + 1e-4 * x) for x in (10, 50, 100, 130)]
    drafting = [(x * (1 + k), 0.004 + 1e-4 * x * (1 + k) + 1e-6 * (x * (1 + k)) ** 1.5, 1, k)
                for x in (4, 30, 60) for k in (1, 2, 4)]
    parallel.fit = sequential.fit = _sums(plain + drafting)
    assert parallel.cost_line()[3] == 0
    assert sequential.cost_line()[3] > 1e-4  # the same steps: a draft forward per position would take it


def test_a_fixed_count_when_not_adaptive():
    tuner = _tuner(k_max=3, adaptive=False)
    tuner.fit = _sums([(x, 0.01 + 1e-4 * x) for x in (50, 100, 150, 200)])
    tuner.retune()
    assert tuner.table[1:] == [3] * 64


def _stepping_tuner(batch_max: int, retune_steps: int = 1000):
    """A tuner on a stand-in scheduler, and ``step(k, drafts_per_request)`` that runs one decode
    step through its wrapped ``schedule`` / ``update_from_output``."""
    outputs = []
    scheduler = SimpleNamespace(dynamic_sd_lookup=[0] * (batch_max + 1), schedule=lambda: outputs.pop(0),
                                update_from_output=lambda out, model_output: None)
    tuner = DraftTuner(scheduler, 4, adaptive=True, retune_steps=retune_steps)

    def step(k, drafts_per_request, prefill=0):
        """``prefill``: the tokens of one more request's prompt chunk in the same step."""
        reqs = [f"r{i}" for i in range(len(drafts_per_request))]
        drafts = {r: [7] * d for r, d in zip(reqs, drafts_per_request) if d}
        scheduled = {r: 1 + d for r, d in zip(reqs, drafts_per_request)} | ({"p": prefill} if prefill else {})
        outputs.append(SimpleNamespace(num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                                       scheduled_spec_decode_tokens=drafts, num_spec_tokens_to_schedule=k))
        out = scheduler.schedule()
        scheduler.update_from_output(out, SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(reqs)},
                                                          sampled_token_ids=[[1] * (1 + d) for d in drafts_per_request]))
    return tuner, step


def test_requests_count_toward_draft_availability_only_when_drafts_were_asked_for():
    tuner, step = _stepping_tuner(8)
    for _ in range(5):
        step(0, [0] * 8)  # many running, none asked for: says nothing about whether drafts are found
    step(4, [0] * 2)  # the first step that asks: its drafts arrive with the next one
    step(4, [4, 4])
    assert tuner.requests > 0 and tuner.with_draft / tuner.requests == 1.0


def test_exploring_ends_at_the_step_enough_requests_found_no_draft():
    tuner, step = _stepping_tuner(32)
    tuner.fit = _sums([(x, 0.01 + 1e-4 * x) for x in (8, 16, 24, 32) * 2])
    tuner.retune()
    assert tuner.table[16] == 4  # exploring
    for _ in range(6):
        # asked at 16 running (counted from the 2nd step), no look-up found a draft; a new prompt's
        # prefill shares each step (a batch that refills as it drains)
        step(4, [0] * 16, prefill=12)
    assert tuner.table[1:] == [0] * 32  # decided after 64 requests, long before retune_steps


def _table_from(tuner, line):
    """The tuner's table from a known cost line (the stand-in steps take microseconds)."""
    tuner.fit = line.copy()
    tuner.retune()
    return tuner.table


def test_exploring_ends_where_look_ups_find_no_draft_and_resumes_later_and_less_often():
    tuner, step = _stepping_tuner(32, retune_steps=16)
    line = _sums([(x, 0.01 + 1e-4 * x) for x in (8, 16, 24, 32) * 2])
    assert _table_from(tuner, line)[16] == 4  # exploring
    for _ in range(5):
        step(4, [0] * 16)  # 64 requests asked (from the 2nd step), no look-up found a draft
    assert _table_from(tuner, line)[1:] == [0] * 32
    for _ in range(250):
        step(0, [0] * 32)
    assert _table_from(tuner, line)[1:] == [0] * 32  # still decided
    for _ in range(150):
        step(0, [0] * 32)
    assert _table_from(tuner, line)[16] == 4  # 400 steps on (the policy moved on): explore again
    for _ in range(5):
        step(4, [0] * 16)
    assert _table_from(tuner, line)[1:] == [0] * 32  # fruitless twice: the next wait is twice as long
    for _ in range(400):
        step(0, [0] * 32)
    assert _table_from(tuner, line)[1:] == [0] * 32
    for _ in range(200):
        step(0, [0] * 32)
    assert _table_from(tuner, line)[16] == 4


def test_exploring_ends_where_only_the_last_steps_of_each_call_ask():
    """Short answers (the demo): a call is a few full-batch steps, and only its last two run few
    enough sequences to draft; the few requests asked there decay away between calls, so counts
    with forgetting alone would never reach the marks and the tuner would explore for good."""
    tuner, step = _stepping_tuner(64, retune_steps=16)
    line = _sums([(x, 0.01 + 1e-4 * x) for x in (8, 16, 32, 64) * 2])
    _table_from(tuner, line)
    for _ in range(40):
        step(0, [], prefill=12 * 64)  # the call's prompts
        for _ in range(8):
            step(0, [0] * 64)
        step(4, [0] * 4)
        step(4, [0] * 2)  # asked in the step before: 2 requests, no draft found
    assert tuner.requests < 64  # forgetting holds the count below the mark
    assert _table_from(tuner, line)[1:] == [0] * 64
