"""An image classifier trained the way DeepSpeed's CIFAR-10 tutorial does it: the config from
``--deepspeed_config``, ``training_data`` handed to ``deepspeed.initialize`` (the engine builds the sharded
loader), inputs cast to the engine's compute dtype, a BatchNorm in the model (low precision casts it too).

``--moe`` takes the tutorial's mixture-of-experts path: ``deepspeed.moe.layer.MoE`` layers (one per entry of
``--num-experts``) after the hidden layer, spread over ``--ep-world-size`` ranks, with ``--top-k``,
``--min-capacity``, ``--noisy-gate-policy`` and ``--mlp-type``; ``--moe-param-group`` splits the parameters into
DeepSpeed's expert and non-expert optimizer groups. The run ends with ``save_checkpoint`` on every rank into
``--save_dir``, and rank 0 records what the DeepSpeed-format files of that checkpoint hold."""

import argparse
import glob
import os

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator

from _common import write_result


def parse_args():
    parser = argparse.ArgumentParser(description="CIFAR-style")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", required=True)
    parser.add_argument("--moe", action="store_true", help="mixture-of-experts layers")
    parser.add_argument("--ep-world-size", type=int, default=1, help="ranks the experts of a layer are spread over")
    parser.add_argument("--num-experts", type=int, nargs="+", default=[1], help="experts of each MoE layer")
    parser.add_argument("--mlp-type", choices=["standard", "residual"], default="standard")
    parser.add_argument("--top-k", type=int, default=1)
    parser.add_argument("--min-capacity", type=int, default=0)
    parser.add_argument("--noisy-gate-policy", default=None, choices=[None, "Jitter", "RSample"])
    parser.add_argument("--moe-param-group", action="store_true", help="expert parameters in groups of their own")
    parser.add_argument("--save_dir", default=None, help="save a checkpoint here at the end")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self, args=None):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3)
        self.bn = nn.BatchNorm2d(6)
        self.fc1 = nn.Linear(6 * 3 * 3, 16)
        self.moe = args is not None and args.moe
        if self.moe:
            self.experts = nn.ModuleList(
                deepspeed.moe.layer.MoE(hidden_size=16, expert=nn.Linear(16, 16), num_experts=count,
                                        ep_size=args.ep_world_size, use_residual=args.mlp_type == "residual",
                                        k=args.top_k, min_capacity=args.min_capacity,
                                        noisy_gate_policy=args.noisy_gate_policy)
                for count in args.num_experts)  # fmt: skip
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        if self.moe:
            for layer in self.experts:
                x, _, _ = layer(x)  # the tutorial leaves the auxiliary loss out
        return self.fc2(x)


def moe_param_groups(model):
    """One group of every parameter, split into DeepSpeed's non-expert and expert groups."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                 "name": "parameters"})


def checkpoint_contents(directory):
    """The DeepSpeed-format files of the newest checkpoint in ``directory``: file -> key -> [shape, sum]."""
    with open(os.path.join(directory, "latest")) as f:
        tag = f.read().strip()
    contents = {}
    for path in sorted(glob.glob(os.path.join(directory, tag, "*_model_states.pt"))):
        saved = torch.load(path, map_location="cpu", weights_only=False)
        tensors = saved["module"] if "module" in saved else saved
        entry = {key: [list(t.shape), float(t.double().sum())] for key, t in tensors.items() if torch.is_tensor(t)}
        if "num_experts" in saved:
            entry["num_experts"] = saved["num_experts"]
        contents[os.path.basename(path)] = entry
    return contents


def main():
    args = parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(42)
    g = torch.Generator().manual_seed(0)
    images = torch.randn(64, 3, 8, 8, generator=g)
    labels = torch.randint(0, 10, (64,), generator=g)
    trainset = torch.utils.data.TensorDataset(images, labels)

    net = Net(args)
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:
        parameters = moe_param_groups(net)
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(args=args, model=net,
                                                                    model_parameters=parameters,
                                                                    training_data=trainset)
    local_device = get_accelerator().device_name(model_engine.local_rank)
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half

    criterion = nn.CrossEntropyLoss()
    losses = []
    for step, (inputs, targets) in enumerate(trainloader):
        if step == args.steps:
            break
        inputs, targets = inputs.to(local_device), targets.to(local_device)
        if target_dtype is not None:
            inputs = inputs.to(target_dtype)
        outputs = model_engine(inputs)
        loss = criterion(outputs.float(), targets)
        model_engine.backward(loss)
        model_engine.step()
        losses.append(loss.item())
    extra = {}
    if args.moe:
        from deepspeed.utils import groups

        name = f"ep_size_{args.ep_world_size}"
        extra["expert_groups"] = [groups._get_expert_parallel_world_size(name),
                                  groups._get_expert_data_parallel_world_size(name)]  # fmt: skip
    if args.save_dir:
        model_engine.save_checkpoint(args.save_dir)
        extra["checkpoint"] = checkpoint_contents(args.save_dir)
    write_result(args.out, losses, global_steps=model_engine.global_steps,
                 train_batch_size=model_engine.train_batch_size(), **extra)


if __name__ == "__main__":
    main()
