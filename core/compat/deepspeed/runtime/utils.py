"""``deepspeed.runtime.utils``: the helpers training scripts call."""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence

import torch

from torsh.engine.pipeline.module import (  # noqa: F401  (the engine's: PipelineModule's partition and seeding)
    call_to_str,
    partition_balanced,
    partition_uniform,
    set_random_seed,
)

log = logging.getLogger("torsh.compat")


def see_memory_usage(message, force=False, ranks=None) -> None:
    """Log memory in use (DeepSpeed prints only with ``force=True``)."""
    if not force:
        return
    from ..accelerator import get_accelerator

    acc = get_accelerator()
    gib = 2**30
    log.info("%s | allocated %.2f GiB, max allocated %.2f GiB", message, acc.memory_allocated() / gib,
             acc.max_memory_allocated() / gib)  # fmt: skip


def _dist():
    """``torch.distributed`` when a process group is running, else None (one process: nothing to reduce)."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _device() -> str:
    from ..accelerator import get_accelerator

    return get_accelerator().current_device_name()


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (a gradient of a parameter torsh's engine sharded) as its full value; a tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def is_model_parallel_parameter(p) -> bool:
    """Whether ``p`` is split across the model-parallel ranks (Megatron's ``model_parallel`` or
    ``tensor_model_parallel`` mark), as DeepSpeed tells."""
    return bool(getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False))


def _tensor_model_parallel_rank(mpu) -> int:
    """This rank's place in its tensor-parallel group as DeepSpeed reads it from an ``mpu`` (0 without one)."""
    if mpu is None:
        return 0
    for name in ("get_tensor_model_parallel_rank", "get_slice_parallel_rank", "get_model_parallel_rank"):
        if hasattr(mpu, name):
            return getattr(mpu, name)()
    return 0


def has_inf_or_nan(x) -> torch.Tensor:
    """Whether ``x`` holds an infinity or a NaN, as a boolean scalar tensor on ``x``'s device (an empty tensor
    holds none; a sparse tensor is judged by its stored values)."""
    if x.is_sparse:
        x = x._values()
    if x.numel() == 0:
        return torch.tensor(False, device=x.device)
    finite = torch.isfinite(x.amax()) & torch.isfinite(x.amin())
    return ~finite


def is_invalid_grad_norm(norm) -> bool:
    """A norm that cannot be a norm: infinite, NaN or negative (torsh's and DeepSpeed's -1 for an overflow)."""
    if torch.is_tensor(norm):
        return bool((~torch.isfinite(norm) | (norm < 0)).any())
    return not math.isfinite(float(norm)) or norm < 0


