#!/usr/bin/env bash
# After: torchrun runs once per node. Start this on worker-0 with NODE_RANK=0 and on worker-1 with NODE_RANK=1
# (by hand, with pdsh/clush, or from a Slurm step). Produced by:
#   torsh-migrate launch "$(tail -1 run_deepspeed.sh)" --hostfile hostfile --to torchrun
set -euo pipefail
cd "$(dirname "$0")"
NCCL_DEBUG=WARN torchrun --nnodes=2 --nproc-per-node=8 --node-rank=${NODE_RANK:?set NODE_RANK to 0 or 1} --master-addr=worker-0 --master-port=29600 train.py --deepspeed_config ds_config.json --epochs 1
