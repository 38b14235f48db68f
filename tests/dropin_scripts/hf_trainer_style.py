"""The Hugging Face ``Trainer`` with ``TrainingArguments(deepspeed="ds_config.json")`` and "auto" values in the
config (Accelerate drives ``deepspeed.init_distributed`` / ``deepspeed.initialize`` and the engine's
``backward`` / ``step``), as the fine-tuning repositories built on the Trainer run DeepSpeed, on a small
``GPT2LMHeadModel`` (tied embeddings; nothing downloaded) loaded with ``from_pretrained`` after the
``TrainingArguments`` exist, as those scripts order it: at ZeRO-3 transformers then builds the model under
``deepspeed.zero.Init`` and loads each layer inside ``GatheredParameters``. ZeRO-2 in fp32 by default
(``--zero_stage``, ``--bf16``). It saves as fine-tuning runs do: a checkpoint every 2 steps and ``save_model`` at
the end (Accelerate's ``get_state_dict``: ``clone_tensors_for_torch_save`` at ZeRO 0-2, the 16-bit gather at
ZeRO-3), and a second Trainer resumes from the first checkpoint (``resume_from_checkpoint``)."""

import argparse
import json
import os

import deepspeed
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

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
        json.dump({**DS_CONFIG, "zero_optimization": {"stage": args.zero_stage,
                                                       "stage3_gather_16bit_weights_on_model_save": True}}, f)
    out_dir = os.path.dirname(args.out)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    if torch.distributed.is_initialized():  # save_pretrained writes on rank 0 only: the others wait for it
        pretrained = f"{out_dir}/pretrained"
        GPT2LMHeadModel(config).save_pretrained(pretrained)
        torch.distributed.barrier()
    else:  # the same weights on every rank (one seed)
        pretrained = f"{out_dir}/pretrained{os.environ.get('RANK', '0')}"
        GPT2LMHeadModel(config).save_pretrained(pretrained)
    losses = _train(config_path, out_dir, args.bf16, seed=0, pretrained=pretrained)
    trainer = losses.pop()
    trainer.save_model(out_dir + "/final")
    resumed = _train(config_path, out_dir, args.bf16, seed=1, pretrained=pretrained,
                     resume=out_dir + "/trainer/checkpoint-2")
    resumed.pop()
    from safetensors.torch import load_file

    saved = load_file(out_dir + "/final/model.safetensors") if int(os.environ.get("RANK", "0")) == 0 else {}
    import importlib.metadata

    write_result(args.out, losses, metadata_version=importlib.metadata.version("deepspeed"), resumed=resumed,
                 saved={k: [list(v.shape), str(v.dtype), float(v.double().sum())] for k, v in saved.items()})


def _train(config_path, out_dir, bf16, *, seed, pretrained, resume=None):
    """Per-step losses of 4 steps (from ``resume`` on: the steps after it), then the Trainer."""
    torch.manual_seed(seed)
    training_args = TrainingArguments(output_dir=out_dir + ("/resumed" if resume else "/trainer"), max_steps=4,
                                      per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                      learning_rate=5e-3, warmup_steps=2, logging_steps=1, save_strategy="steps",
                                      save_steps=2, report_to=[], use_cpu=True, bf16=bf16,
                                      deepspeed=config_path)  # fmt: skip
    # On a GPU Accelerate initializes through deepspeed.init_distributed; on the CPU it starts torch.distributed
    # itself, and real DeepSpeed's zero.Init would then count one process in its batch-size check.
    deepspeed.init_distributed()
    model = AutoModelForCausalLM.from_pretrained(pretrained)
    trainer = Trainer(model=model, args=training_args, train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=resume)
    return [h["loss"] for h in trainer.state.log_history if "loss" in h] + [trainer]


if __name__ == "__main__":
    main()
