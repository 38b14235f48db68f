"""Models, configs and the hand-written PyTorch set-up each benchmark case runs (imports torch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

STAGES = ("0", "1", "2", "3", "3+offload")
PRECISIONS = ("fp32", "bf16")
IMPLS = ("native", "torsh", "deepspeed")


@dataclass(frozen=True)
class Shape:
    """A model shape: width, depth and the micro-batch per rank."""

    name: str
    width: int
    depth: int
    batch: int


SHAPES = {
    # Most time in matrix multiplies: a modest model and a large batch.
    "compute": Shape("compute", width=512, depth=4, batch=512),
    # Most time in gradient communication: many parameters (about 8.4M) and a tiny batch.
    "comm": Shape("comm", width=1024, depth=8, batch=2),
}


class Layer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class Net(nn.Module):
    """A stack of layers, each its own sharding unit."""

    def __init__(self, shape: Shape):
        super().__init__()
        self.hidden_size = shape.width
        self.layers = nn.Sequential(*(Layer(shape.width) for _ in range(shape.depth)))
        self.head = nn.Linear(shape.width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


def build(shape: Shape) -> nn.Module:
    torch.manual_seed(0)
    return Net(shape)


def deepspeed_config(stage: str, precision: str, shape: Shape) -> dict:
    """The config every implementation runs: DeepSpeed JSON (torsh reads it as is)."""
    zero: dict = {"stage": int(stage[0])}
    if stage.endswith("offload"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    config = {
        "train_micro_batch_size_per_gpu": shape.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


class NativeJob:
    """What a PyTorch user writes by hand for the same job: DDP, DDP + ZeroRedundancyOptimizer, or FSDP2.

    The precision semantics are those torsh and DeepSpeed build for ``bf16.enabled`` (not ``torch.autocast``,
    which would compute different ops in a different dtype): at stages 0/1 the model's parameters are cast to
    bf16, gradients are reduced in bf16 and the optimizer steps fp32 master copies, which are copied back; at
    stages 2/3 FSDP2's ``MixedPrecisionPolicy`` casts fp32 shards to bf16 for compute and reduction. The
    gradient norm is clipped to 1.0 over the (master) gradients, and every ``Layer`` is its own FSDP2 unit,
    as torsh wraps it.
    """

    def __init__(self, model: nn.Module, stage: str, precision: str, device: torch.device):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        self.bf16 = precision == "bf16"
        level = int(stage[0])
        model = model.to(device)
        self.params: list[nn.Parameter] = []
        self.masters: list[nn.Parameter] = []
        if level >= 2:
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if self.bf16 \
                else MixedPrecisionPolicy()  # fmt: skip
            offload = CPUOffloadPolicy(pin_memory=False) if stage.endswith("offload") else None
            kwargs = {"mp_policy": mp, "reshard_after_forward": level == 3}
            if offload is not None:
                kwargs["offload_policy"] = offload
            for layer in model.layers:
                fully_shard(layer, **kwargs)
            fully_shard(model, **kwargs)
            self.model = model
            step_params = list(model.parameters())
            self.optimizer = torch.optim.AdamW(step_params, lr=1e-4, weight_decay=0.0)
        else:
            if self.bf16:
                # fp32 masters first, then the model's own parameters in bf16 (DDP then reduces bf16).
                self.params = list(model.parameters())
                self.masters = [nn.Parameter(p.detach().float().clone()) for p in self.params]
                model = model.to(torch.bfloat16)
            self.model = DistributedDataParallel(model)
            step_params = self.masters or list(model.parameters())
            if level == 1:
                self.optimizer = ZeroRedundancyOptimizer(step_params, optimizer_class=torch.optim.AdamW,
                                                         lr=1e-4, weight_decay=0.0)  # fmt: skip
            else:
                self.optimizer = torch.optim.AdamW(step_params, lr=1e-4, weight_decay=0.0)
        self.step_params = step_params

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One step; ``x`` is already in the compute dtype."""
        loss = nn.functional.mse_loss(self.model(x).float(), y)
        loss.backward()
        for p, m in zip(self.params, self.masters):
            m.grad = p.grad.float()
            p.grad = None
        torch.nn.utils.clip_grad_norm_(self.step_params, 1.0)
        self.optimizer.step()
        if self.masters:
            with torch.no_grad():
                for p, m in zip(self.params, self.masters):
                    p.copy_(m)
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()
