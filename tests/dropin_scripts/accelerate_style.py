"""An Accelerate training loop with a ``DeepSpeedPlugin`` (``accelerator.prepare``, ``accumulate``, ``backward``),
as Accelerate-based repositories run DeepSpeed: gradient accumulation 2 and clipping, ``save_state`` after 4
micro-steps, ``get_state_dict`` at the end (ZeRO-3: the 16-bit gather), then ``load_state`` back to the saved
state. ZeRO-2 by default (``--zero_stage``); ``--dynamo_backend`` makes Accelerate compile the engine's model
(``engine.compile(backend=..., compile_kwargs=...)``)."""

import argparse
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin

from _common import write_result

VOCAB = 32


def loss_of(model, tokens):
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--zero_stage", type=int, default=2)
    parser.add_argument("--dynamo_backend", default="no")
    args = parser.parse_args()
    state_dir = os.path.join(os.path.dirname(args.out), "state")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, VOCAB))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, VOCAB, (32, 8), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=2)
    # The config as a dict without train_batch_size, and not cpu=True: with cpu=True Accelerate leaves the plugin
    # out and wraps the model in DDP. On a CPU-only machine Accelerate counts one process in its DeepSpeed path
    # (it fills an "auto" train_batch_size with 1 x micro x accumulation, which DeepSpeed then refuses); the
    # engine itself runs on both ranks, and every rank iterates the whole loader, under torsh as under DeepSpeed.
    plugin = DeepSpeedPlugin(hf_ds_config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.zero_stage, "stage3_gather_16bit_weights_on_model_save": True}})
    accelerator = Accelerator(deepspeed_plugin=plugin, dynamo_backend=args.dynamo_backend)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    engine, compiled = type(model).__name__, model.is_compiled
    losses = []
    for step, (batch,) in enumerate(loader):
        with accelerator.accumulate(model):
            loss = loss_of(model, batch)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        if step == 3:
            accelerator.save_state(state_dir)
    state = accelerator.get_state_dict(model)
    accelerator.load_state(state_dir)
    with torch.no_grad():
        after_load = loss_of(model, next(iter(loader))[0]).item()
    write_result(args.out, losses, after_load=after_load, engine=engine, compiled=compiled,
                 state={k: [list(v.shape), float(v.double().sum())] for k, v in (state or {}).items()})


if __name__ == "__main__":
    main()
