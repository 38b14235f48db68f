#!/usr/bin/env bash
# Before: one command on worker-0; the deepspeed launcher reaches worker-1 over ssh (pdsh) using the hostfile.
set -euo pipefail
cd "$(dirname "$0")"
NCCL_DEBUG=WARN deepspeed --hostfile=hostfile --master_addr=worker-0 --master_port=29600 train.py --deepspeed_config ds_config.json --epochs 1
