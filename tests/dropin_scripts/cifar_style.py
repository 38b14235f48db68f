"""An image classifier trained the way DeepSpeed's CIFAR-10 tutorial does it: the config from
``--deepspeed_config``, ``training_data`` handed to ``deepspeed.initialize`` (the engine builds the sharded
loader), inputs cast to the engine's compute dtype, a BatchNorm in the model (low precision casts it too)."""

import argparse

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
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3)
        self.bn = nn.BatchNorm2d(6)
        self.fc1 = nn.Linear(6 * 3 * 3, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)
        x = torch.flatten(x, 1)
        return self.fc2(F.relu(self.fc1(x)))


def main():
    args = parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(42)
    g = torch.Generator().manual_seed(0)
    images = torch.randn(64, 3, 8, 8, generator=g)
    labels = torch.randint(0, 10, (64,), generator=g)
    trainset = torch.utils.data.TensorDataset(images, labels)

    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
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
    write_result(args.out, losses, global_steps=model_engine.global_steps,
                 train_batch_size=model_engine.train_batch_size())


if __name__ == "__main__":
    main()
