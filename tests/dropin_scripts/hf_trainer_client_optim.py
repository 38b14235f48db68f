"""The Hugging Face ``Trainer`` building optimizer and scheduler itself: ``TrainingArguments(deepspeed=<dict>)`` with
a DeepSpeed config that has no ``optimizer`` and no ``scheduler`` section, so the Trainer creates its optimizer
(its default, a fused AdamW on torch >= 2.8, then ``--optim adamw_torch``) and passes it to
``deepspeed.initialize`` through Accelerate, then builds its linear warm-up scheduler (from lr 0) on the optimizer
Accelerate returned. A small ``GPT2LMHeadModel`` (nothing downloaded), 6 optimizer steps of 2 micro-batches; it
records the per-step losses and learning rates the Trainer logs and how far the saved weights moved from the
initial ones."""

import argparse
import os

import deepspeed
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from _common import write_result

STEPS = 6


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 64, (96, 12), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--zero_stage", type=int, default=3)
    args = parser.parse_args()
    out_dir = os.path.dirname(args.out)
    deepspeed.init_distributed()  # as hf_trainer_style: Accelerate on the CPU starts torch.distributed itself
    runs = {optim: _train(out_dir + f"/{optim}", args.zero_stage, optim) for optim in ("default", "adamw_torch")}
    write_result(args.out, runs["default"]["losses"] + runs["adamw_torch"]["losses"], runs=runs)


def _train(out_dir, zero_stage, optim):
    """The Trainer's per-step losses and learning rates, its optimizer's name, and how far the weights moved."""
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "gradient_clipping": "auto",
              "zero_optimization": {"stage": zero_stage, "stage3_gather_16bit_weights_on_model_save": True}}
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    chosen = {} if optim == "default" else {"optim": optim}
    training_args = TrainingArguments(output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=2,
                                      gradient_accumulation_steps=2, learning_rate=5e-3, warmup_steps=3,
                                      logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                                      deepspeed=config, **chosen)  # fmt: skip
    trainer = Trainer(model=model, args=training_args, train_dataset=Tokens())
    trainer.train()
    optimizer = trainer.optimizer.optimizer  # Accelerate's wrapper around what deepspeed.initialize returned
    trainer.save_model(out_dir + "/final")
    from safetensors.torch import load_file

    moved = None
    if int(os.environ.get("RANK", "0")) == 0:
        saved = load_file(out_dir + "/final/model.safetensors")
        moved = max(float((saved[k].float() - initial[k].float()).abs().max()) for k in saved)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    name = trainer.args.optim
    return {"losses": [h["loss"] for h in logs], "lrs": [h["learning_rate"] for h in logs], "moved": moved,
            "optim": getattr(name, "value", str(name)), "fused": bool(getattr(optimizer, "defaults", {}).get("fused"))}


if __name__ == "__main__":
    main()
