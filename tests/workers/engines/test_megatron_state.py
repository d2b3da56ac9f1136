"""The Megatron engine's global gradient norm: accurate on large gradients, and fast."""
import torch

from workers.engines.megatron_state import _sum_of_squares


def test_sum_of_squares_matches_fp64_on_a_large_gradient():
    # an embedding-sized gradient: fp32 vector_norm is ~2e-4 off at this size on CPU
    g = torch.randn(8_000_000, generator=torch.Generator().manual_seed(0)) * 3.0
    exact = g.double().pow(2).sum()
    got = _sum_of_squares(g)
    assert got.dtype == torch.float64
    assert abs(got.item() - exact.item()) / exact.item() < 1e-6


def test_sum_of_squares_reads_bf16_gradients_in_fp32():
    g = torch.randn(1000, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    exact = g.double().pow(2).sum()
    assert abs(_sum_of_squares(g).item() - exact.item()) / exact.item() < 1e-6