class CheckOverflow:
    """Whether the gradients of ``param_groups`` (a list of parameter lists) overflowed, on any rank that shares
    them, as DeepSpeed's ``CheckOverflow`` (same arguments and methods). A rank's own finding is combined with the
    maximum over: the largest expert-parallel group when an expert parameter (``param.allreduce`` False) is among
    the parameters, whose gradients differ between ranks; ``mpu``'s model-parallel group (and its data-parallel
    group when ``deepspeed``, the engine, does not reduce gradients in backward); the world when
    ``zero_reduce_scatter``, or when there is no ``mpu`` and the engine does not reduce gradients in backward."""

    def __init__(self, param_groups=None, mpu=None, zero_reduce_scatter=False, deepspeed=None):
        from ..moe.utils import is_moe_param

        self.mpu = mpu
        self.zero_reduce_scatter = zero_reduce_scatter
        self.deepspeed = deepspeed
        self.params = [p for group in param_groups for p in group] if param_groups else None
        self.has_moe_params = any(is_moe_param(p) for p in self.params or ())

    def _expert_group(self):
        from ..utils import groups

        return groups._get_max_expert_parallel_group()

    def check_using_norm(self, norm_group, reduce_overflow=True) -> bool:
        """Overflow judged from gradient norms already computed (one per group; an invalid norm is an overflow);
        without an ``mpu``, ``reduce_overflow`` takes the maximum over the world."""
        flag = torch.tensor([float(any(is_invalid_grad_norm(n) for n in norm_group))], device=_device())
        dist = _dist()
        if dist is not None:
            if self.has_moe_params:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._expert_group())
            if self.mpu is not None:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.mpu.get_model_parallel_group())
            elif reduce_overflow:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                dist.barrier()
        return bool(flag[0].item())

    def check(self, param_groups=None) -> bool:
        """Overflow in the gradients of ``param_groups`` (default: those given at construction)."""
        if param_groups is None:
            return self.has_overflow(self.params, has_moe_params=self.has_moe_params)
        from ..moe.utils import is_moe_param

        params = [p for group in param_groups for p in group]
        return self.has_overflow(params, has_moe_params=any(is_moe_param(p) for p in params))

    def has_overflow_serial(self, params) -> bool:
        """This rank's finding alone."""
        return any(p.grad is not None and self._has_inf_or_nan(p.grad.data, i) for i, p in enumerate(params))

    def _reduces_in_backward(self) -> bool:
        engine = self.deepspeed
        if hasattr(engine, "pipeline_enable_backward_allreduce"):
            return engine.pipeline_enable_backward_allreduce is not False
        return engine.enable_backward_allreduce is not False

    def has_overflow(self, params, has_moe_params=None) -> bool:
        if has_moe_params is None:
            has_moe_params = self.has_moe_params
        flag = torch.tensor([int(self.has_overflow_serial(params))], dtype=torch.uint8, device=_device())
        dist = _dist()
        if dist is not None:
            MAX = dist.ReduceOp.MAX
            if has_moe_params:
                dist.all_reduce(flag, op=MAX, group=self._expert_group())
            if self.zero_reduce_scatter:
                dist.all_reduce(flag, op=MAX, group=dist.group.WORLD)
            elif self.mpu is not None:
                if self.deepspeed is not None and not self._reduces_in_backward():
                    dist.all_reduce(flag, op=MAX, group=self.mpu.get_data_parallel_group())
                dist.all_reduce(flag, op=MAX, group=self.mpu.get_model_parallel_group())
            elif self.deepspeed is not None and self.deepspeed.enable_backward_allreduce is False:
                dist.all_reduce(flag, op=MAX, group=dist.group.WORLD)
        return bool(flag[0].item())

    @staticmethod
    def _has_inf_or_nan(x, i) -> bool:
        return bool(has_inf_or_nan(x))


