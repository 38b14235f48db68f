"""Small built-in models and deterministic synthetic data for demos, parity runs and benchmarks (imports torch).

Every batch is a pure function of ``(seed, step, rank, micro_step)``, so two engines (or two runs) see exactly
the same data in the same order.
"""

from __future__ import annotations

import torch
from torch import nn

MODELS = ("tiny-mlp", "tiny-transformer")


class TinyMLP(nn.Module):
    """A regression MLP: 16 features -> 1 target."""

    in_features = 16

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.hidden_size = hidden
        self.inp = nn.Linear(self.in_features, hidden)
        self.mid = nn.Sequential(nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.out = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mid(self.inp(x)))


class Block(nn.Module):
    """A pre-norm transformer block without dropout (deterministic)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True, dropout=0.0)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """A next-token model over a 64-symbol vocabulary: embedding, a few blocks, a head."""

    vocab = 64
    seq_len = 16

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.hidden_size = dim
        self.embed = nn.Embedding(self.vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, self.seq_len, dim))
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, self.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_model(name: str, seed: int = 0) -> nn.Module:
    """A built-in model with deterministic initial weights."""
    torch.manual_seed(seed)
    if name == "tiny-mlp":
        return TinyMLP()
    if name == "tiny-transformer":
        return TinyTransformer()
    raise ValueError(f"unknown model {name!r}; built-in models: {', '.join(MODELS)}")


def batch(name: str, batch_size: int, *, seed: int, step: int, rank: int, micro_step: int = 0):
    """The ``(inputs, targets)`` of one micro-batch, a pure function of its coordinates."""
    g = torch.Generator().manual_seed(hash((seed, step, rank, micro_step)) % (2**31))
    if name == "tiny-mlp":
        x = torch.randn(batch_size, TinyMLP.in_features, generator=g)
        w = torch.linspace(-1.0, 1.0, TinyMLP.in_features)
        y = (x @ w).unsqueeze(1) + 0.1 * torch.randn(batch_size, 1, generator=g)
        return x, y
    if name == "tiny-transformer":
        start = torch.randint(0, TinyTransformer.vocab, (batch_size, 1), generator=g)
        stride = torch.randint(1, 4, (batch_size, 1), generator=g)
        seq = (start + stride * torch.arange(TinyTransformer.seq_len + 1)) % TinyTransformer.vocab
        return seq[:, :-1], seq[:, 1:]
    raise ValueError(f"unknown model {name!r}; built-in models: {', '.join(MODELS)}")


def loss_fn(name: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The model's training loss, computed in fp32 whatever the compute dtype."""
    if name == "tiny-transformer":
        return nn.functional.cross_entropy(output.float().reshape(-1, output.shape[-1]), target.reshape(-1))
    return nn.functional.mse_loss(output.float(), target.float())
