"""A pipeline-parallel training script in the shape of DeepSpeed's ``training/pipeline_parallelism`` example: a
model given to ``deepspeed.pipe.PipelineModule`` as a list of layers (modules and a lambda), ``-p`` stages,
``deepspeed.initialize(training_data=...)`` and ``engine.train_batch()`` with no iterator. ``--models tied`` builds
a language model from ``LayerSpec``s whose embedding is a ``TiedLayerSpec`` reused as the output projection on the
last stage (``forward_fn``), fed by ``train_batch(data_iter)``. Then ``eval_batch``, ``save_checkpoint`` half way
and ``load_checkpoint`` into a fresh engine that trains on over the same batches.
"""

import argparse
import json
import os

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.utils import RepeatingLoader

from _common import write_result

VOCAB, WIDTH, SEQ = 48, 32, 6


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class Gate(nn.Module):
    """A layer passing a tuple on: the activations and an integer mask, which crosses the stage boundary."""

    def __init__(self, width, first=False):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.first = first

    def forward(self, inputs):
        x, mask = inputs
        return (self.fc(x) if self.first else torch.tanh(self.fc(x)) * (mask.unsqueeze(-1) > 0)), mask


class Head(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, 3)

    def forward(self, inputs):
        return self.fc(inputs[0])


def weighted_loss(outputs, labels):
    """Labels as a tuple: the classes and a weight per sample."""
    classes, weights = labels
    return (nn.functional.cross_entropy(outputs, classes, reduction="none") * weights).mean()


def mlp_layers():
    net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                        nn.Linear(32, 10))
    return [net[0], net[1], lambda x: x * 1.0, *net[2:]]


def tied_layers():
    def logits(embedding, x):
        return x @ embedding.weight.t() / WIDTH**0.5

    return [TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH), *[LayerSpec(Block, WIDTH) for _ in range(4)],
            LayerSpec(nn.LayerNorm, WIDTH), TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH, forward_fn=logits)]


def seed(value):
    """Layer seeds (DeepSpeed's own seed function takes no numpy integer on Python 3.11, and its layer indices
    are numpy integers)."""
    torch.manual_seed(int(value))