def clip_grad_norm_(parameters, max_norm, norm_type=2, mpu=None):
    """Scale the gradients of ``parameters`` in place so that their norm is at most ``max_norm``, and return the
    norm (a tensor on the first parameter's device), as DeepSpeed's ``clip_grad_norm_``.

    DeepSpeed's norm: each rank's p-norm over its gradients (with an ``mpu``: parameters split across the
    model-parallel ranks on every rank, the others on model-parallel rank 0 only, summed over the model-parallel
    group; the infinity norm takes the maximum there), then averaged over the data-parallel group, so that every
    rank clips by the same coefficient even where gradients differ between ranks (expert parameters, which
    data-parallel reduction leaves alone). A gradient sharded by torsh's engine counts with its full value."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    device = _device()
    dist = _dist()
    if norm_type == math.inf:
        norms = [_whole(p.grad.data.abs().max()).float() for p in parameters]
        total = torch.stack(norms).max().to(device)
        if mpu is not None and dist is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=mpu.get_model_parallel_group())
    else:
        counted = [p for p in parameters
                   if mpu is None or mpu.get_model_parallel_rank() == 0 or is_model_parallel_parameter(p)]
        norms = [_whole(p.grad.data.detach().float().norm(norm_type)) for p in counted]
        if norms:
            total = torch.stack(norms).pow(norm_type).sum().float()
        else:
            total = torch.tensor([0.0], device=device)
        total = total.to(device)
        if mpu is not None and dist is not None:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
        total = total.pow(1.0 / norm_type)
    if dist is not None:
        from ..utils import groups

        data_parallel = groups._get_data_parallel_group()
        total = total * 1.0 / float(dist.get_world_size(group=data_parallel))
        dist.all_reduce(total, group=data_parallel)
    if not parameters:
        return total
    total = total.to(parameters[0].device)
    coef = torch.min(torch.tensor([1.0], device=total.device),
                     torch.tensor([float(max_norm)], device=total.device) / (total + 1e-6))
    from torch.distributed.tensor import DTensor

    for p in parameters:
        p.grad.data.mul_(coef.item() if isinstance(p.grad, DTensor) else coef)
    return total


def get_global_norm(norm_list) -> float:
    """The 2-norm of per-group 2-norms; infinity when one of them is not a norm (infinite, NaN or negative)."""
    if any(is_invalid_grad_norm(n) for n in norm_list):
        return float("inf")
    return math.sqrt(sum(n**2.0 for n in norm_list))


def get_weight_norm(parameters, norm_type=2, mpu=None) -> float:
    """The p-norm of the values of ``parameters`` (tensors; not their gradients) as a float, -1 when it is
    infinite or NaN, as DeepSpeed's ``get_weight_norm``. With an ``mpu``: a tensor-parallel rank other than 0
    counts only the parameters split across those ranks, and the sum of powers (or the maximum, for the infinity
    norm) is taken over the model-parallel group; pipeline-replicated parameters (``ds_pipe_replicated``) are
    counted once."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    norm_type = float(norm_type)
    dist = _dist()
    if norm_type == math.inf:
        reduce_op = "MAX"
        total = float(max(_whole(p.data.abs().max()) for p in parameters))
    else:
        reduce_op = "SUM"
        tp_rank = _tensor_model_parallel_rank(mpu)
        total = 0.0
        for p in parameters:
            if getattr(p, "ds_pipe_replicated", False):
                continue
            if tp_rank > 0 and not is_model_parallel_parameter(p):
                continue
            total += _whole(p.data.float().norm(norm_type)) ** norm_type
        total = float(total)
    reduced = torch.tensor([total], dtype=torch.float, device=_device())
    if mpu is not None and dist is not None:
        dist.all_reduce(reduced, op=getattr(dist.ReduceOp, reduce_op), group=mpu.get_model_parallel_group())
    total = reduced[0].item()
    if norm_type != math.inf:
        total = total ** (1.0 / norm_type)
    return -1 if not math.isfinite(total) else total


def check_internal_apis_for_count_used_parameters() -> bool:
    """Whether this torch has the autograd internals :func:`count_used_parameters_in_backward` reads."""
    return hasattr(torch.autograd.graph, "_get_grad_fn_or_grad_acc") and all(
        hasattr(torch._C, name) for name in ("_current_graph_task_id", "_will_engine_execute_node"))


def count_used_parameters_in_backward(parameters: Sequence[torch.nn.Parameter]) -> int:
    """How many of ``parameters`` the backward pass now running reaches (their gradient accumulators will run), as
    DeepSpeed's: call it from a backward hook. Parameters that do not require gradients, or that this backward
    does not touch, are not counted; parameters sharing one accumulator count once. Raises ``RuntimeError``
    outside a backward pass."""
    if not check_internal_apis_for_count_used_parameters():
        raise AssertionError("count_used_parameters_in_backward needs torch.autograd.graph._get_grad_fn_or_grad_acc, "
                             "torch._C._current_graph_task_id and torch._C._will_engine_execute_node, which this "
                             "torch does not have")  # fmt: skip
    if torch._C._current_graph_task_id() == -1:
        raise RuntimeError("count_used_parameters_in_backward must be called during backward execution")
    from torch.autograd.graph import _get_grad_fn_or_grad_acc

    nodes: dict[int, object] = {}
    for param in parameters:
        if not isinstance(param, torch.Tensor) or not param.requires_grad:
            continue
        with torch.enable_grad():  # backward hooks run without grad mode; the accumulator lookup needs it
            node = _get_grad_fn_or_grad_acc(param)
        if node is not None:
            nodes.setdefault(id(node), node)
    return sum(bool(torch._C._will_engine_execute_node(node)) for node in nodes.values())


def move_to_device(item, device, criterion_func=None):
    """Move every tensor in a (nested) list, tuple or dict to ``device``."""
    if torch.is_tensor(item):
        return item.to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(move_to_device(v, device) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device) for k, v in item.items()}
    return item


def noop_decorator(func):
    return func


