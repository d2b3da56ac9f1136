"""DataProto properties: row operations keep tensor and non-tensor columns aligned."""
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.protocol import DataProto


def make(n, offset=0):
    ids = torch.arange(offset, offset + n)
    return DataProto.from_dict({"ids": ids, "sq": (ids**2).unsqueeze(1).repeat(1, 3)},
                               {"name": [f"s{i}" for i in ids.tolist()]}, {"temperature": 1.0})


def names(d):
    return list(d.non_tensor_batch["name"])


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 8))
def test_pad_chunk_concat_unpad_round_trip(n, k):
    d = make(n)
    padded, pad = d.pad_to_divisor(k)
    assert len(padded) % k == 0 and pad == (-n) % k
    back = DataProto.concat(padded.chunk(k)).unpad(pad)
    assert torch.equal(back.batch["ids"], d.batch["ids"]) and names(back) == names(d)
    assert back.meta_info == {"temperature": 1.0}


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 30), size=st.integers(1, 10))
def test_split_covers_all_rows_in_order(n, size):
    parts = make(n).split(size)
    assert [len(p) for p in parts[:-1]] == [size] * (len(parts) - 1)
    assert torch.equal(DataProto.concat(parts).batch["ids"], torch.arange(n))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 12), times=st.integers(1, 5), interleave=st.booleans())
def test_repeat(n, times, interleave):
    r = make(n).repeat(times, interleave=interleave)
    expect = (torch.arange(n).repeat_interleave(times) if interleave else torch.arange(n).repeat(times))
    assert torch.equal(r.batch["ids"], expect)
    assert names(r) == [f"s{i}" for i in expect.tolist()]
    assert torch.equal(r.batch["sq"][:, 0], expect**2)


@settings(max_examples=30, deadline=None)
@given(perm=st.permutations(list(range(9))))
def test_reorder_is_a_permutation_of_rows(perm):
    d = make(9).reorder(torch.tensor(perm))
    assert d.batch["ids"].tolist() == perm and names(d) == [f"s{i}" for i in perm]


def test_union_adds_and_refuses_conflicts():
    a = make(4)
    b = DataProto.from_dict({"ids": torch.arange(4), "extra": torch.ones(4)}, {"name": names(a)})
    a.union(b)
    assert "extra" in a.keys()
    with pytest.raises(ValueError, match="tensor 'ids' differs"):
        a.union(DataProto.from_dict({"ids": torch.arange(4) + 1}))
    with pytest.raises(ValueError, match="non-tensor 'name' differs"):
        a.union(DataProto.from_dict(non_tensors={"name": ["x"] * 4}))
    with pytest.raises(ValueError, match="meta_info 'temperature' differs"):
        a.union(DataProto(meta_info={"temperature": 0.5}))
    with pytest.raises(ValueError, match="lengths differ"):
        a.union(make(3))


def test_select_pop_getitem_and_errors():
    d = make(6)
    s = d.select(["ids"], ["name"])
    assert s.keys() == ["ids"] and names(s) == names(d)
    popped = d.pop(["sq"])
    assert "sq" not in d.keys() and popped.batch["sq"].shape == (6, 3)
    assert names(d[2]) == ["s2"] and names(d[1:3]) == ["s1", "s2"]
    assert names(d[torch.tensor([True, False] * 3)]) == ["s0", "s2", "s4"]
    with pytest.raises(ValueError, match="disagree on batch size"):
        DataProto.from_dict({"a": torch.zeros(2), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match="has 2 rows"):
        DataProto(batch=make(3).batch, non_tensor_batch={"x": np.array(["a", "b"], dtype=object)})
    with pytest.raises(ValueError, match="pad_to_divisor"):
        make(5).chunk(2)


def test_make_iterator_epochs_and_shuffle_is_seeded():
    d = make(8)
    a = [m.batch["ids"].tolist() for m in d.make_iterator(4, epochs=2, shuffle=True, seed=3)]
    b = [m.batch["ids"].tolist() for m in d.make_iterator(4, epochs=2, shuffle=True, seed=3)]
    assert a == b and len(a) == 4 and sorted(sum(a[:2], [])) == list(range(8))
    with pytest.raises(ValueError, match="mini_batch_size=3"):
        list(d.make_iterator(3))


def test_pickle_ships_only_the_rows_of_a_view(tmp_path):
    big = DataProto.from_dict({"x": torch.zeros(10_000, 64)})
    small = big[:10]
    assert len(pickle.dumps(small)) < len(pickle.dumps(big)) / 100
    back = pickle.loads(pickle.dumps(make(5)))
    assert torch.equal(back.batch["ids"], torch.arange(5)) and names(back) == names(make(5))
    path = tmp_path / "d.pkl"
    make(3).save_to_disk(str(path))
    assert names(DataProto.load_from_disk(str(path))) == ["s0", "s1", "s2"]


def test_to_device_keeps_rows():
    d = make(3).to("cpu")
    assert d.batch.device == torch.device("cpu") and len(d) == 3


def test_dp_chunks_mark_every_part_of_a_padded_split_and_unpad_clears_the_mark():
    from hybridflow.protocol import DP_PADDING_ROWS

    parts, pad = make(5).dp_chunks(2)
    assert pad == 1 and [p.meta_info[DP_PADDING_ROWS] for p in parts] == [1, 1]
    back = DataProto.concat(parts).unpad(pad)
    assert back.meta_info == {"temperature": 1.0} and names(back) == names(make(5))
    even, pad = make(4).dp_chunks(2)
    assert pad == 0 and all(DP_PADDING_ROWS not in p.meta_info for p in even)



def test_concat_averages_the_parts_metrics():
    """Each generation-DP rank reports its own metrics (perf/gen_tail_share, ...): the collected
    batch holds their mean per key, over the parts that have it; other meta_info: the last wins."""
    a, b = make(2), make(2)
    a.meta_info.update(metrics={"perf/gen_tail_share": 0.2, "only_a": 1.0, "same": 0.1}, stage="x")
    b.meta_info.update(metrics={"perf/gen_tail_share": 0.5, "same": 0.1}, stage="y")
    meta = DataProto.concat([a, b]).meta_info
    assert meta["metrics"] == {"perf/gen_tail_share": pytest.approx(0.35), "only_a": 1.0, "same": 0.1}
    assert meta["stage"] == "y"
    assert DataProto.concat([a]).meta_info["metrics"] is a.meta_info["metrics"]
