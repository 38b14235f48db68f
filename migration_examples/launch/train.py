"""A tiny data-parallel job that runs unchanged under deepspeed, torchrun, horovodrun or mpirun.

It learns y = 3x with DistributedDataParallel on CPU (gloo). What makes it launcher-independent:
  * torsh.launch_args.add_local_rank_argument accepts --local_rank (deepspeed), --local-rank
    (torch.distributed.launch) and LOCAL_RANK (torchrun);
  * torsh.ranks.discover() finds rank, world size and the rendezvous from any launcher's variables.
Try it on one machine:  torchrun --nproc-per-node=2 train.py --deepspeed_config ds_config.json --epochs 1
"""

import argparse
import json

import torch
import torch.distributed as dist

from torsh.launch_args import add_local_rank_argument
from torsh.ranks import discover

parser = argparse.ArgumentParser()
add_local_rank_argument(parser)
parser.add_argument("--deepspeed_config", required=True)
parser.add_argument("--epochs", type=int, default=1)
args = parser.parse_args()

info = discover()
print(f"[rank {info.rank}/{info.world_size}] launcher={info.launcher} local_rank={args.local_rank} "
      f"node={info.node_rank} master={info.master_addr}:{info.master_port}", flush=True)
dist.init_process_group("gloo", rank=info.rank, world_size=info.world_size)

config = json.load(open(args.deepspeed_config))
batch = config["train_micro_batch_size_per_gpu"]
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1, bias=False))
optimizer = torch.optim.SGD(model.parameters(), lr=config["optimizer"]["params"]["lr"])
torch.manual_seed(1234 + info.rank)  # each rank sees different data
for step in range(20 * args.epochs):
    x = torch.randn(batch, 1)
    loss = torch.nn.functional.mse_loss(model(x), 3 * x)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
if info.rank == 0:
    print(f"weight {model.module.weight.item():.3f} (target 3.0), last loss {loss.item():.4f}", flush=True)
dist.destroy_process_group()
