"""The pipeline engine ``deepspeed.initialize`` returns for a ``PipelineModule``: DeepSpeed's ``PipelineEngine``
contract on ``torch.distributed.pipelining``.

Each rank holds one stage (the layers its ``PipelineModule`` built); ``train_batch`` reads
``gradient_accumulation_steps`` micro-batches (the first stage their inputs, the last their labels) and runs them
through a ``Schedule1F1B`` over the pipeline's process group. Then, as DeepSpeed's train schedule ends: the
gradients of tied weights are summed over the stages holding them, gradients are averaged over the stage's
data-parallel replicas, and the optimizer steps. ZeRO-1 is the engine's partition
(:class:`..zero.partition.ZeroPartition` in its stage-1 mode) over a stage's replicas: this engine all-reduces the
whole gradients (bf16 weights: accumulated in fp32 over the micro-batches, as DeepSpeed's bf16 optimizer), each
replica keeps its elements, steps its flat fp32 partition and the updated partitions are gathered. The loss is
DeepSpeed's: the mean over micro-batches, averaged over replicas, broadcast from the last stage to every stage.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torsh.config import ParallelismConfig, TorshConfig
from torsh.errors import ConfigError, Problem

from ..engine import Engine
from ..precision import MASTER
from ..zero.construction import partitioned_parameters
from ..zero.sharding import ShardPlan

log = logging.getLogger("torsh.engine")

ONLY_TRAIN_BATCH = "Only train_batch() is accessible in pipeline mode."
ZERO_INCOMPATIBLE = "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"


def is_pipeline_module(model: Any) -> bool:
    """Whether ``initialize`` was given a ``deepspeed.pipe.PipelineModule`` (torsh's)."""
    from .module import PipelineModule

    return isinstance(model, PipelineModule)


def pipeline_degree(parallelism: ParallelismConfig) -> int | None:
    """The pipeline degree the config asks for (None: not set, or "auto": the module's ``num_stages`` decides)."""
    stages = parallelism.pp
    return stages if isinstance(stages, int) and "pp" in parallelism.model_fields_set else None


def pipeline_refusals(cfg: TorshConfig, module: Any) -> list[Problem]:
    """What the pipeline engine cannot run, each naming the key and what to do instead."""
    return _config_refusals(cfg) + _layout_refusals(cfg, module)


def _config_refusals(cfg: TorshConfig) -> list[Problem]:
    problems = []
    if cfg.sharding.stage >= 2:
        problems.append(Problem("sharding.stage", cfg.sharding.stage, f"{ZERO_INCOMPATIBLE} (as in DeepSpeed); use "
                                "zero_optimization.stage 0 or 1 with a PipelineModule"))  # fmt: skip
    if cfg.precision.param_dtype == "fp16" or cfg.precision.loss_scaling.mode != "none":
        problems.append(Problem("precision.param_dtype", "fp16", "fp16 with loss scaling is not run by the torsh "
                                "pipeline engine; use bf16 or fp32"))  # fmt: skip
    if cfg.precision.autocast:
        problems.append(Problem("precision.autocast", True, "torch_autocast is not run by the torsh pipeline "
                                "engine; use bf16.enabled (bf16 weights, fp32 master weights)"))  # fmt: skip
    if cfg.compression.method != "none":
        problems.append(Problem("compression.method", cfg.compression.method, "gradient compression is not run by "
                                "the torsh pipeline engine; remove it"))  # fmt: skip
    if cfg.offload.params != "none" or cfg.offload.optimizer == "nvme":
        problems.append(Problem("offload", {"params": cfg.offload.params, "optimizer": cfg.offload.optimizer},
                                "the torsh pipeline engine offloads only the optimizer, to the CPU; set "
                                "offload_param.device none and offload_optimizer.device cpu or none"))  # fmt: skip
    return problems


def _layout_refusals(cfg: TorshConfig, module: Any) -> list[Problem]:
    problems = []
    mpu = getattr(module, "mpu", None)
    if mpu is not None and mpu().get_slice_parallel_world_size() > 1:
        problems.append(Problem("topology", "model", "tensor parallelism inside a pipeline stage (a topology 'model' "
                                "axis above 1) is not run by the torsh pipeline engine; use PipeDataParallelTopology "
                                "or num_stages"))  # fmt: skip
    if cfg.parallelism.tp > 1:
        problems.append(Problem("parallelism.tp", cfg.parallelism.tp, "tensor parallelism inside a pipeline stage "
                                "is not run by the torsh pipeline engine; set it to 1 with a PipelineModule"))
    degree = pipeline_degree(cfg.parallelism)
    if degree is not None and degree != module.num_stages:
        problems.append(Problem("parallelism.pp", degree, f"the PipelineModule has {module.num_stages} stages; "
                                "set the stages in one place (PipelineModule(num_stages=...)) or remove the key"))
    return problems


def initialize_pipeline(*, args, model, optimizer, model_parameters, training_data, lr_scheduler, distributed_port,
                        mpu, dist_init_required, collate_fn, config, config_params):  # fmt: skip
    """``initialize`` for a ``PipelineModule``: the same config pipeline and return values, a
    :class:`PipelineEngine`."""
    from torsh.plan import plan

    from .. import config_io as init
    from ..auto import log_resolved, resolve_auto
    from ..distributed import init_distributed as start_process_group
    from ..monitor import Monitor
    from ..precision import apply_precision
    from ..optim import build_step_optimizer, named_groups

    if mpu is not None:
        raise ConfigError([Problem("mpu", type(mpu).__name__, "mpu must be None with pipeline parallelism: the "
                                   "PipelineModule's topology defines the groups")])  # fmt: skip
    config = init.choose_config(args, config, config_params)
    cfg, translation = init.read_config(config)
    info = start_process_group(cfg.communication, dist_init_required=dist_init_required,
                               distributed_port=distributed_port)  # fmt: skip
    init.setup_logging(info.rank)
    init.check_local_rank(args, info)
    init.log_translation(translation, info.rank)
    init.warn_not_executed(cfg, info.rank)
    grid = model.mpu()
    dp = grid.get_data_parallel_world_size()
    cfg, batch, resolved = resolve_auto(cfg, model=model, optimizer=optimizer if init.is_optimizer(optimizer)
                                        else None, training_data=training_data, world_size=dp)  # fmt: skip
    log_resolved(resolved, info.rank)
    decided = plan(cfg, dp, optimizer_given=optimizer is not None, pipeline=True)
    problems = list(decided.refused) + pipeline_refusals(cfg, model)
    if partitioned_parameters(model):
        problems.append(Problem("model", type(model).__name__, "a PipelineModule built under deepspeed.zero.Init: "
                                "its parameters are partitioned for ZeRO-3, which the pipeline engine does not run "
                                "(nor does DeepSpeed's); build it outside zero.Init"))  # fmt: skip
    if problems:
        raise ConfigError(problems, source=translation.source if translation is not None else None)

    name_of = {id(p): n for n, p in model.named_parameters()}
    groups = named_groups(model_parameters, name_of, list(name_of.values()),
                          section=cfg.optimizer if optimizer is None else None,
                          by_name=dict(model.named_parameters()))  # split as the configured optimizer needs
    model.to(info.device)
    _broadcast_stage(model, grid)
    as_dict = init.config_as_dict(config)
    if _pipeline_key(as_dict, "use_reentrant") is False:  # DeepSpeed's choice of the module's checkpoint function
        model.activation_checkpoint_func = model._non_reentrant_checkpoint
    interval = cfg.pipeline.activation_checkpoint_interval
    if interval > 0:  # the config's interval overrides the module's, as DeepSpeed's engine does
        model.activation_checkpoint_interval = interval
    precision = apply_precision(model, cfg.precision, decided)
    partition = None
    if decided.data_parallel == "zero1":  # the plan's kind for a pipeline at stage 1: the partition over the replicas
        from ..zero.partition import partition_and_optimizer

        # this engine reduces the whole gradients over the stage's replicas (fp32, as DeepSpeed's bf16 optimizer)
        partition, built = partition_and_optimizer(model, decided=decided, precision=precision,
                                                   gradients=cfg.gradients, optimizer=cfg.optimizer,
                                                   client=optimizer, groups=groups, name_of=name_of,
                                                   process_group=grid.get_data_parallel_group(),
                                                   accum_dtype=torch.float32)  # fmt: skip
    else:
        step_params = precision.masters.masters if precision.masters else dict(model.named_parameters())
        built = build_step_optimizer(section=cfg.optimizer, client=optimizer, groups=groups, name_of=name_of,
                                     by_name=step_params, offload=decided.optimizer_on_cpu)  # fmt: skip
    lr_scheduler = init.build_scheduler(cfg.scheduler, lr_scheduler, built)
    shard = ShardPlan(model=model, module=model, kind="pipe", partition=partition)
    engine = PipelineEngine(config=as_dict, policy=decided.step,
                            monitor=Monitor(cfg.monitoring, info.rank), batch=batch, info=info, shard=shard,
                            precision=precision, optimizer=built, lr_scheduler=lr_scheduler, loss_scaler=None,
                            training_dataloader=None)  # fmt: skip
    engine._start(training_data=training_data, collate_fn=collate_fn, drop_last=cfg.data.drop_last)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _pipeline_key(config: dict, key: str) -> Any:
    """``pipeline.<key>`` of a DeepSpeed-shaped config dict (None when absent): ``use_reentrant`` is a
    PipelineModule detail the core model does not carry."""
    section = config.get("pipeline") if isinstance(config, dict) else None
    return section.get(key) if isinstance(section, dict) else None


@torch.no_grad()
def _broadcast_stage(model: nn.Module, grid: Any) -> None:
    """Every data-parallel replica of a stage starts from the weights of the stage's first replica."""
    if grid.get_data_parallel_world_size() == 1:
        return
    src = min(grid.get_data_parallel_group_ranks())
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=src, group=grid.get_data_parallel_group())


