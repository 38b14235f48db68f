"""The single-process building blocks of the compression hooks: top-k selection and bit packing."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the engine needs torch")

from torsh.engine.compression import _pack, _top_k_indices, _unpack


@pytest.mark.parametrize("n,k", [(300, 30), (131_584, 1316), (400_000, 4000), (400_000, 1)])
@pytest.mark.parametrize("shape", ["dense", "half_zero", "ties"])
def test_top_k_selects_the_same_values_as_torch_topk(n, k, shape):
    g = torch.Generator().manual_seed(n + k)
    magnitude = torch.randn(n, generator=g).abs() * torch.rand(n, generator=g) ** 3
    if shape == "half_zero":
        magnitude[: n // 2] = 0
    if shape == "ties":
        magnitude[::7] = 5.0
    chosen = _top_k_indices(magnitude, k)
    assert chosen.unique().numel() == k
    expected = torch.topk(magnitude, k).values
    assert torch.equal(magnitude[chosen].sort().values, expected.sort().values)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("n", [1, 7, 1000, 1003])
def test_packing_round_trips_and_really_shrinks(bits, n):
    codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    packed = _pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-n * bits // 8)
    assert torch.equal(_unpack(packed, bits, n), codes)
    assert torch.equal(_unpack(torch.stack([packed, packed]), bits, n), torch.stack([codes, codes]))
