"""The Hugging Face ``Trainer`` with ``TrainingArguments(deepspeed="ds_config.json")`` and "auto" values in the
config (Accelerate drives ``deepspeed.init_distributed`` / ``deepspeed.initialize`` and the engine's
``backward`` / ``step``), as the fine-tuning repositories built on the Trainer run DeepSpeed, on a small
``GPT2LMHeadModel`` built from a config (tied embeddings; nothing downloaded). ZeRO-2 in fp32 by default
(``--zero_stage``, ``--bf16``)."""

import argparse
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from _common import write_result

DS_CONFIG = {"bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto",
             "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto",
             "zero_optimization": {"stage": 2},
             "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
             "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto"}}}


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 64, (64, 12), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--zero_stage", type=int, default=2)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    config_path = os.path.join(os.path.dirname(args.out), "hf_ds_config.json")
    with open(config_path, "w") as f:
        json.dump({**DS_CONFIG, "zero_optimization": {"stage": args.zero_stage}}, f)
    torch.manual_seed(0)
    training_args = TrainingArguments(output_dir=os.path.dirname(args.out) + "/trainer", max_steps=4,
                                      per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                      learning_rate=5e-3, warmup_steps=2, logging_steps=1, save_strategy="no",
                                      report_to=[], use_cpu=True, bf16=args.bf16, deepspeed=config_path)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    trainer = Trainer(model=model, args=training_args, train_dataset=Tokens())
    trainer.train()
    import importlib.metadata

    write_result(args.out, [h["loss"] for h in trainer.state.log_history if "loss" in h],
                 metadata_version=importlib.metadata.version("deepspeed"))


if __name__ == "__main__":
    main()
