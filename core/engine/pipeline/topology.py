"""``deepspeed.runtime.pipe.topology``: the process grid of a pipeline job.

A :class:`ProcessTopology` numbers the processes of a Cartesian grid row-major over its named axes (the last axis
varies fastest), as DeepSpeed's does, so that a rank has the same coordinates under both. The
:class:`PipelineParallelGrid` makes the process groups along the axes (one pipeline's stages, one stage's
data-parallel replicas, the ranks holding one model replica).
"""

from __future__ import annotations

import itertools
from collections import namedtuple


class ProcessTopology:
    """Global ranks laid out on a grid with named axes; ``axes=["x", "y"]`` puts ``(x, y)`` and ``(x, y + 1)`` on
    consecutive ranks."""

    def __init__(self, axes, dims):
        self.axes = list(axes)
        self.dims = list(dims)
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)
        self.mapping = {}
        for rank, coord in enumerate(itertools.product(*(range(d) for d in self.dims))):
            self.mapping[self.ProcessCoord(*coord)] = rank
        self._coords = {rank: coord for coord, rank in self.mapping.items()}

    def get_rank(self, **coord_kwargs) -> int:
        """The global rank at the given coordinates (every axis named)."""
        if len(coord_kwargs) != len(self.axes):
            raise ValueError("get_rank() needs a coordinate on every axis; use filter_match() for slices")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise AssertionError(f"key {coord_kwargs} invalid")
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        return self.axes

    def get_rank_repr(self, rank, omit_axes=("data", "pipe"), inner_sep="_", outer_sep="-") -> str:
        """``axis_NN`` for each axis not omitted, joined (checkpoint file names: ``model_00``)."""
        coord = self.get_coord(rank)
        return outer_sep.join(f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes
                              if axis not in set(omit_axes))  # fmt: skip

    def get_dim(self, axis) -> int:
        """The length of ``axis`` (0 for an axis the topology does not have)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank):
        if rank not in self._coords:
            raise ValueError(f"rank {rank} not found in topology.")
        return self._coords[rank]

    def get_axis_comm_lists(self, axis) -> list[list[int]]:
        """One list of ranks per position on the other axes: the ranks that differ only along ``axis``."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for fixed in itertools.product(*(range(self.get_dim(a)) for a in others)):
            where = dict(zip(others, fixed))
            lists.append([self.mapping[self.ProcessCoord(**where, **{axis: i})] for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs) -> list[int]:
        """The ranks whose coordinates equal every given one."""
        return [rank for coord, rank in self.mapping.items()
                if all(getattr(coord, k) == v for k, v in filter_kwargs.items())]  # fmt: skip

    def get_axis_list(self, axis, idx) -> list[int]:
        """The ranks whose coordinate on ``axis`` is ``idx``."""
        return self.filter_match(**{axis: idx})

    def world_size(self) -> int:
        return len(self.mapping)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism; the data axis last, so that a stage's replicas are neighbours."""

    def __init__(self, num_pp, num_dp):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x model (tensor) parallelism."""

    def __init__(self, num_pp, num_mp, num_dp):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


class PipelineParallelGrid:
    """The process groups of a pipeline topology, and where this rank sits in it (DeepSpeed's ``mpu``)."""

    def __init__(self, topology=None, process_group=None):
        import torch.distributed as dist

        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if topology is None:
            pp, dp = 1, 1
            for i, prime in enumerate(_prime_factors(self.world_size)):
                if i % 2 == 0:
                    pp *= prime
                else:
                    dp *= prime
            topology = PipeDataParallelTopology(num_pp=pp, num_dp=dp)
        self._topo = topology
        self.data_parallel_size = max(topology.get_dim("data"), 1)
        self.pipe_parallel_size = max(topology.get_dim("pipe"), 1)
        self.model_parallel_size = max(topology.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        if topology.world_size() != self.world_size:
            raise AssertionError(f"Invalid Grid: the topology has {topology.world_size()} ranks, the job "
                                 f"{self.world_size}")  # fmt: skip
        self.stage_id = self.get_stage_id()
        self.data_parallel_id = self.get_data_parallel_id()
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        # Every rank creates every group, in the same order (new_group is collective).
        self.ds_model_proc_group, self.ds_model_rank, self.ds_model_world_size = None, -1, 0
        for data in range(self.data_parallel_size):
            ranks = sorted(topology.get_axis_list("data", data))
            group = _new_group(ranks)
            if self.global_rank in ranks:
                self.ds_model_proc_group, self.ds_model_world_size = group, len(ranks)
                self.ds_model_rank = ranks.index(self.global_rank)
        self.dp_groups = topology.get_axis_comm_lists("data")
        self.dp_group, self.dp_proc_group = self._groups_along(self.dp_groups)
        self.pipe_groups = topology.get_axis_comm_lists("pipe")
        self.pp_group, self.pp_proc_group = self._groups_along(self.pipe_groups)
        if self.model_parallel_size > 1:
            self.model_groups = topology.get_axis_comm_lists("model")
            self.slice_group, self.slice_proc_group = self._groups_along(self.model_groups)
        else:
            self.slice_group, self.slice_proc_group = [self.global_rank], None
        self.p2p_groups = [[r, l[(l.index(r) + 1) % len(l)]] for r in range(self.world_size)
                           for l in self.pipe_groups if r in l]  # fmt: skip

    def _groups_along(self, lists):
        mine, mine_group = [], None
        for ranks in lists:
            group = _new_group(ranks)
            if self.global_rank in ranks:
                mine, mine_group = ranks, group
        return mine, mine_group

    def get_stage_id(self) -> int:
        return self._topo.get_coord(self.global_rank).pipe

    def get_data_parallel_id(self) -> int:
        return self._topo.get_coord(self.global_rank).data

    def stage_to_global(self, stage_id, **kwargs) -> int:
        """The global rank of ``stage_id`` at this rank's other coordinates (or those given)."""
        me = self._topo.get_coord(self.global_rank)
        return self._topo.get_rank(**me._replace(pipe=stage_id, **kwargs)._asdict())

    def topology(self):
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        return self.get_stage_id()

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    def get_pipe_parallel_group(self):
        return self.pp_proc_group

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self):
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_group

    def get_model_parallel_rank(self) -> int:
        """This rank's index among the ranks holding one model replica (all stages of its pipeline)."""
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self):
        return self.ds_model_proc_group

    def get_slice_parallel_rank(self) -> int:
        return self._topo.get_coord(self.global_rank).model if "model" in self._topo.get_axis_names() else 0

    get_tensor_model_parallel_rank = get_slice_parallel_rank

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    get_tensor_model_parallel_world_size = get_slice_parallel_world_size

    def get_slice_parallel_group(self):
        if self.slice_proc_group is None:  # one rank: made on first use, by this rank alone
            self.slice_proc_group = _new_group([self.global_rank], local=True)
        return self.slice_proc_group


def _new_group(ranks, local: bool = False):
    import torch.distributed as dist

    return dist.new_group(ranks=list(ranks), use_local_synchronization=local)


def _prime_factors(n: int) -> list[int]:
    if n <= 0:
        raise ValueError("Values must be strictly positive.")
    factors, candidate = [], 2
    while n > 1:
        while n % candidate == 0:
            factors.append(candidate)
            n //= candidate
        candidate += 1
    return factors
