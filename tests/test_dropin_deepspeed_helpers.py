"""Helpers of DeepSpeed's modules that scripts and launch wrappers call directly, in the drop-in: each is checked
against DeepSpeed 0.19.8's own (installed by requirements-dev.txt) on the same inputs.

They were found missing by DeepSpeed's own unit tests (``make conformance``): ``runtime/pipe/test_topology.py``,
``runtime/pipe/test_pipe_schedule.py``, ``runtime/utils/test_partition.py``,
``runtime/comm/test_coalesced_collectives.py``, ``launcher/test_ds_arguments.py`` and ``launcher/test_run.py`` did
not import, or failed on a missing name, on torsh.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

import _engine_harness

_REAL = "DeepSpeed 0.19.8 is installed by requirements-dev.txt"


def test_pipe_schedules_are_deepspeeds_step_for_step():
    real = pytest.importorskip("deepspeed.runtime.pipe.schedule", reason=_REAL)
    from torsh.compat.deepspeed.runtime.pipe import schedule as ours

    for name in ("TrainSchedule", "InferenceSchedule", "DataParallelSchedule"):
        for stages in range(1, 6):
            for micro_batches in (1, 2, 3, 4, 7, 10):
                for stage_id in range(stages):
                    args = dict(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
                    theirs, mine = getattr(real, name)(**args), getattr(ours, name)(**args)
                    assert [repr(step) for step in mine] == [repr(step) for step in theirs], (name, args)
                    assert mine.num_pipe_buffers() == theirs.num_pipe_buffers(), (name, args)
                    assert (mine.is_first_stage, mine.is_last_stage) == (theirs.is_first_stage, theirs.is_last_stage)
    step = ours.SendActivation(3)
    assert step.buffer_id == 3 and step.kwargs == {"buffer_id": 3} and isinstance(step, ours.BufferOpInstruction)


def test_prime_factors_is_importable_from_the_topology_module_and_is_deepspeeds():
    real = pytest.importorskip("deepspeed.runtime.pipe.topology", reason=_REAL)
    from torsh.compat.deepspeed.runtime.pipe.topology import _prime_factors

    assert [_prime_factors(n) for n in range(1, 65)] == [real._prime_factors(n) for n in range(1, 65)]
    with pytest.raises(ValueError):
        _prime_factors(0)


def test_prefix_sum_inc_is_deepspeeds():
    real = pytest.importorskip("deepspeed.runtime.utils", reason=_REAL)
    from torsh.compat.deepspeed.runtime.utils import prefix_sum_inc

    for weights in ([3, 4, 5], [], [0.5, 1.5, 2.0], [7]):
        assert prefix_sum_inc(weights) == real.prefix_sum_inc(weights)


def _partitioned_tensor_rank(rank: int, world_size: int, port: int, out: str) -> None:
    import torch.distributed as dist

    import deepspeed.comm
    from deepspeed.runtime.utils import PartitionedTensor as Theirs
    from torsh.compat.deepspeed.runtime.utils import PartitionedTensor as Ours

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))  # fmt: skip
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    deepspeed.comm.init_distributed(dist_backend="gloo")  # DeepSpeed's PartitionedTensor talks through it
    record = {}
    for shape in ((8, 3), (7, 3), (5,)):  # an even split, two uneven ones
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
        mine, theirs = Ours(full, group=None), Theirs(full, group=None)
        rebuilt = Ours.from_meta(mine.to_meta(), mine.data(), None)
        record[str(shape)] = {
            "full": torch.equal(mine.full(), full),
            "rebuilt": torch.equal(rebuilt.full(), full),
            "meta": mine.to_meta().tolist() == theirs.to_meta().tolist(),
            "local": torch.equal(mine.local_data, theirs.local_data),
            "sizes": [list(mine.local_size()), mine.full_size()] == [list(theirs.local_size()), theirs.full_size()],
        }
    record["theirs"] = Theirs.__module__
    record["reduce_scatter_coalesced"] = _reduce_scatter_coalesced_checks(rank)
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def _reduce_scatter_coalesced_checks(rank: int) -> dict[str, bool]:
    from deepspeed.runtime.comm import coalesced_collectives as theirs
    from torsh.compat.deepspeed.runtime.comm import coalesced_collectives as ours

    checks = {}
    for name, shapes, dtype in (("one even", [(6,)], torch.half), ("two", [(6,), (3,)], torch.half),
                                ("smaller than the group", [(1,)], torch.half),
                                ("three fp32", [(5, 2), (7,), (4,)], torch.float32)):  # fmt: skip
        inputs = [(rank + 1) * torch.arange(i, i + torch.Size(s).numel(), dtype=dtype).reshape(s)
                  for i, s in enumerate(shapes)]  # fmt: skip
        mine_in, theirs_in = [t.clone() for t in inputs], [t.clone() for t in inputs]
        mine, real = ours.reduce_scatter_coalesced(mine_in, None), theirs.reduce_scatter_coalesced(theirs_in, None)
        checks[name] = (len(mine) == len(real) and all(torch.equal(a, b) for a, b in zip(mine, real))
                        and all(torch.equal(a, b) for a, b in zip(mine_in, theirs_in)))  # fmt: skip
    return checks


def test_partitioned_tensor_and_coalesced_reduce_scatter_are_deepspeeds_on_two_ranks():
    """PartitionedTensor's split, gather and meta, and reduce_scatter_coalesced's parts of each tensor (the mean
    over the ranks) and its in-place pre-division, against DeepSpeed's in the same 2-rank gloo job."""
    pytest.importorskip("deepspeed.runtime.utils", reason=_REAL)
    with tempfile.TemporaryDirectory() as out:
        _engine_harness.start(_partitioned_tensor_rank, (2, _engine_harness.free_port(), out), 2, timeout=300)
        records = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    for rank, record in enumerate(records):
        assert record.pop("theirs") == "deepspeed.runtime.utils"  # DeepSpeed's own, not the drop-in under its name
        assert all(record.pop("reduce_scatter_coalesced").values()), rank
        for shape, checks in record.items():
            assert all(checks.values()), (rank, shape, checks)


