"""Models, configs and the hand-written PyTorch set-up each benchmark case runs (imports torch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

STAGES = ("0", "1", "2", "3", "3+offload")
PRECISIONS = ("fp32", "bf16")
IMPLS = ("native", "torsh", "deepspeed", "torsh-per-layer")


@dataclass(frozen=True)
class Shape:
    """A model shape: width, depth and the micro-batch per rank; a transformer also has a vocabulary, a sequence
    length and attention heads (an MLP has none: each of its ``batch`` rows counts as one token)."""

    name: str
    width: int
    depth: int
    batch: int
    vocab: int = 0
    seq: int = 1
    heads: int = 0

    @property
    def transformer(self) -> bool:
        return self.vocab > 0

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch of one rank (rows for an MLP)."""
        return self.batch * self.seq


SHAPES = {
    # Most time in matrix multiplies: a modest model and a large batch.
    "compute": Shape("compute", width=512, depth=4, batch=512),
    # Most time in gradient communication: many parameters (about 8.4M) and a tiny batch.
    "comm": Shape("comm", width=1024, depth=8, batch=2),
    # What users train: a causal transformer with attention and tied input/output embeddings (about 4.2M
    # parameters, 1M of them the shared embedding), 4 sequences of 64 tokens per rank.
    "transformer": Shape("transformer", width=256, depth=4, batch=4, vocab=4096, seq=64, heads=4),
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


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention (``scaled_dot_product_attention``) and a 4x MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class Transformer(nn.Module):
    """A causal language model whose output head is the input embedding (``head.weight is embed.weight``)."""

    def __init__(self, shape: Shape):
        super().__init__()
        self.hidden_size = shape.width
        self.embed = nn.Embedding(shape.vocab, shape.width)
        self.pos = nn.Parameter(torch.zeros(1, shape.seq, shape.width))
        self.layers = nn.ModuleList(Block(shape.width, shape.heads) for _ in range(shape.depth))
        self.norm = nn.LayerNorm(shape.width)
        self.head = nn.Linear(shape.width, shape.vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, used at both ends
        nn.init.normal_(self.embed.weight, std=0.02)  # as GPT-2: N(0, 1) would start the tied head at loss ~200

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build(shape: Shape) -> nn.Module:
    torch.manual_seed(0)
    return Transformer(shape) if shape.transformer else Net(shape)


def unit_class(model: nn.Module) -> str:
    """The class of the model's repeated block: each one is an FSDP2 unit in the hand-written job."""
    return type(model.layers[0]).__name__


def num_params(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())


def make_batch(shape: Shape, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's ``(inputs, targets)``: features and a regression target, or tokens and the next tokens."""
    if shape.transformer:
        tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return torch.randn(shape.batch, shape.width, generator=generator), torch.randn(shape.batch, 1, generator=generator)


def torsh_wrapping(stage: str, precision: str, shape: Shape) -> dict:
    """How torsh's engine wraps this case's model from its DeepSpeed config, for the hand-written job to do the
    same: the blocks of each FSDP2 unit at stages 2/3, DDP's bucket size at stages 0/1 (``NativeJob``'s
    keyword arguments). Imports torsh's config reader and unit planner only (no engine)."""
    from torsh import adapters
    from torsh.engine.zero.units import plan_units
    from torsh.sharding_plan import sharding_plan

    layout = sharding_plan(adapters.load(deepspeed_config(stage, precision, shape)).result)
    if layout.stage <= 1:
        return {"bucket_cap_mb": layout.ddp.bucket_cap_mb}
    plan = plan_units(build(shape), layout)
    return {"units": [list(unit.modules) for unit in plan.units],
            "reshard": [unit.reshard_after_forward for unit in plan.units]}  # fmt: skip


def loss_of(output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error for a regression target, cross-entropy over the vocabulary for next tokens (in fp32)."""
    if y.dtype == torch.long:
        return nn.functional.cross_entropy(output.float().flatten(0, 1), y.flatten())
    return nn.functional.mse_loss(output.float(), y)


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
    gradient norm is clipped to 1.0 over the (master) gradients, and every block (``Layer``, or the
    transformer's ``Block``) is its own FSDP2 unit, or ``units`` says which blocks share one (``fully_shard`` over
    a list of modules) and ``reshard`` which of them keep their parameters gathered from forward to backward
    (False), so that the job wraps the model as the torsh run it is compared with. ``bucket_cap_mb``
    sizes DDP's buckets at stages 0/1 (None: DDP's default). A tied embedding stays one parameter: ``Module.to``
    converts it in place, and at stages 2/3 it belongs to the root unit with the head.
    """

    def __init__(self, model: nn.Module, stage: str, precision: str, device: torch.device,
                 units: list[list[str]] | None = None, reshard: list[bool | None] | None = None,
                 bucket_cap_mb: float | None = None):  # fmt: skip
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
            named = dict(model.named_modules())
            units = units or [[f"layers.{i}"] for i in range(len(model.layers))]
            for names, after_forward in zip(units, reshard or [None] * len(units)):
                modules = [named[name] for name in names]
                own = kwargs if after_forward is None else {**kwargs, "reshard_after_forward": after_forward}
                fully_shard(modules if len(modules) > 1 else modules[0], **own)
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
            self.model = DistributedDataParallel(model) if bucket_cap_mb is None \
                else DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)  # fmt: skip
            step_params = self.masters or list(model.parameters())
            if level == 1:
                self.optimizer = ZeroRedundancyOptimizer(step_params, optimizer_class=torch.optim.AdamW,
                                                         lr=1e-4, weight_decay=0.0)  # fmt: skip
            else:
                self.optimizer = torch.optim.AdamW(step_params, lr=1e-4, weight_decay=0.0)
        self.step_params = step_params

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One step; ``x`` is already in the compute dtype."""
        loss = loss_of(self.model(x), y)
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