def lm_loss(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def dataset(model):
    g = torch.Generator().manual_seed(11)
    if model == "mlp":
        x = torch.randn(512, 20, generator=g)
        return torch.utils.data.TensorDataset(x, (x[:, :10].sum(1) > 0).long() + 2 * (x[:, 10] > 0).long())
    if model == "masked":
        x = torch.randn(512, 8, generator=g)
        return torch.utils.data.TensorDataset(x, torch.randint(0, 2, (512,), generator=g),
                                              (x[:, 0] > 0).long() + (x[:, 1] > 0).long(), torch.rand(512, generator=g))
    tokens = torch.randint(0, VOCAB, (512, SEQ + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def build(args):
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)
    if args.model == "mlp":
        return PipelineModule(layers=mlp_layers(), loss_fn=nn.CrossEntropyLoss(),
                              num_stages=args.pipeline_parallel_size,
                              partition_method=args.partition, activation_checkpoint_interval=0)
    if args.model == "masked":
        return PipelineModule(layers=[LayerSpec(Gate, 8, first=True), LayerSpec(Gate, 8), LayerSpec(Gate, 8),
                                      LayerSpec(Head, 8)], loss_fn=weighted_loss,
                              num_stages=args.pipeline_parallel_size, partition_method=args.partition)
    return PipelineModule(layers=tied_layers(), loss_fn=lm_loss, num_stages=args.pipeline_parallel_size,
                          partition_method=args.partition, seed_layers=True, seed_fn=seed, base_seed=args.seed,
                          activation_checkpoint_interval=args.checkpoint_interval)


def engine_for(args, trainset):
    net = build(args)
    engine, _, _, _ = deepspeed.initialize(args=args, model=net,
                                           training_data=trainset if args.model == "mlp" else None,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])
    if args.model == "mlp" and engine.bfloat16_enabled():  # the features in the weights' dtype
        engine.set_batch_fn(lambda batch: (batch[0].to(torch.bfloat16), batch[1]))
    return engine


def batches(args, engine, trainset):
    """The iterator train_batch reads (the tied model); every pipeline replica reads its own share."""
    sampler = torch.utils.data.distributed.DistributedSampler(trainset, num_replicas=engine.dp_world_size,
                                                              rank=engine.mpu.get_data_parallel_rank(), shuffle=False)
    loader = torch.utils.data.DataLoader(trainset, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler)
    return as_pairs(args, iter(RepeatingLoader(loader)))


def as_pairs(args, batches):
    """(inputs, labels) as train_batch reads them: tuples of tensors for the masked model."""
    if args.model != "masked":
        return batches
    return (((x, mask), (classes, weights)) for x, mask, classes, weights in batches)


def step(args, engine, data):
    return engine.train_batch() if data is None else engine.train_batch(data)


def run(args, spec):
    """Train ``args.steps`` batches of the model ``spec`` names (``mlp``, or ``mlp:4`` for 4 stages instead of
    ``-p``), saving half way; evaluate; resume from the checkpoint."""
    model, _, stages = spec.partition(":")
    args = argparse.Namespace(**{**vars(args), "model": model,
                                 "pipeline_parallel_size": int(stages or args.pipeline_parallel_size)})
    trainset = dataset(model)
    engine = engine_for(args, trainset)
    data = None if model == "mlp" else batches(args, engine, trainset)
    save_at = args.steps // 2
    ckpt_dir = f"{args.ckpt_dir}/{spec}" if args.ckpt_dir else None
    losses, everywhere, after_save = [], [], []
    for i in range(args.steps):
        loss = step(args, engine, data)
        losses.append(loss.item())
        gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, loss.detach().float().reshape(1).cpu())
        everywhere.append([g.item() for g in gathered])
        if ckpt_dir and i + 1 == save_at:
            engine.save_checkpoint(ckpt_dir, client_state={"consumed": save_at})
        if i + 1 > save_at:
            after_save.append(loss.item())
    evalset = torch.utils.data.TensorDataset(*trainset[:64])
    eval_iter = as_pairs(args, iter(torch.utils.data.DataLoader(evalset,
                                                                batch_size=engine.train_micro_batch_size_per_gpu())))
    eval_loss, logits = engine.eval_batch(eval_iter, return_logits=True)
    record = {"first": engine.is_first_stage(), "last": engine.is_last_stage(), "micro_batches": engine.micro_batches,
              "global_steps": engine.global_steps, "eval_loss": eval_loss.item(),
              "logits_shape": list(logits.shape) if logits is not None else None,
              "params": sum(p.numel() for p in engine.module.parameters()),
              # what the optimizer steps: the fp32 masters under bf16 (DeepSpeed's BF16_Optimizer holds them too)
              "step_dtypes": sorted({str(p.dtype) for g in engine.optimizer.param_groups for p in g["params"]})}
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    resumed = []
    if ckpt_dir:
        engine2 = engine_for(argparse.Namespace(**{**vars(args), "seed": args.seed + 1}), trainset)
        _, client = engine2.load_checkpoint(f"{args.resume_from}/{spec}" if args.resume_from else ckpt_dir)
        data2 = engine2.data_iterator if model == "mlp" else batches(args, engine2, trainset)
        for _ in range(client["consumed"] * engine2.micro_batches):
            if data2 is not None:
                next(data2)
        resumed = [step(args, engine2, None if model == "mlp" else data2).item() for _ in range(args.steps - save_at)]
        records.append({"resumed_global_steps": engine2.global_steps})
    return {"losses": losses, "everywhere": everywhere, "ranks": records, "after_save": after_save,
            "resumed": resumed, "refused": refusals(args, engine, trainset) if model == "mlp" else {},
            "files": sorted(os.listdir(f"{ckpt_dir}/global_step{save_at}")) if ckpt_dir else []}


def refusals(args, engine, trainset):
    """What the pipeline engine refuses: forward/backward/step, and ZeRO-2 at initialize (type and message)."""
    out = {}
    x, y = trainset[:4]
    for name, call in {"forward": lambda: engine(x), "backward": lambda: engine.backward(x.sum()),
                       "step": lambda: engine.step()}.items():
        try:
            call()
        except Exception as exc:
            out[name] = [type(exc).__name__, str(exc)]
    config = json.load(open(args.deepspeed_config))
    config["zero_optimization"] = {"stage": 2}
    net = build(args)
    try:
        deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    except Exception as exc:
        out["zero2"] = str(exc)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("-s", "--steps", type=int, default=6)
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2)
    parser.add_argument("--models", default="mlp,tied")
    parser.add_argument("--partition", default="parameters")
    parser.add_argument("--checkpoint_interval", type=int, default=0)
    parser.add_argument("--seed", type=int, default=1138)
    parser.add_argument("--ckpt_dir", default=None)
    parser.add_argument("--resume_from", default=None, help="resume from this checkpoint directory (the other "
                        "engine's) instead of the one just saved")
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    results = {model: run(args, model) for model in args.models.split(",")}
    first = results[args.models.split(",")[0]]
    write_result(args.out, first["losses"], models=results)
    print(json.dumps({"rank": dist.get_rank(), **{m: r["losses"] for m, r in results.items()}}))


if __name__ == "__main__":
    main()