def test_numa_core_lists_are_read_as_deepspeed_reads_them():
    real = pytest.importorskip("deepspeed.utils.numa", reason=_REAL)
    from torsh.compat.deepspeed.utils import numa

    for text in ("0,2-4,6,8-9", "3", "0-0", "1-3,5-7"):
        assert numa.parse_range_list(text) == real.parse_range_list(text)
    for bad in ("0,2-6,5-9", "8,2-6", "1,6-2", "1-2-3", "a"):
        for module in (numa, real):
            with pytest.raises(ValueError):
                module.parse_range_list(bad)


def test_hostfile_and_include_exclude_filters_are_deepspeeds():
    real = pytest.importorskip("deepspeed.launcher.runner", reason=_REAL)
    from torsh.compat.deepspeed.launcher import runner as ours

    hostfile = ["worker-1 slots=2", "", "  worker-2 slots=4  ", "# worker-3 slots=8", "10.0.0.7 slots=1"]
    assert ours._parse_hostfile(hostfile) == real._parse_hostfile(hostfile)
    for bad in (["worker-1 slots=2", "worker-1 slots=1"], ["this is bad slots=1"], ["missingslots"], ["", "# x"]):
        for module in (ours, real):
            with pytest.raises(ValueError):
                module._parse_hostfile(bad)
    hosts = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
    for include, exclude in (("", ""), ("worker-1:0,3", ""), ("worker-0:1@worker-0:0,1", ""), ("worker-0", ""),
                             ("", "worker-1"), ("", "worker-0:0,1@worker-1:3"), ("", "worker-0@worker-1"),
                             ("", "worker-0:0,1,2,3")):  # fmt: skip
        got = ours.parse_resource_filter(hosts, include_str=include, exclude_str=exclude)
        want = real.parse_resource_filter(hosts, include_str=include, exclude_str=exclude)
        assert list(got.items()) == list(want.items()), (include, exclude)
    for include, exclude in (("A", "B"), ("jeff", ""), ("", "jeff"), ("worker-1:4", ""),
                             ("", "worker-1@worker-0:1@5")):  # fmt: skip
        for module in (ours, real):
            with pytest.raises(ValueError):
                module.parse_resource_filter(hosts, include_str=include, exclude_str=exclude)
    pool = {"worker-0": 2, "worker-1": 3}
    assert ours.parse_inclusion_exclusion(pool, "", "worker-1:0") == real.parse_inclusion_exclusion(pool, "",
                                                                                                   "worker-1:0")
