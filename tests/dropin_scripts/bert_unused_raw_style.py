"""Masked-LM training of a small BERT-like encoder in the shape of DeepSpeed's HelloDeepSpeed
``train_bert_ds.py`` and bing_bert: a pooler the MLM loss never uses (so one parameter gets no gradient), the
encoder layers run through ``deepspeed.checkpointing.checkpoint`` after ``deepspeed.checkpointing.configure``,
and on two micro-batches (one an accumulation boundary) the loss computed by calling the model object the
script built (not the engine) before ``engine.backward`` / ``engine.step``, as scripts that keep a handle on
their model do. ZeRO-1 (``--zero_stage`` changes it)."""

import argparse

import deepspeed
import deepspeed.comm as dist
import torch
import torch.nn as nn
from deepspeed.accelerator import get_accelerator

from _common import write_result

CONFIG = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
          "activation_checkpointing": {"partition_activations": False, "number_checkpoints": 2},
          "zero_optimization": {"stage": 1}}


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d))
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.ff(x))


class MaskedLM(nn.Module):
    def __init__(self, vocab=40, d=16):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d) for _ in range(2))
        self.pooler = nn.Linear(d, d)  # used for classification only; the MLM loss never reaches it
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, labels):
        x = self.embeddings(ids)
        for layer in self.layers:
            x = deepspeed.checkpointing.checkpoint(layer, x)
        logits = self.head(x)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--zero_stage", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    config = {**CONFIG, "zero_optimization": {"stage": args.zero_stage}}
    deepspeed.init_distributed()
    deepspeed.checkpointing.configure(None, deepspeed_config=config)
    assert deepspeed.checkpointing.is_configured()
    torch.manual_seed(0)
    model = MaskedLM()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    device = get_accelerator().device_name()
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 40, (64, 10), generator=g)
    labels = torch.where(torch.rand(64, 10, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(8):  # 2 optimizer steps of 4 accumulated micro-batches
        sl = slice((step * world + rank) * 2, (step * world + rank + 1) * 2)
        runner = model if step in (1, 3) else engine  # the raw model: once inside, once at the boundary
        loss = runner(ids[sl].to(device), labels[sl].to(device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    weights = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
    gathered = [torch.zeros_like(weights) for _ in range(world)]
    dist.all_gather(gathered, weights)
    write_result(args.out, losses, ranks_agree=all(torch.equal(gathered[0], w) for w in gathered),
                 pooler_grad_is_none=engine.module.pooler.weight.grad is None)


if __name__ == "__main__":
    main()