class _Stage(nn.Module):
    """The stage as ``torch.distributed.pipelining`` calls it: the activations arrive as separate arguments and
    go to the ``PipelineModule`` as DeepSpeed passes them (one tensor, or a tuple)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.pipe = module

    def forward(self, *args):
        return self.pipe(args[0] if len(args) == 1 else tuple(args))


class PipelineError(Exception):
    """Errors of the pipeline engine's API (``forward``/``backward``/``step`` are refused)."""


class PipelineEngine(Engine):
    """DeepSpeed's ``PipelineEngine``: ``train_batch``, ``eval_batch``, the stage queries and checkpoints."""

    pipeline_parallelism = True  # DeepSpeed's flag (``coalesce_grad_reduction`` refuses a pipeline engine)

    def _start(self, *, training_data: Any, collate_fn: Any, drop_last: bool) -> None:
        module = self.module
        grid = module.mpu()
        d = self.__dict__
        d["grid"] = grid
        d["mpu"] = grid
        d["num_stages"] = grid.get_pipe_parallel_world_size()
        d["stage_id"] = grid.get_stage_id()
        d["prev_stage"], d["next_stage"] = self.stage_id - 1, self.stage_id + 1
        d["is_pipe_parallel"] = self.num_stages > 1
        d["is_data_parallel"] = grid.get_data_parallel_world_size() > 1
        d["is_model_parallel"] = grid.get_slice_parallel_world_size() > 1
        d["micro_batch_size"] = self.train_micro_batch_size_per_gpu()
        d["micro_batches"] = self.gradient_accumulation_steps()
        d["data_iterator"] = None
        d["batch_fn"] = None
        d["total_loss"] = None
        d["agg_train_loss"] = None
        d["outputs"] = None
        d["_schedules"] = {}
        d["_stage"] = None
        d["_mode"] = "train"
        d["_micro_losses"] = []
        d["_last_output"] = None
        d["_labels"] = None
        d["_force_grad_boundary"] = False
        d["eval_return_logits"] = False
        d["_wide"] = {}  # ZeRO-1 with low-precision weights: each parameter's fp32 gradient, by id
        d["_widened"] = set()
        self._hook_masters()
        self._hook_wide_grads()
        if training_data is not None:
            self._build_data_iter(training_data, collate_fn, drop_last)
        if self.global_rank == 0:
            log.info("torsh pipeline engine: %d stages x %d data-parallel, micro_batches=%d micro_batch_size=%d",
                     self.num_stages, self.dp_world_size, self.micro_batches, self.micro_batch_size)  # fmt: skip

    def _reentrant_activation_checkpointing(self) -> bool:
        """Whether the module checkpoints activations with DeepSpeed's reentrant function (``checkpoint``, not
        ``non_reentrant_checkpoint``; read from the module, so ``set_checkpoint_interval`` is followed). DeepSpeed
        then marks the first stage's inputs as requiring grad; torsh's checkpoints recompute without reentry, so
        its stages need no such marking, and this answers DeepSpeed's question for scripts that ask it."""
        module = self.module
        if module.activation_checkpoint_interval <= 0:
            return False
        return module.activation_checkpoint_func is not module._non_reentrant_checkpoint

    # ---- the grid ---------------------------------------------------------------------------------

    @property
    def dp_world_size(self) -> int:
        return self.grid.get_data_parallel_world_size()

    @property
    def mp_world_size(self) -> int:
        return self.grid.get_model_parallel_world_size()

    @property
    def data_parallel_group(self) -> Any:
        return self.grid.get_data_parallel_group()

    def get_data_parallel_rank(self) -> int:
        return self.grid.get_data_parallel_rank()

    def get_data_parallel_world_size(self) -> int:
        return self.dp_world_size

    def get_model_parallel_rank(self) -> int:
        return self.grid.get_model_parallel_rank()

    def get_pipeline_parallel_rank(self) -> int:
        return self.stage_id

    def is_first_stage(self) -> bool:
        """True if this process is in the first stage in the pipeline."""
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        """True if this process is in the last stage in the pipeline."""
        return self.stage_id == self.num_stages - 1

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """A new global batch through the number of micro-batches (the micro-batch size stays)."""
        super().set_train_batch_size(train_batch_size)
        self.__dict__["micro_batches"] = self.gradient_accumulation_steps()

    def is_gradient_accumulation_boundary(self) -> bool:
        """True while the engine reduces gradients and steps (DeepSpeed's pipeline forces it there)."""
        return self._force_grad_boundary

    # ---- refused API ------------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        """Disabled for pipeline parallel training. See ``train_batch()``."""
        raise PipelineError(ONLY_TRAIN_BATCH)

    def backward(self, *args, **kwargs):
        """Disabled for pipeline parallel training. See ``train_batch()``."""
        raise PipelineError(ONLY_TRAIN_BATCH)

    def step(self, *args, **kwargs):
        """Disabled for pipeline parallel training. See ``train_batch()``."""
        raise PipelineError(ONLY_TRAIN_BATCH)

    # ---- data -------------------------------------------------------------------------------------

    def _build_data_iter(self, dataset: Any, collate_fn: Any, drop_last: bool) -> None:
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler

        from ..data import RepeatingLoader

        sampler = DistributedSampler(dataset, num_replicas=self.dp_world_size, rank=self.get_data_parallel_rank(),
                                     shuffle=False)  # fmt: skip
        loader = DataLoader(dataset, batch_size=self.micro_batch_size, sampler=sampler, collate_fn=collate_fn,
                            drop_last=drop_last)  # fmt: skip
        self.set_dataloader(RepeatingLoader(loader))

    def set_dataloader(self, loader: Any) -> None:
        if self.is_first_stage() or self.is_last_stage():
            self.__dict__["training_dataloader"] = loader
            self.__dict__["data_iterator"] = iter(loader)

    def set_dataiterator(self, iterator: Any) -> None:
        """The iterator ``train_batch`` reads from (first and last stages)."""
        if self.is_first_stage() or self.is_last_stage():
            self.__dict__["training_dataloader"] = None
            self.__dict__["data_iterator"] = iterator

    def set_batch_fn(self, fn) -> None:
        """A function applied to every batch read."""
        self.__dict__["batch_fn"] = fn

    def reset_activation_shape(self) -> None:
        """Forget the activation shapes (they change, e.g. a longer sequence): the stages are rebuilt."""
        self.__dict__["_schedules"] = {}
        self.__dict__["_stage"] = None

    def _read(self, count: int) -> tuple[list | None, list | None]:
        """``count`` micro-batches: the inputs (first stage) and the labels (last stage)."""
        inputs, labels = [], []
        if not (self.is_first_stage() or self.is_last_stage()):
            return None, None
        for _ in range(count):
            batch = next(self.data_iterator) if self.data_iterator is not None else None
            if self.batch_fn is not None:
                batch = self.batch_fn(batch)
            if batch is None:
                raise ValueError("train_batch() needs data: pass data_iter (an iterator of (inputs, labels)) or "
                                 "training_data to deepspeed.initialize")  # fmt: skip
            inputs.append(_to(batch[0], self.device))
            labels.append(_to(batch[1], self.device))
        return (inputs if self.is_first_stage() else None), (labels if self.is_last_stage() else None)

    # ---- the schedule -----------------------------------------------------------------------------

    def _schedule(self, micro_batches: int):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        if self._stage is None:
            self.__dict__["_stage"] = PipelineStage(_Stage(self.module), self.stage_id, self.num_stages, self.device,
                                                    group=self.grid.get_pipe_parallel_group())  # fmt: skip
        if micro_batches not in self._schedules:
            # fewer micro-batches than stages leave 1F1B no steady state: all forwards, then all backwards (GPipe),
            # which torch's Schedule1F1B does not take
            kind = Schedule1F1B if micro_batches >= self.num_stages else ScheduleGPipe
            self._schedules[micro_batches] = kind(self._stage, n_microbatches=micro_batches,
                                                  loss_fn=self._last_stage_loss, scale_grads=False)  # fmt: skip
        return self._schedules[micro_batches]

    def _last_stage_loss(self, outputs, labels):
        """What the last stage does with a micro-batch's outputs, as DeepSpeed's forward step: the loss
        (``loss_fn(outputs, labels)``, or the outputs when there is no loss_fn), kept for the report; training
        back-propagates it divided by the number of micro-batches."""
        self.__dict__["_last_output"] = outputs
        fn = self.module.loss_fn
        labels = self._labels[int(labels.reshape(-1)[0])] if self._labels is not None else None
        loss = fn(outputs, labels) if (self._mode != "eval_outputs" and fn is not None) else outputs
        self._micro_losses.append(loss.detach() if torch.is_tensor(loss) else [x.detach() for x in loss])
        if self._mode == "train":
            return loss / self.micro_batches
        return torch.zeros((), device=self.device)

    def _run(self, count: int, inputs: list | None, labels: list | None, *, train: bool) -> None:
        schedule = self._schedule(count)
        self.__dict__["_micro_losses"] = []
        args = ()
        if inputs is not None:
            args = tuple(_concat(parts) for parts in zip(*(x if isinstance(x, (tuple, list)) else (x,)
                                                             for x in inputs)))  # fmt: skip
        # The last stage's target is each micro-batch's index: the loss takes the labels as they were read (a
        # tensor, or a tuple of tensors, of any batch size)
        self.__dict__["_labels"] = labels
        kwargs = {"target": torch.arange(count, device=self.device)} if self.is_last_stage() else {}
        if train:
            schedule.step(*args, return_outputs=False, **kwargs)
        else:
            schedule.eval(*args, **kwargs)
        self.__dict__["_labels"] = None
        # the schedule's first run also calls the loss on its shape-inference forward: keep the micro-batches'
        self.__dict__["_micro_losses"] = self._micro_losses[len(self._micro_losses) - count:]

    # ---- training ---------------------------------------------------------------------------------

    def train_batch(self, data_iter=None):
        """Train on the next ``gradient_accumulation_steps`` micro-batches and step; returns the loss (the mean
        over the micro-batches, averaged over the data-parallel replicas) on every stage."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        self._check_alive("train_batch")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        started = time.time()
        inputs, labels = self._read(self.micro_batches)
        self.__dict__["_mode"] = "train"
        self._run(self.micro_batches, inputs, labels, train=True)
        self.__dict__["_force_grad_boundary"] = True
        try:
            self._fill_missing_grads()
            self._reduce_tied_grads()
            self._reduce_grads()
            self._optimizer_step()
        finally:
            self.__dict__["_force_grad_boundary"] = False
        self.micro_steps += self.micro_batches
        with torch.no_grad():
            loss = self._aggregate_loss()
        self.__dict__["agg_train_loss"] = loss
        every = self.steps_per_print()
        if every and self.global_steps % every == 0 and self.global_rank == 0:
            elapsed = time.time() - started
            log.info("steps: %d loss: %.4f iter time (s): %.3f samples/sec: %.3f", self.global_steps, loss.item(),
                     elapsed, self.train_batch_size() / max(elapsed, 1e-9))  # fmt: skip
        if self.global_rank == 0 and getattr(self.monitor, "enabled", False):
            self.monitor.write_events([("Train/Samples/train_loss", loss.item(), self.global_samples)])
        return loss

    def _aggregate_loss(self) -> torch.Tensor:
        """The micro-batches' mean loss on the last stage, averaged over its replicas, broadcast to every stage."""
        if self.is_last_stage():
            total = None
            for loss in self._micro_losses:
                total = torch.zeros_like(loss) if total is None else total
                total += loss
            mean = total / self.micro_batches
            self.__dict__["total_loss"] = total
            agg = mean.clone()
            if self.is_data_parallel:
                dist.all_reduce(agg, group=self.grid.get_data_parallel_group())
                agg /= self.dp_world_size
            out = torch.stack([mean, agg]).float()
        else:
            out = torch.zeros(2, device=self.device)
        if self.is_pipe_parallel:
            dist.broadcast(out, src=self.grid.stage_to_global(self.num_stages - 1),
                           group=self.grid.get_pipe_parallel_group())  # fmt: skip
        self.__dict__["dp_group_loss"] = out[0].clone()
        return agg if self.is_last_stage() else out[1].clone()

    def _hook_masters(self) -> None:
        """bf16 weights: each micro-batch's gradient is added to the fp32 master's at once (DeepSpeed's bf16
        optimizer accumulates in fp32 across micro-batches)."""
        masters = self._precision.masters
        if masters is None:
            return

        def move(name):
            def hook(p):
                m = masters.masters[name]
                g = p.grad.to(device=m.device, dtype=m.dtype)
                m.grad = g if m.grad is None else m.grad.add_(g)
                p.grad = None

            return hook

        for name, p in masters.params.items():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(move(name))

    def _hook_wide_grads(self) -> None:
        """ZeRO-1 with low-precision weights: each micro-batch's gradient is added to the parameter's fp32 gradient
        at once (DeepSpeed's bf16 optimizer keeps whole fp32 gradients); after the reduction the partition keeps
        its elements of them."""
        part = self._shard.partition
        if part is None or part.compute_dtype == torch.float32:
            return
        wide = self._wide

        def hook(p):
            g = wide.get(id(p))
            wide[id(p)] = p.grad.float() if g is None else g.add_(p.grad)
            p.grad = None

        for params in part.group_params:
            for p in params:
                p.register_post_accumulate_grad_hook(hook)
                self._widened.add(id(p))

    def _grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        master = getattr(p, MASTER, None)
        if master is not None:
            return master.grad
        return self._wide.get(id(p)) if id(p) in self._widened else p.grad

    def _fill_missing_grads(self) -> None:
        """A zero gradient for each trainable parameter the batch did not reach, so that every replica and every
        stage holding a tied weight reduces the same tensors (DeepSpeed steps such a parameter with a zero one)."""
        for p in self.module.parameters():
            if not p.requires_grad or self._grad_of(p) is not None:
                continue
            if id(p) in self._widened:
                self._wide[id(p)] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            else:
                target = getattr(p, MASTER, p)
                target.grad = torch.zeros_like(target)

    def _reduce_tied_grads(self) -> None:
        for weight, group in self.module.get_tied_weights_and_groups():
            grad = self._grad_of(weight)
            if grad is not None:
                dist.all_reduce(grad, group=group)

    def _reduce_grads(self) -> None:
        """Average the gradients over the stage's data-parallel replicas (one flat buffer per dtype)."""
        if not self.is_data_parallel:
            return
        grads = [g for p in self.module.parameters() if (g := self._grad_of(p)) is not None]
        for dtype in sorted({g.dtype for g in grads}, key=str):
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            dist.all_reduce(flat, group=self.grid.get_data_parallel_group())
            flat /= self.dp_world_size
            offset = 0
            for g in same:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def _grad_norm(self, params: list[torch.Tensor]) -> float:
        """The global gradient norm DeepSpeed clips with at stage 0 (ZeRO-1: :meth:`_partition_norm`). With bf16
        its optimizer takes every stage's gradients (a tied weight once); its fp32 stage-0 path (``clip_grad_norm_``
        with the pipeline as the model-parallel group) counts only model-parallel rank 0's, the first stage's."""
        tied = {id(self._grad_of(p)) for p in self.module.parameters() if getattr(p, "ds_pipe_replicated", False)}
        first_only = self.zero_optimization_stage() == 0 and self._precision.masters is None
        grads = [p.grad for p in params if p.grad is not None and id(p.grad) not in tied]
        if first_only and self.grid.get_model_parallel_rank() != 0:
            grads = []
        local = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in grads:
            local += g.detach().float().norm(2) ** 2
        dist.all_reduce(local, group=self.grid.get_model_parallel_group())
        return float(local.sqrt())

    def _norm(self, params: list[torch.Tensor]) -> float:
        part = self._shard.partition
        return self._partition_norm(part) if part is not None else self._grad_norm(params)

    def _partition_norm(self, part: Any) -> float:
        """ZeRO-1: the squares of every replica's partition gradients (a tied weight's copies on later stages not
        counted), summed over the replicas and the stages."""
        tied = [p for params in part.group_params for p in params if getattr(p, "ds_pipe_replicated", False)]
        grads = [m.grad for m in part.masters if m.grad is not None]
        return part.global_norm(grads, skip=tied, over=(self.grid.get_model_parallel_group(),))

    def _optimizer_step(self) -> None:
        if self.optimizer is None:
            raise AssertionError("must provide optimizer during init in order to use backward")
        if self._shard.partition is not None and self._widened:
            self._shard.partition.absorb_grads(self._wide)  # this replica's elements of the reduced gradients
            self._wide.clear()
        params = self._params_to_step()
        needs_norm = self._clip > 0 or self.steps_per_print()
        norm = self._norm(params) if needs_norm else None
        self._global_grad_norm = norm
        self._step_applied = False
        skip = norm is not None and not math.isfinite(norm) and self._policy.skip_step_on_nonfinite
        self.optimizer.overflow = skip
        if skip:
            self.skipped_steps += 1
        else:
            self._clip_and_step(params, norm)
        self._zero_all_grads()
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    def _zero_all_grads(self) -> None:
        super()._zero_all_grads()
        self.__dict__.get("_wide", {}).clear()

    def _clip_and_step(self, params: list[torch.Tensor], norm: float | None) -> None:
        """Clip to the global norm and step as the engine does (the bf16 weights from the masters, ZeRO-1's gather
        into every replica's parameters), then the scheduler."""
        self._apply_step(params, norm, 1.0)  # norm is None only without clipping
        if self.lr_scheduler is not None:
            try:
                self.lr_scheduler.step()
            except TypeError:
                self.lr_scheduler.step(self.train_batch_size())

    # ---- evaluation -------------------------------------------------------------------------------

    def eval_batch(self, data_iter, return_logits=False, compute_loss=True, reduce_output="avg", bcast_loss=True,
                   num_micro_batches=None):  # fmt: skip
        """Forward ``num_micro_batches`` (default: ``micro_batches``) micro-batches without gradients; returns
        the mean loss (averaged over replicas, broadcast to every stage; ``reduce_output=None``: the list of
        the micro-batches' losses, on the last stage), and with ``return_logits`` also the last micro-batch's
        outputs (on the last stage; None elsewhere)."""
        self.module.eval()
        saved = self.data_iterator
        self.set_dataiterator(data_iter)
        count = self.micro_batches if num_micro_batches is None else num_micro_batches
        try:
            inputs, labels = self._read(count)
            self.__dict__["_mode"] = "eval" if compute_loss else "eval_outputs"
            dist.barrier()
            with torch.no_grad():
                self._run(count, inputs, labels, train=False)
        finally:
            self.__dict__["_mode"] = "train"
            self.set_dataiterator(saved)
        output = self._eval_output(reduce_output, count, broadcast=compute_loss and bcast_loss)
        logits = self._last_output if return_logits and self.is_last_stage() else None
        self.__dict__["_last_output"] = None
        return (output, logits) if return_logits else output

    def _eval_output(self, reduce_output: str | None, count: int, *, broadcast: bool) -> Any:
        """The reduced evaluation losses (on the last stage, or broadcast to every stage), logged to the monitor."""
        output = self._reduce_outputs(self._micro_losses, reduce_output, count) if self.is_last_stage() else None
        if broadcast:
            output = self._bcast_pipe_scalar(output)
        if self.global_rank == 0 and getattr(self.monitor, "enabled", False) and torch.is_tensor(output):
            self.monitor.write_events([("Train/Samples/eval_loss", output.mean().item(), self.global_samples)])
        return output

    def _reduce_outputs(self, outputs: list, reduce: str | None, count: int):
        if reduce is None:
            return outputs
        if reduce.lower() != "avg":
            raise NotImplementedError(f"reduction type {reduce} not supported.")
        if torch.is_tensor(outputs[0]):
            reduced = sum(outputs) / count
            if self.is_data_parallel:
                dist.all_reduce(reduced, group=self.grid.get_data_parallel_group())
                reduced /= self.dp_world_size
            return reduced
        reduced = [sum(parts) / count for parts in zip(*outputs)]
        if self.is_data_parallel:
            for r in reduced:
                dist.all_reduce(r, group=self.grid.get_data_parallel_group())
                r /= self.dp_world_size
        return reduced

    def _bcast_pipe_scalar(self, data, dtype=torch.float32) -> torch.Tensor:
        src = self.grid.stage_to_global(self.num_stages - 1)
        if self.global_rank == src:
            result = data.clone().detach().to(dtype=dtype, device=self.device)
        else:
            result = torch.zeros(1, dtype=dtype, device=self.device)
        if self.is_pipe_parallel:
            dist.broadcast(result, src=src, group=self.grid.get_pipe_parallel_group())
        return result

    # ---- checkpoints ------------------------------------------------------------------------------

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 (DeepSpeed's)
                        exclude_frozen_parameters=False) -> bool:  # fmt: skip
        """DeepSpeed's pipeline layout under ``save_dir/<tag>/``: ``layer_NN-model_states.pt`` per layer,
        ``mp_rank_SS_model_states.pt`` per stage (counters, scheduler, client state; the optimizer state without
        ZeRO) and, with ZeRO-1, ``zero_pp_rank_D_mp_rank_SS_optim_states.pt`` per rank; ``latest`` names the tag."""
        from .checkpoint import save

        return save(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):  # fmt: skip
        """Load what :meth:`save_checkpoint` wrote (the same pipeline and data-parallel degrees); returns
        ``(load_path, client_state)``, ``(None, None)`` when there is no checkpoint."""
        from .checkpoint import load

        if custom_load_fn is not None:
            raise NotImplementedError("load_checkpoint(custom_load_fn=...) is not supported by the torsh engine")
        return load(self, load_dir, tag, load_module_strict, load_optimizer_states, load_lr_scheduler_states,
                    load_module_only)  # fmt: skip

    def module_state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False):  # fmt: skip
        """This stage's module state (DeepSpeed saves a pipeline by layer: see ``save_checkpoint``)."""
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)


def _to(item: Any, device: torch.device) -> Any:
    if torch.is_tensor(item):
        return item.to(device)
    if isinstance(item, (tuple, list)):
        return tuple(_to(x, device) for x in item)
    return item


def _concat(parts) -> torch.Tensor:
    """Micro-batches stacked along the batch dimension, for the schedule to split again; they must be equal."""
    parts = list(parts)
    sizes = {p.shape[0] if p.dim() else 0 for p in parts}
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(f"the pipeline's micro-batches must have one batch size (got {sorted(sizes)}): use "
                         "dataloader_drop_last or a data iterator of equal batches")  # fmt: skip
    return torch.cat(parts)
