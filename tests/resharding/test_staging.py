"""Weight buckets: exact round trips, bucket boundaries, the cast, read-only buffers from numpy."""
import numpy as np
import pytest
import torch

from resharding.staging import ALIGN, StagedWeights, pack_buckets, unpack_bucket


def _tensors():
    gen = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(7, 5, generator=gen)),
        ("model.norm.weight", torch.randn(5, generator=gen).to(torch.bfloat16)),
        ("positions", torch.arange(11, dtype=torch.int64)),
        ("flags", torch.tensor([True, False, True])),
        ("empty", torch.zeros(0, 3)),
        ("scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("strided", torch.randn(6, 4, generator=gen).t()),  # not contiguous
    ]


def _roundtrip(buckets):
    return [pair for header, buf in buckets for pair in unpack_bucket(header, buf)]


@pytest.mark.parametrize("bucket_bytes", [1, 100, 1 << 20])
def test_roundtrip_is_exact_for_every_dtype_and_bucket_size(bucket_bytes):
    src = _tensors()
    got = _roundtrip(list(pack_buckets(iter(src), bucket_bytes)))
    assert [n for n, _ in got] == [n for n, _ in src]
    for (_, want), (name, t) in zip(src, got):
        assert t.dtype == want.dtype and t.shape == want.shape, name
        assert torch.equal(t, want), name


def test_buckets_hold_at_most_bucket_bytes_unless_one_tensor_is_larger():
    src = [(f"w{i}", torch.ones(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 10, 100, 10])]
    buckets = list(pack_buckets(src, bucket_bytes=100))
    # 40 B each; the second starts at 64 (aligned) and ends at 104 > 100, so it opens a new bucket
    assert [[e.name for e in h.entries] for h, _ in buckets] == [["w0"], ["w1"], ["w2"], ["w3"], ["w4"]]
    assert [h.nbytes for h, _ in buckets] == [40, 40, 40, 400, 40]
    assert all(buf.numel() == h.nbytes and buf.dtype == torch.uint8 for h, buf in buckets)
    wide = list(pack_buckets(src, bucket_bytes=ALIGN + 40))
    assert [[e.name for e in h.entries] for h, _ in wide] == [["w0", "w1"], ["w2"], ["w3"], ["w4"]]
    assert all(e.offset % ALIGN == 0 for h, _ in wide for e in h.entries)


def test_cast_packs_floating_tensors_in_the_target_dtype_only():
    src = _tensors()
    buckets = list(pack_buckets(src, 1 << 20, cast_to=torch.bfloat16))
    got = dict(_roundtrip(buckets))
    for name, want in src:
        if want.is_floating_point():
            assert got[name].dtype == torch.bfloat16
            assert torch.equal(got[name], want.to(torch.bfloat16)), name
        else:
            assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    fp32 = sum(h.nbytes for h, _ in pack_buckets([src[0]], 1 << 20))
    bf16 = sum(h.nbytes for h, _ in pack_buckets([src[0]], 1 << 20, cast_to=torch.bfloat16))
    assert bf16 * 2 == fp32  # half the bytes to move


def test_unpack_reads_a_read_only_numpy_buffer_without_copying():
    """What a receiver gets from Ray's object store: a read-only uint8 array."""
    (header, buf), = pack_buckets(_tensors(), 1 << 20)
    array = buf.numpy().copy()
    array.flags.writeable = False
    got = unpack_bucket(header, array)
    for (_, want), (_, t) in zip(_tensors(), got):
        assert torch.equal(t, want)
    base = array.ctypes.data
    first = got[0][1]
    assert first.data_ptr() == base + header.entries[0].offset  # a view, not a copy


def test_unpack_refuses_a_buffer_shorter_than_its_header():
    (header, buf), = pack_buckets(_tensors(), 1 << 20)
    with pytest.raises(ValueError, match="needs 1-D uint8 of at least"):
        unpack_bucket(header, buf[:-1])


def test_staged_weights_pair_each_bucket_with_a_header():
    (header, _), = pack_buckets(_tensors()[:1], 1 << 20)
    with pytest.raises(ValueError, match="2 buckets but 1 headers"):
        StagedWeights(version=1, buckets=("a", "b"), headers=(header,), total_bytes=1, seconds=0.0)
