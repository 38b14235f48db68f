"""A model as a list of layers, of which each rank builds only its pipeline stage's: DeepSpeed's
``PipelineModule``, ``LayerSpec`` and ``TiedLayerSpec``.

The layers are partitioned, built and seeded as DeepSpeed 0.19.8 builds them, so that a stage's initial weights
(and so the losses) are DeepSpeed's for the same script and seed: with ``partition_method="parameters"`` every
rank first builds every ``LayerSpec`` once to count its parameters (drawing from the random generator as
DeepSpeed does), then builds its own layers in order, reseeding before each one when ``seed_layers`` is set; a
``TiedLayerSpec`` key is built once per stage, and its tied weights are broadcast from the lowest rank holding
them. The pipeline engine (:mod:`torsh.engine.pipeline.engine`) runs the stages.
"""

from __future__ import annotations

import glob
import logging
import os
import random
import re
from functools import partial

import torch
import torch.utils.checkpoint
from torch import nn

from ..distributed import init_distributed
from .topology import PipeDataParallelTopology, PipelineParallelGrid

log = logging.getLogger("torsh.engine")


def checkpoint(function, *args, **kwargs):
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute them in backward
    (non-reentrant, the RNG state restored so that dropout gives the same masks)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, numpy (when installed; seed modulo 2**32 as numpy needs) and torch."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries (``num_parts + 1`` indices) splitting ``num_items`` items into parts whose sizes differ by at
    most one, the larger parts first."""
    base, extra = divmod(num_items, num_parts)
    bounds = [0]
    for part in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if part < extra else 0))
    return bounds


def partition_balanced(weights, num_parts: int) -> list[int]:
    """Boundaries (``num_parts + 1`` indices into ``weights``) of DeepSpeed 0.19.8's split into contiguous parts
    (``PipelineModule``'s "parameters" and "type:" partitions): the largest and smallest sums differ least; among
    equal spreads the later cut wins. Fewer items than parts: a uniform split."""
    n = len(weights)
    if n <= num_parts:
        return partition_uniform(n, num_parts)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # for i items in j parts: (spread, largest, smallest) of the chosen split, and where its last part starts
    table: dict[tuple[int, int], tuple[float, float, float, int]] = {(0, 0): (0.0, 0.0, inf, 0)}
    for i in range(1, n + 1):
        for j in range(1, min(i, num_parts) + 1):
            chosen = None
            for k in range(j - 1, i):
                before = table.get((k, j - 1))
                if before is None:
                    continue
                part = prefix[i] - prefix[k]
                largest, smallest = max(before[1], part), min(before[2], part)
                spread = largest - smallest
                if chosen is None or spread <= chosen[0]:
                    chosen = (spread, largest, smallest, k)
            if chosen is not None:
                table[(i, j)] = chosen
    bounds = [n]
    for j in range(num_parts, 0, -1):
        bounds.append(table[(bounds[-1], j)][3])
    return bounds[::-1]


def call_to_str(base: str, *args, **kwargs) -> str:
    """``base(arg, ..., key=value, ...)`` with the arguments' reprs, as DeepSpeed prints calls in its logs."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(parts)})"


class PipelineError(Exception):
    """Errors related to the use of deepspeed.PipelineModule."""


class LayerSpec:
    """A layer to build later, on the stage that holds it: ``LayerSpec(nn.Linear, 8, 4, bias=False)``."""

    def __init__(self, typename, *module_args, **module_kwargs):
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise RuntimeError("LayerSpec only supports torch.nn.Module types.")
        import torch.distributed as dist

        self.global_rank = dist.get_rank() if dist.is_initialized() else -1

    def __repr__(self) -> str:
        return call_to_str(self.typename.__name__, *self.module_args, **self.module_kwargs)

    def build(self, log=False) -> nn.Module:
        """The module, constructed now."""
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer whose weights (``tied_weight_attr``) are shared by every place ``key`` appears, also across stages
    (an input embedding reused as the output projection); ``forward_fn(module, x)`` replaces its forward there."""

    def __init__(self, key, typename, *module_args, forward_fn=None, tied_weight_attr=("weight",), **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


class PipelineModule(nn.Module):
    """The layers of this rank's pipeline stage; ``forward`` runs them in order (the output of one is the input
    of the next). Give ``num_stages`` or a ``topology``; ``loss_fn(outputs, labels)`` computes the loss on the
    last stage. ZeRO stages 2 and 3 cannot run with it (as in DeepSpeed)."""

    #: The checkpoint function DeepSpeed names ``non_reentrant_checkpoint``: with it, Megatron's GPT pipes checkpoint
    #: every layer group with parameters, not only their transformer layers.
    _non_reentrant_checkpoint = staticmethod(checkpoint)

    def __init__(self, layers, num_stages=None, topology=None, loss_fn=None, seed_layers=False, seed_fn=None,
                 base_seed=1234, partition_method="parameters", activation_checkpoint_interval=0,
                 activation_checkpoint_func=checkpoint, checkpointable_layers=None,
                 dynamic_shape=False):  # fmt: skip
        super().__init__()
        if num_stages is None and topology is None:
            raise RuntimeError("must provide num_stages or topology")
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise AssertionError("param `checkpointable_layers` must be type of list.")
        import torch.distributed as dist

        if not dist.is_initialized():
            init_distributed()
        self.micro_offset = 0
        self.loss_fn = loss_fn
        self.checkpointable_layers = checkpointable_layers
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if topology is None:
            if self.world_size % num_stages != 0:
                raise RuntimeError(f"num_stages ({num_stages}) must divide distributed world size "
                                   f"({self.world_size})")  # fmt: skip
            topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=self.world_size // num_stages)
        self._topo = topology
        self.num_stages = topology.get_dim("pipe")
        self._grid = PipelineParallelGrid(topology=topology)
        self.stage_id = topology.get_coord(self.global_rank).pipe
        self._layer_specs = list(layers)
        self._num_layers = len(self._layer_specs)
        self._local_start, self._local_stop = 0, None
        self._partition_layers(method=partition_method)
        self.forward_funcs: list = []
        self.fwd_map: dict[str, int] = {}
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.is_checkpointable_results: list[bool] = []
        self.is_checkpointable_results_interval = None
        self.checkpoint_parallel_write_pipeline = False
        self._build()
        self.to(self._stage_device())
        self.tied_comms = self._index_tied_modules()
        self._synchronize_tied_weights()
        self.dynamic_shape = dynamic_shape

    def _stage_device(self) -> str:
        """Where this stage's layers live: this rank's GPU when CUDA is available, else the CPU."""
        return f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu"

    # ---- building ---------------------------------------------------------------------------------

    def _build(self) -> None:
        for index in range(self._local_start, self._local_stop):
            layer = self._layer_specs[index]
            if self.seed_layers:
                (self.seed_fn or set_random_seed)(self.base_seed + index)
            if isinstance(layer, PipelineModule):
                raise NotImplementedError("RECURSIVE BUILD NOT YET IMPLEMENTED")
            if isinstance(layer, nn.Module):
                self._add_layer(index, layer)
            elif isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                module = self.tied_modules[layer.key]
                self.forward_funcs.append(module if layer.forward_fn is None else partial(layer.forward_fn, module))
            elif isinstance(layer, LayerSpec):
                self._add_layer(index, layer.build())
            else:  # a function (a lambda reshaping the activations): called as it is
                self.forward_funcs.append(layer)
        for p in self.parameters():
            p.ds_pipe_replicated = False

    def _add_layer(self, index: int, module: nn.Module) -> None:
        self.forward_funcs.append(module)
        self.fwd_map[str(index)] = len(self.forward_funcs) - 1
        self.add_module(str(index), module)

    def _count_layer_params(self) -> list[int]:
        """Trainable parameters of each layer; a LayerSpec is built to count them (as DeepSpeed does)."""
        counts = []
        for layer in self._layer_specs:
            module = layer.build() if isinstance(layer, LayerSpec) else layer
            counts.append(sum(p.numel() for p in module.parameters() if p.requires_grad)
                          if isinstance(module, nn.Module) else 0)  # fmt: skip
        return counts

    def _layer_name(self, layer) -> str | None:
        if isinstance(layer, LayerSpec):
            return layer.typename.__name__
        if isinstance(layer, nn.Module):
            return type(layer).__name__
        return getattr(layer, "__name__", None)

    def _find_layer_type(self, layername: str) -> list[int]:
        pattern = re.compile(layername, re.IGNORECASE)
        found = [i for i, layer in enumerate(self._layer_specs)
                 if (name := self._layer_name(layer)) is not None and pattern.search(name)]  # fmt: skip
        if not found:
            raise RuntimeError(f"Partitioning '{layername}' found no valid layers to partition.")
        return found

    def _partition_layers(self, method: str = "uniform") -> None:
        method = method.lower()
        if method == "uniform":
            self.parts = partition_uniform(self._num_layers, self.num_stages)
        elif method == "parameters":
            self.parts = partition_balanced(self._count_layer_params(), self.num_stages)
        elif method.startswith("type:"):
            matches = set(self._find_layer_type(method.split(":")[1]))
            self.parts = partition_balanced([int(i in matches) for i in range(self._num_layers)],
                                                   self.num_stages)  # fmt: skip
        else:
            raise NotImplementedError(f"Partitioning method {method} not implemented.")
        if self.global_rank == 0:
            for stage in range(self.num_stages):
                start, stop = self.parts[stage], self.parts[stage + 1]
                names = ", ".join(f"{i}: {self._layer_name(self._layer_specs[i]) or self._layer_specs[i]}"
                                  for i in range(start, stop))  # fmt: skip
                log.info("pipeline stage=%d layers=%d [%s]", stage, stop - start, names)
        self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])

    def _set_bounds(self, start=None, stop=None) -> None:
        self._local_start = start
        self._local_stop = stop

    # ---- tied weights -----------------------------------------------------------------------------

    def _index_tied_modules(self) -> dict:
        """For each tie key: the group of the ranks (one per stage holding it, same data/model coordinates) whose
        copies are kept equal; copies on all but the first of them are marked ``ds_pipe_replicated``."""
        comms: dict = {}
        if self._topo.get_dim("pipe") == 1:
            return comms
        import torch.distributed as dist

        keys = sorted({s.key for s in self._layer_specs if isinstance(s, TiedLayerSpec)})
        for key in keys:
            stages = sorted({self.stage_owner(i) for i, s in enumerate(self._layer_specs)
                             if isinstance(s, TiedLayerSpec) and s.key == key})  # fmt: skip
            for data in range(self._grid.data_parallel_size):
                for model in range(self._grid.get_slice_parallel_world_size()):
                    where = {"data": data, **({"model": model} if "model" in self._topo.get_axis_names() else {})}
                    ranks = [self._grid.stage_to_global(stage_id=s, **where) for s in stages]
                    group = dist.new_group(ranks=ranks)
                    if self.global_rank in ranks:
                        comms[key] = {"ranks": ranks, "group": group, "weight_attr": self.tied_weight_attrs[key],
                                      "module": self.tied_modules[key]}  # fmt: skip
                        if self.global_rank != ranks[0]:
                            for p in self.tied_modules[key].parameters():
                                p.ds_pipe_replicated = True
        return comms

    @staticmethod
    def _recursive_getattr(module: nn.Module, attr_name: str) -> torch.Tensor:
        for item in attr_name.split("."):
            module = getattr(module, item)
        return module

    def get_tied_weights_and_groups(self) -> list:
        return [(self._recursive_getattr(self.tied_modules[key], attr), comm["group"])
                for key, comm in self.tied_comms.items() for attr in comm["weight_attr"]]  # fmt: skip

    def allreduce_tied_weight_gradients(self) -> None:
        """Sum the gradients of each tied weight over the stages holding it."""
        import torch.distributed as dist

        for weight, group in self.get_tied_weights_and_groups():
            if weight.grad is not None:
                dist.all_reduce(weight.grad, group=group)

    def _synchronize_tied_weights(self) -> None:
        import torch.distributed as dist

        for key, comm in self.tied_comms.items():
            for attr in comm["weight_attr"]:
                with torch.no_grad():
                    dist.broadcast(self._recursive_getattr(comm["module"], attr), src=min(comm["ranks"]),
                                   group=comm["group"])  # fmt: skip

    # ---- running ----------------------------------------------------------------------------------

    def forward(self, forward_input):
        self.micro_offset += 1
        if self.activation_checkpoint_interval == 0:
            return self._range(0, len(self.forward_funcs))(forward_input)
        self._precompute_checkpointable_values()
        x = forward_input
        interval = self.activation_checkpoint_interval
        for start, checkpointable in zip(range(0, len(self.forward_funcs), interval),
                                         self.is_checkpointable_results):  # fmt: skip
            stop = min(start + interval, len(self.forward_funcs))
            if not isinstance(x, tuple):
                x = (x,)
            run = self._range(start, stop)
            x = self.activation_checkpoint_func(run, *x) if checkpointable else run(*x)
        return x

    def _range(self, start: int, stop: int):
        """Layers ``start:stop`` as one function; with ``seed_layers`` each is reseeded from the micro-batch count
        (the seeds DeepSpeed uses, so that dropout masks are reproducible under recomputation)."""
        offset = self.micro_offset + 1

        def run(*inputs):
            x = inputs[0] if len(inputs) == 1 else inputs
            for i, layer in enumerate(self.forward_funcs[start:stop]):
                self.curr_layer = start + i + self._local_start
                if self.seed_layers:
                    (self.seed_fn or set_random_seed)(self.base_seed * offset + self.curr_layer)
                x = layer(x)
            return x

        return run

    def _precompute_checkpointable_values(self) -> None:
        interval = self.activation_checkpoint_interval
        if interval > 0 and self.is_checkpointable_results_interval != interval:
            n = len(self.forward_funcs)
            self.is_checkpointable_results = [self._is_checkpointable(self.forward_funcs[s:min(s + interval, n)])
                                              for s in range(0, n, interval)]  # fmt: skip
            self.is_checkpointable_results_interval = interval

    def _is_checkpointable(self, funcs) -> bool:
        if self.activation_checkpoint_func is not self._non_reentrant_checkpoint and \
                type(self).__name__ in ("GPTModelPipe", "GPT2ModelPipe"):  # fmt: skip
            return all("ParallelTransformerLayerPipe" in type(f).__name__ or (
                self.checkpointable_layers is not None and type(f).__name__ in self.checkpointable_layers)
                for f in funcs)  # fmt: skip
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(len(list(f.parameters())) > 0 for f in funcs if isinstance(f, nn.Module))

    def set_checkpoint_interval(self, interval: int) -> None:
        assert interval >= 0
        self.activation_checkpoint_interval = interval
        self._precompute_checkpointable_values()

    def get_additional_losses(self):
        """Model-specific losses to report beside the loss (None: none)."""
        return None

    def compile(self, *args, **kwargs) -> None:
        for i, layer in enumerate(self.forward_funcs):
            if isinstance(layer, nn.Module):
                layer.compile(*args, **kwargs)
            else:
                self.forward_funcs[i] = torch.compile(layer, *args, **kwargs)

    # ---- where things are -------------------------------------------------------------------------

    def partitions(self) -> list[int]:
        return self.parts

    def stage_owner(self, layer_idx: int) -> int:
        assert 0 <= layer_idx < self._num_layers
        for stage in range(self.num_stages):
            if self.parts[stage] <= layer_idx < self.parts[stage + 1]:
                return stage
        raise RuntimeError(f"Layer {layer_idx} not owned? parts={self.parts}")

    def topology(self):
        return self._topo

    def mpu(self):
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self._topo.get_dim("pipe")

    # ---- checkpoints: one file per layer ----------------------------------------------------------

    def ckpt_prefix(self, checkpoints_path, tag) -> str:
        name = "module" + "".join(f"-{axis}_{getattr(self._topo.get_coord(self.global_rank), axis):02d}"
                                  for axis in self._topo.get_axis_names() if axis != "data")  # fmt: skip
        return os.path.join(checkpoints_path, str(tag), name)

    def ckpt_layer_path(self, ckpt_dir, local_layer_idx) -> str:
        path = os.path.join(ckpt_dir, f"layer_{local_layer_idx + self._local_start:02d}")
        rank_repr = self._topo.get_rank_repr(rank=self.global_rank)
        return path + (f"-{rank_repr}" if rank_repr else "") + "-model_states.pt"

    def ckpt_layer_path_list(self, ckpt_dir, local_layer_idx) -> list[str]:
        pattern = os.path.join(ckpt_dir, f"layer_{local_layer_idx + self._local_start:02d}-") + "*model_states.pt"
        return sorted(glob.glob(pattern))

    def save_state_dict(self, save_dir, checkpoint_engine=None, exclude_frozen_params=False) -> None:
        """Write each layer's ``state_dict`` to ``layer_NN-model_states.pt`` (data-parallel rank 0 writes)."""
        if self._grid.data_parallel_id != 0:
            return
        os.makedirs(save_dir, exist_ok=True)
        for i, layer in enumerate(self.forward_funcs):
            if not hasattr(layer, "state_dict"):
                continue
            state = layer.state_dict()
            if exclude_frozen_params:
                for name, p in layer.named_parameters():
                    if not p.requires_grad:
                        state.pop(name, None)
            torch.save({k: v.clone() for k, v in state.items()}, self.ckpt_layer_path(save_dir, i))

    def load_state_dir(self, load_dir, checkpoint_engine=None, strict=True) -> None:
        """Load each layer from its ``layer_NN-*model_states.pt`` (this rank's tensor-parallel file)."""
        rank_repr = self._topo.get_rank_repr(rank=self.global_rank)
        for i, layer in enumerate(self.forward_funcs):
            if not hasattr(layer, "load_state_dict"):
                continue
            files = self.ckpt_layer_path_list(load_dir, i)
            mine = [f for f in files if rank_repr and f"-{rank_repr}-" in os.path.basename(f)] or files
            if not mine:
                raise FileNotFoundError(f"no checkpoint file for layer {i + self._local_start} in {load_dir}")
            layer.load_state_dict(torch.load(mine[0], map_location="cpu", weights_only=False), strict=strict)
        self._synchronize_tied_weights()
