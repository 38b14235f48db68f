"""A small DeepSpeed training script: a tiny language model on synthetic data, run with

    torchrun --nproc-per-node 2 train_deepspeed.py [--deepspeed_config train_config.json] [--steps 40]

``train_torsh.py`` is this file with one line changed (``import torsh as deepspeed``).
"""

import argparse
import json
import os

import torch
from torch import nn

import deepspeed

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB, HIDDEN, SEQ = 64, 64, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)))


def synthetic_data(n=512):
    # every sequence follows next = (3 * token + 1) % VOCAB from a random start: learnable in a few steps
    start = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(0))
    tokens = [start]
    for _ in range(SEQ):
        tokens.append((3 * tokens[-1] + 1) % VOCAB)
    tokens = torch.cat(tokens, dim=1)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--loss-log", help="write rank 0's per-step losses to this JSON file (to compare runs)")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    if args.deepspeed_config is None:
        args.deepspeed_config = os.path.join(HERE, "train_config.json")

    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = TinyLM()
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=synthetic_data())

    losses = []  # mean loss of each optimizer step on this rank
    window = []
    while engine.global_steps < args.steps:
        for inputs, targets in loader:
            inputs, targets = inputs.to(engine.device), targets.to(engine.device)
            logits = engine(inputs)
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            window.append(loss.item())
            if boundary:
                losses.append(sum(window) / len(window))
                window = []
            if engine.global_steps >= args.steps:
                break

    if engine.global_rank == 0:
        marks = [i for i in range(0, len(losses), max(1, len(losses) // 8))] + [len(losses) - 1]
        curve = " ".join(f"{i + 1}:{losses[i]:.3f}" for i in sorted(set(marks)))
        print(f"loss curve (step:loss) {curve}")
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {engine.global_steps} steps "
              f"(stage {engine.zero_optimization_stage()}, world size {engine.world_size}, "
              f"lr {engine.get_lr()[0]:.4g})")
        if args.loss_log:
            with open(args.loss_log, "w") as f:
                json.dump(losses, f)


if __name__ == "__main__":
    main()
