"""Supervised fine-tuning of a small causal LM shaped like a Hugging Face model (tied ``lm_head`` /
``embed_tokens``, ``model(input_ids, labels=...)`` returning ``.loss``), in the shape of DeepSpeed-Chat's step-1
``main.py`` and its ``dschat/utils``: the model built under ``deepspeed.zero.Init``, "pretrained" weights
loaded layer by layer inside ``GatheredParameters(..., modifier_rank=0)`` by rank 0, parameter groups without
weight decay for biases and norms, the loss averaged over ranks, and the full weights read back under
``GatheredParameters`` after training, then parameter by parameter through the two save helpers such scripts
keep (a ``maybe_zero_3``-style copy that gathers when ``hasattr(p, "ds_id")``, as LLaVA's and FastChat's do, and
DeepSpeed-Chat's ``save_zero_three_model`` loop over the parameters still ``NOT_AVAILABLE``). ZeRO-3 in bf16 by
default (``--zero_stage`` / ``--dtype`` change it)."""

import argparse
import math

import deepspeed
import torch
import torch.nn as nn
from deepspeed import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam  # noqa: F401  (DS-Chat picks one; see --optimizer)
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from _common import write_result


class Output(dict):
    __getattr__ = dict.get


class Block(nn.Module):
    def __init__(self, d, heads=2):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyCausalLM(nn.Module):
    def __init__(self, vocab=64, d=32, layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tie_word_embeddings

    def forward(self, input_ids, labels=None):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return Output(loss=loss, logits=logits)


def load_state_dict_into_model(model, state_dict):
    """Rank 0 loads each module's own parameters while they are gathered; the others receive them on exit."""

    def load(module, prefix=""):
        params = list(module.parameters(recurse=False))
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            if torch.distributed.get_rank() == 0:
                module._load_from_state_dict(state_dict, prefix, {}, True, [], [], [])
        for name, child in module._modules.items():
            if child is not None:
                load(child, prefix + name + ".")

    load(model)


def grouped_parameters(model, weight_decay):
    no_decay = ("bias", "norm", "ln1", "ln2")
    return [{"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
             "weight_decay": weight_decay},
            {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
             "weight_decay": 0.0}]


def get_all_reduce_mean(tensor):
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return tensor / torch.distributed.get_world_size()


def copy_maybe_gathered(param):
    """A CPU copy of a parameter's whole value: gathered first when ZeRO partitions it."""
    if hasattr(param, "ds_id"):
        with deepspeed.zero.GatheredParameters([param]):
            return param.data.detach().cpu().clone()
    return param.detach().cpu().clone()


def not_available(params):
    return [p for p in params if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def zero3_save_loop(module, zero_stage):
    """Every parameter's value for ``torch.save`` as the ZeRO-3 save loop reads it: ``p.data`` while gathered."""
    state, statuses = {}, set()
    for name, param in module.named_parameters():
        if hasattr(param, "ds_id"):
            statuses.add(param.ds_status.name)
            with deepspeed.zero.GatheredParameters(not_available([param]), enabled=zero_stage == 3):
                statuses.add(param.ds_status.name)
                state[name] = param.data.cpu()
            statuses.add(param.ds_status.name)
        else:
            state[name] = param.cpu()
    return state, sorted(statuses)


def summary(state):
    """What a saved tensor must be: its shape, a plain tensor, its dtype, the sum of its values and of their sizes."""
    return {k: [list(v.shape), type(v).__name__, str(v.dtype), math.fsum(v.double().flatten().tolist()),
                math.fsum(v.double().abs().flatten().tolist())] for k, v in state.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--zero_stage", type=int, default=3)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed()
    get_accelerator().manual_seed_all(1234)
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
                 "gradient_clipping": 1.0, "zero_optimization": {"stage": args.zero_stage},
                 "bf16": {"enabled": args.dtype == "bf16"}}

    torch.manual_seed(123)
    pretrained = TinyCausalLM().state_dict()
    torch.manual_seed(999 + torch.distributed.get_rank())  # each rank builds different weights ...
    with deepspeed.zero.Init(config_dict_or_path=ds_config, enabled=args.zero_stage == 3):
        model = TinyCausalLM()
    load_state_dict_into_model(model, pretrained)  # ... and rank 0's pretrained ones win

    optimizer = torch.optim.AdamW(grouped_parameters(model, 0.1), lr=3e-3, betas=(0.9, 0.95))
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 2))
    model, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, args=args,
                                                             config=ds_config, lr_scheduler=lr_scheduler,
                                                             dist_init_required=True)
    device = get_accelerator().current_device_name()
    g = torch.Generator().manual_seed(5)
    data = torch.randint(0, 64, (2 * args.steps * torch.distributed.get_world_size(), 12), generator=g)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    losses = []
    model.train()
    for step in range(args.steps):
        batch = data[(step * world + rank) * 2:(step * world + rank + 1) * 2].to(device)
        outputs = model(batch, labels=batch)
        model.backward(outputs.loss)
        model.step()
        losses.append(get_all_reduce_mean(outputs.loss.detach().float().clone()).item())

    with deepspeed.zero.GatheredParameters(list(model.module.parameters()), modifier_rank=None):
        state = {k: v.detach().float().cpu() for k, v in model.module.state_dict().items()}
    checksum = math.fsum(v.double().abs().sum().item() for v in state.values())
    copies = {name: copy_maybe_gathered(p) for name, p in model.module.named_parameters()}
    saved, statuses = zero3_save_loop(model.module, args.zero_stage) if args.zero_stage == 3 else ({}, [])
    write_result(args.out, losses, checksum=checksum, shapes={k: list(v.shape) for k, v in state.items()},
                 tied=bool(torch.equal(state["lm_head.weight"], state["embed_tokens.weight"])),
                 copies=summary(copies), saved=summary(saved), statuses=statuses,
                 numel=sum(getattr(p, "ds_numel", p.numel()) for p in model.module.parameters()))


if __name__ == "__main__":
    main()
