"""A BERT-style pre-training loop in the shape of DeepSpeed's bing_bert and pipeline examples: ``import
deepspeed.comm as dist`` for ranks and collectives, ``deepspeed.runtime.utils.set_random_seed``, a
``RepeatingLoader`` over a per-rank loader, ``log_dist``, ZeRO-1, the loss averaged over ranks for logging
(``dist.all_reduce``), then ``save_checkpoint`` with client state, ``load_checkpoint`` into a fresh engine and
training on (the continued losses are recorded too)."""

import argparse

import deepspeed
import deepspeed.comm as dist
import torch
import torch.nn as nn
from deepspeed.utils import RepeatingLoader, log_dist

from _common import write_result

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
          "optimizer": {"type": "AdamW", "params": {"lr": 5e-3, "weight_decay": 0.01, "torch_adam": True}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 5e-3,
                                                       "warmup_num_steps": 3}},
          "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}}


def build_model():
    deepspeed.runtime.utils.set_random_seed(7)
    return nn.Sequential(nn.Embedding(32, 16), nn.Flatten(), nn.Linear(16 * 6, 32), nn.GELU(), nn.Linear(32, 32))


def loader_for_rank(rank, world):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 32, (96, 6), generator=g)
    labels = torch.randint(0, 32, (96,), generator=g)
    data = torch.utils.data.TensorDataset(tokens[rank::world], labels[rank::world])
    return torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)


def train(engine, batches, micro_steps):
    losses = []
    for _ in range(micro_steps):
        tokens, labels = next(batches)
        loss = nn.functional.cross_entropy(engine(tokens.to(engine.device)), labels.to(engine.device))
        engine.backward(loss)
        engine.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / dist.get_world_size())
    return losses


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt_dir", required=True)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    model = build_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    batches = RepeatingLoader(loader_for_rank(rank, world))
    losses = train(engine, batches, 6)
    log_dist(f"saving at step {engine.global_steps}", ranks=[0])
    engine.save_checkpoint(args.ckpt_dir, tag="step3", client_state={"consumed": 6})
    dist.barrier()
    after_save = train(engine, batches, 4)

    # a fresh engine (a restarted job) resumes from the checkpoint and sees the same batches
    model = build_model()
    resumed, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    path, client = resumed.load_checkpoint(args.ckpt_dir)
    batches = RepeatingLoader(loader_for_rank(rank, world))
    for _ in range(client["consumed"]):
        next(batches)
    continued = train(resumed, batches, 4)
    write_result(args.out, losses + continued, after_save=after_save, resumed_steps=resumed.global_steps,
                 consumed=client["consumed"], loaded=path is not None, world=world,
                 local_rank=dist.get_local_rank())
    # leave the process group in order: real DeepSpeed 0.19.8 on the CPU otherwise aborts now and then at exit
    # ("terminate called without an active exception") after two engines have run in one process
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