def memory_status(msg, print_rank=-1, reset_max=False) -> None:
    """Log accelerator memory on ``print_rank`` (-1: every rank), as DeepSpeed's ``memory_status``."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if print_rank != -1 and rank != print_rank:
        return
    see_memory_usage(f"rank {rank}: {msg}", force=True)
    if reset_max:
        from ..accelerator import get_accelerator

        get_accelerator().reset_max_memory_allocated()


def prefix_sum_inc(weights) -> list:
    """The inclusive prefix sums of ``weights``: ``[3, 4, 5]`` -> ``[3, 7, 12]``."""
    return list(itertools.accumulate(weights))


class PartitionedTensor:
    """A tensor split across the ranks of ``group``, each rank keeping one contiguous part of its flattened
    elements (split as :func:`partition_uniform` splits them: sizes differ by at most one, the larger parts
    first), as DeepSpeed's pipeline engine partitions activations across a model-parallel group.

    ``full()`` gathers the whole tensor back on every rank (collective); ``to_meta()`` encodes the shape and the
    split as a long tensor, which with ``data()`` rebuilds the object on a rank that received both
    (``from_meta``)."""

    def __init__(self, tensor, group, partition_meta=None):
        import torch.distributed as dist

        self.group = group
        self.num_parts = dist.get_world_size(group=group)
        self.rank = dist.get_rank(group=group)
        self.orig_size = list(tensor.size())
        self.orig_device = tensor.device
        self.partition = partition_uniform(tensor.numel(), self.num_parts)
        start, stop = self.partition[self.rank], self.partition[self.rank + 1]
        self.local_data = tensor.detach().contiguous().view(-1)[start:stop].clone()
        self.even_split = tensor.numel() % self.num_parts == 0

    @classmethod
    def from_meta(cls, meta, local_part, group, device=None):
        """The object whose ``to_meta()`` gave ``meta``, holding ``local_part`` as this rank's part."""
        import torch.distributed as dist

        if meta.dtype != torch.long:
            raise TypeError(f"PartitionedTensor.from_meta: meta must be a long tensor (to_meta()), got {meta.dtype}")
        values = meta.tolist()
        ndim = values[0]
        num_parts, rank, partition = values[1 + ndim], values[2 + ndim], values[3 + ndim:]
        if num_parts != dist.get_world_size(group=group) or rank != dist.get_rank(group=group):
            raise ValueError(f"PartitionedTensor.from_meta: the meta was made by rank {rank} of {num_parts}; this is "
                             f"rank {dist.get_rank(group=group)} of {dist.get_world_size(group=group)}")  # fmt: skip
        obj = cls.__new__(cls)
        obj.group, obj.num_parts, obj.rank = group, num_parts, rank
        obj.orig_size = values[1 : 1 + ndim]
        obj.orig_device = device if device is not None else _device()
        obj.partition = partition
        obj.local_data = local_part.detach()
        obj.even_split = math.prod(obj.orig_size) % num_parts == 0
        return obj

    def full(self, device=None) -> torch.Tensor:
        """The whole tensor, gathered from every rank's part (collective over the group)."""
        import torch.distributed as dist

        device = self.orig_device if device is None else device
        flat = torch.zeros(math.prod(self.orig_size), dtype=self.local_data.dtype, device=device)
        if self.even_split:
            dist.all_gather_into_tensor(flat, self.local_data.to(device), group=self.group)
        else:
            for part in range(self.num_parts):
                start, stop = self.partition[part], self.partition[part + 1]
                piece = flat[start:stop]
                if part == self.rank:
                    piece.copy_(self.local_data)
                dist.broadcast(piece, dist.get_global_rank(self.group, part) if self.group is not None else part,
                               group=self.group)  # fmt: skip
        return flat.view(self.orig_size).clone()

    def to_meta(self) -> torch.Tensor:
        """``[ndim, *shape, num_parts, rank, *partition]`` as a long tensor on the tensor's device."""
        meta = [len(self.orig_size), *self.orig_size, self.num_parts, self.rank, *self.partition]
        return torch.tensor(meta, dtype=torch.long, device=self.orig_device)

    def data(self) -> torch.Tensor:
        return self.local_data

    def local_size(self) -> torch.Size:
        return self.local_data.size()

    def full_size(self) -> list[int]:
        return self.orig_size
