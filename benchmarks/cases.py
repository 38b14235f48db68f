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
    """What a PyTorch user writes by hand for the same job: DDP, DDP + ZeroRedundancyOptimizer, or FSDP2."""

    def __init__(self, model: nn.Module, stage: str, precision: str, device: torch.device):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        self.bf16 = precision == "bf16"
        level = int(stage[0])
        model = model.to(device)
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
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        else:
            self.model = DistributedDataParallel(model)
            if level == 1:
                self.optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                                         lr=1e-4, weight_decay=0.0)  # fmt: skip
            else:
                self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        self.fsdp = level >= 2

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.bf16 and not self.fsdp):
            loss = nn.functional.mse_loss(self.model(x).float(), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()
