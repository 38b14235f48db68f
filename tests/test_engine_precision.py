"""Master weights (stages 0/1): gradients reach the masters on the masters' device and in their dtype."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torsh.engine.precision import MasterWeights  # noqa: E402


def _masters(device: str) -> MasterWeights:
    param = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    master = torch.nn.Parameter(torch.ones(3, dtype=torch.float32, device=device))
    return MasterWeights({"w": param}, {"w": master})


def test_gradients_move_to_the_masters_device_under_optimizer_offload():
    """ZeRO-1/0 with offload_optimizer cpu keeps the masters on the CPU while the model computes on the GPU; a
    gradient assigned across devices is refused by torch, so it is moved with the cast. (The "meta" device stands
    in for the other device here: this machine has one.)"""
    weights = _masters("meta")
    weights.params["w"].grad = torch.full((3,), 2.0, dtype=torch.bfloat16)
    weights.grads_to_master(accumulate=False)
    grad = weights.masters["w"].grad
    assert (grad.device.type, grad.dtype) == ("meta", torch.float32)
    assert weights.params["w"].grad is None


def test_gradients_accumulate_in_the_master_dtype():
    weights = _masters("cpu")
    for _ in range(2):
        weights.params["w"].grad = torch.full((3,), 0.5, dtype=torch.bfloat16)
        weights.grads_to_master(accumulate=True)
    assert weights.masters["w"].grad.dtype == torch.float32 and weights.masters["w"].grad.tolist() == [1.0] * 3
