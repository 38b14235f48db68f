"""The Hugging Face ``Trainer`` with ``TrainingArguments(deepspeed="ds_config.json")`` and "auto" values in the
config (Accelerate drives ``deepspeed.init_distributed`` / ``deepspeed.initialize`` and the engine's
``backward`` / ``step``), as the fine-tuning repositories built on the Trainer run DeepSpeed. ZeRO-2."""

import argparse
import json
import os

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from _common import write_result

DS_CONFIG = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 2},
             "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
             "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto"}}}


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, input_ids=None, labels=None):
        logits = self.head(torch.tanh(self.embed(input_ids)))
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 32, (64, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    config_path = os.path.join(os.path.dirname(args.out), "hf_ds_config.json")
    with open(config_path, "w") as f:
        json.dump(DS_CONFIG, f)
    torch.manual_seed(0)
    training_args = TrainingArguments(output_dir=os.path.dirname(args.out) + "/trainer", max_steps=4,
                                      per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                      learning_rate=5e-3, warmup_steps=2, logging_steps=1, save_strategy="no",
                                      report_to=[], use_cpu=True, deepspeed=config_path)
    trainer = Trainer(model=TinyLM(), args=training_args, train_dataset=Tokens())
    trainer.train()
    import importlib.metadata

    write_result(args.out, [h["loss"] for h in trainer.state.log_history if "loss" in h],
                 metadata_version=importlib.metadata.version("deepspeed"))


if __name__ == "__main__":
    main()
