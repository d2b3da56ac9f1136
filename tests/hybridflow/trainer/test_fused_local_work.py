"""How the fused rollout shares finished rows among the ranks that compute on them
(hybridflow/trainer/fused_rollout.py ``_LocalWork``): once generation is over, the rows left go to
every rank in equal parts of their tokens, so the rank that takes the late (long) rows does not
compute alone while the others wait. Calls answer at once here (``ray.wait`` and ``ray.get``
replaced): what is tested is who gets which rows."""
import torch

from hybridflow.controller.stream import ROW_INDEX
from hybridflow.protocol import DataProto
from hybridflow.trainer import fused_rollout
from hybridflow.trainer.fused_rollout import Stage, _LocalWork, rows_for_tokens


class _Ref:
    def __init__(self, value, rank):
        self.value, self.rank, self.done = value, rank, True  # answered at once unless a test says otherwise


class _Method:
    def __init__(self, log, rank):
        self.log, self.rank = log, rank

    def remote(self, rows):
        self.log.append((self.rank, rows))
        return _Ref(DataProto.from_dict({"old_log_probs": torch.zeros(len(rows), 1)}), self.rank)


class _Actor:
    def __init__(self, log, rank):
        self.compute_log_prob_local = _Method(log, rank)
        self.compute_values_local = _Method(log, rank)


class _Group:
    """A worker group's surface that _LocalWork uses: per-rank actors and a rank-ordered wait."""
    name, timeout_s, _prefix = "actor", 60.0, ""

    def __init__(self, ranks):
        self.world_size = ranks
        self.log = []
        self.actors = [_Actor(self.log, r) for r in range(ranks)]

    @staticmethod
    def _wait(refs, what, ranks):
        assert ranks == [r.rank for r in refs]  # an error would name the rank that made the call
        return [r.value for r in refs]


def _rows(lengths, first_index=0, width=300):
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    index = torch.arange(first_index, first_index + len(lengths))
    return DataProto.from_dict({"attention_mask": mask, ROW_INDEX: index})


def _work(monkeypatch, ranks):
    monkeypatch.setattr(fused_rollout.ray, "wait",
                        lambda refs, num_returns=1, timeout=None: ([r for r in refs if r.done][:num_returns],
                                                                   [r for r in refs if not r.done]))
    monkeypatch.setattr(fused_rollout.ray, "get", lambda ref: ref.value)
    group = _Group(ranks)
    stage = Stage("old_log_prob", group, "compute_log_prob", "compute_log_prob_local", "local")
    return group, _LocalWork(group, [stage], min_chunk=4)


def _tokens(rows):
    return int(rows.batch["attention_mask"].sum())


def test_rows_for_tokens_takes_the_leading_rows_closest_to_the_share():
    tokens = torch.tensor([10, 10, 10, 100, 100, 100])
    assert rows_for_tokens(tokens, 165) == 4  # 4 rows make 130 (35 off), 5 make 230 (65 off)
    assert rows_for_tokens(tokens, 0) == 1  # never none
    assert rows_for_tokens(tokens, 10_000) == 6


def test_the_rows_left_at_the_end_are_shared_by_tokens_not_by_rows(monkeypatch):
    """The late rows are the long ones: 12 short rows then 12 at the limit, on 2 ranks. Equal row
    counts would give one rank 12 short rows and the other all the long ones (11x the tokens)."""
    group, work = _work(monkeypatch, ranks=2)
    work.queue(_rows([25] * 12))
    work.queue(_rows([280] * 12, first_index=12))
    work.finish(ranks=2)
    given = {rank: rows for rank, rows in group.log}
    assert sorted(given) == [0, 1]
    assert sum(len(r) for r in given.values()) == 24
    spent = [_tokens(given[r]) for r in (0, 1)]
    assert abs(spent[0] - spent[1]) <= 280, spent  # within one long row
    rows = torch.cat([given[r].batch[ROW_INDEX] for r in (0, 1)])
    assert sorted(rows.tolist()) == list(range(24))  # every row once
    assert len(work.result(24)) == 24


def test_a_busy_rank_gets_its_share_when_it_frees(monkeypatch):
    """Rank 0 still computes an earlier call: rank 1 takes half of the tokens left, not all rows."""
    group, work = _work(monkeypatch, ranks=2)
    work.queue(_rows([40] * 4))
    work.feed([0])  # rank 0 busy with 4 rows
    work.queue(_rows([200] * 8, first_index=4))
    work.finish(ranks=2)
    calls = group.log
    assert calls[0][0] == 0 and len(calls[0][1]) == 4
    assert calls[1][0] == 1 and len(calls[1][1]) == 4  # half of the 8 x 200 tokens left
    rows = torch.cat([rows.batch[ROW_INDEX] for _, rows in calls])
    assert sorted(rows.tolist()) == list(range(12))


def test_a_rank_freed_during_generation_leaves_late_long_rows_for_the_others(monkeypatch):
    """32 rows at the length limit finish together just before generation ends; rank 1, free,
    takes half of their tokens (not min_chunk x 4 = 32 rows); the rest is shared when generation ends."""
    group, work = _work(monkeypatch, ranks=2)
    work.queue(_rows([280] * 32))
    work.feed([1])
    assert [(rank, len(rows)) for rank, rows in group.log] == [(1, 16)]
    work.feed([1])  # busy: nothing more
    assert len(group.log) == 1
    work.finish(ranks=2)
    assert group.log[1][0] == 0  # rank 0, done generating, takes its part at once
    assert sum(len(rows) for _, rows in group.log) == 32
    assert work.rows_during_gen == 16


def test_few_rows_wait_for_min_chunk_while_generating(monkeypatch):
    group, work = _work(monkeypatch, ranks=2)
    work.queue(_rows([30] * 3))
    work.feed([1])
    assert group.log == []  # fewer than min_chunk (4): a call is not worth its overhead yet
    work.queue(_rows([30] * 9, first_index=3))
    work.feed([1])
    assert [(rank, len(rows)) for rank, rows in group.log] == [(1, 6)]  # half of 12 rows' tokens


def test_a_rank_s_answered_stage_leaves_in_flight(monkeypatch):
    """A rank runs each stage as its own call; once the first answered, ``in_flight`` must not
    hold it (``ray.wait`` would return it at once and the controller would spin) while the rank
    stays busy with the next."""
    group, work = _work(monkeypatch, ranks=2)
    work.stages.append(Stage("values", group, "compute_values", "compute_values_local", "local"))
    work.queue(_rows([30] * 4))
    work.feed([0])
    log_prob, values = work.in_flight
    values.done = False
    work.take()
    assert work.in_flight == [values] and 0 in work.busy
    values.done = True
    work.take()
    assert work.in_flight == [] and not work.busy
