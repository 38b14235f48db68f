"""A script started by ``accelerate launch --config_file <DeepSpeed YAML>`` (or by the torchrun translation of that
line): a plain ``Accelerator()``, which builds its DeepSpeed plugin from the ACCELERATE_* variables the launcher
exported. It trains 4 steps and records the losses, which engine ``prepare`` returned and those variables."""

import argparse
import os

import torch
from accelerate import Accelerator

from _common import write_result

VOCAB = 32


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, VOCAB))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, VOCAB, (8, 8), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=2)
    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for (batch,) in loader:
        logits = model(batch)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    env = {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_") and k != "ACCELERATE_DEBUG_RDZV_PORTS"}
    write_result(args.out, losses, engine=type(model).__name__, env=env,
                 stage=accelerator.state.deepspeed_plugin.zero_stage if accelerator.state.deepspeed_plugin else None)


if __name__ == "__main__":
    main()
