"""An Accelerate loop with a ``DeepSpeedPlugin`` whose scheduler is built before ``prepare`` on the script's optimizer
(transformers' ``get_linear_schedule_with_warmup``, from lr 0), as Accelerate's examples order it:
``prepare(model, optimizer, loader, scheduler)`` passes the optimizer to ``deepspeed.initialize`` but not the torch
scheduler, which it wraps in its ``AcceleratedScheduler`` still holding the script's optimizer. ZeRO-2 by default
(``--zero_stage``); it records per-step losses, the learning rate the scheduler reports at each step, the one the
optimizer Accelerate returned holds, and how far the weights moved."""

import argparse

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin
from transformers import get_linear_schedule_with_warmup

from _common import write_result

VOCAB = 32


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--zero_stage", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, VOCAB))
    initial = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=3, num_training_steps=8)
    tokens = torch.randint(0, VOCAB, (16, 8), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=2)
    # as accelerate_style: the config as a dict without train_batch_size, and not cpu=True
    plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                           "zero_optimization": {"stage": args.zero_stage}})  # fmt: skip
    accelerator = Accelerator(deepspeed_plugin=plugin)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses, reported, held = [], [], []
    for (batch,) in loader:
        reported.append(scheduler.get_last_lr()[0])
        logits = model(batch)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        accelerator.backward(loss)
        held.append(optimizer.param_groups[0]["lr"])  # what the optimizer that steps will use
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = accelerator.get_state_dict(model)
    moved = None
    if state is not None:
        moved = max(float((v.float() - w.float()).abs().max()) for v, w in zip(state.values(), initial))
    write_result(args.out, losses, reported=reported, held=held, moved=moved)


if __name__ == "__main__":
    main()
