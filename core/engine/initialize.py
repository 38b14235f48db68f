"""``torsh.initialize``: ``deepspeed.initialize``'s signature and return values, any dialect's config, native PyTorch.

Reads top to bottom: load the config, start the process group, resolve batch and "auto", decide the plan
(:func:`torsh.plan.plan`, which raises every refusal before the model is touched), then the plan's ``apply_*``
steps in order, then the engine, which gets the plan's step policy.
"""

from __future__ import annotations

import argparse
import functools
import logging

import torch

from torsh.config import CompressionConfig, DataConfig, OptimizerConfig, TorshConfig
from torsh.errors import ConfigError, Problem
from torsh.plan import EnginePlan, plan
from torsh.sharding_plan import ShardingPlan

from .activations import apply_activation_checkpointing
from .auto import log_resolved, resolve_auto
from .config_io import (  # noqa: F401  (load_config, choose_config, read_config: torsh.engine.initialize's API)
    build_loss_scaler,
    build_scheduler,
    check_local_rank,
    choose_config,
    config_as_dict,
    is_optimizer,
    load_config,
    log_translation,
    read_config,
    setup_logging,
    warn_not_executed,
)
from .data import build_dataloader
from .distributed import init_distributed as start_process_group
from .engine import Engine
from .monitor import Monitor
from .optim import build_step_optimizer, named_groups
from .parallel.moe import moe_layers, prepare_experts
from .parallel.moe_zero import build_expert_zero
from .parallel.mpu import engine_members as mpu_members
from .parallel.mpu import read_mpu, refuse_with
from .parallel.context import build_context_groups
from .parallel.sequence import build_sequence_groups, degree_with_mpu, is_sequence_mpu
from .parallel.tensor_parallel import apply_tensor_parallel
from .precision import apply_precision
from .zero.construction import materialize
from .zero.ds_layout import attach_views
from .zero.nvme import attach_nvme
from .zero.partition import build_zero
from .zero.sharding import apply_sharding, sync_module_states

log = logging.getLogger("torsh.engine")


def initialize(args=None, model: torch.nn.Module | None = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port: int = 29500, mpu=None,
               dist_init_required: bool | None = None, collate_fn=None, config=None, mesh_param=None,
               config_params=None):  # fmt: skip
    """Build a training engine; returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    The same parameters, positional order and return rules as ``deepspeed.initialize`` (DeepSpeed 0.19.8).
    ``config`` (or ``config_params``, or ``args.deepspeed_config``) is a DeepSpeed dict or path, a file of any
    registered dialect, or a :class:`TorshConfig`. ``optimizer`` may be an optimizer built on the model (it
    is rebuilt over the sharded parameters) or a callable of the parameters; ``lr_scheduler`` a scheduler
    (re-pointed at the rebuilt optimizer) or a callable of the optimizer. The optimizer is None when there
    is none to build; the dataloader when no ``training_data``; the scheduler when neither is given or there
    is no optimizer.
    """
    if model is None:
        raise ConfigError([Problem("model", None, "initialize needs a model")])
    from .pipeline.engine import initialize_pipeline, is_pipeline_module

    if is_pipeline_module(model):  # a deepspeed.pipe.PipelineModule: the pipeline engine
        return initialize_pipeline(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                   training_data=training_data, lr_scheduler=lr_scheduler,
                                   distributed_port=distributed_port, mpu=mpu, dist_init_required=dist_init_required,
                                   collate_fn=collate_fn, config=config, config_params=config_params)  # fmt: skip
    _refuse_mesh_objects(mesh_param)
    config = choose_config(args, config, config_params)
    cfg, translation = read_config(config)
    cfg = _with_tp_model_init(cfg, model)
    info = start_process_group(cfg.communication, dist_init_required=dist_init_required,
                               distributed_port=distributed_port)  # fmt: skip
    setup_logging(info.rank)
    check_local_rank(args, info)
    log_translation(translation, info.rank)
    warn_not_executed(cfg, info.rank)
    mp = read_mpu(mpu, info.world_size) if mpu is not None and not is_sequence_mpu(mpu) else None  # Megatron's
    if mp is not None:  # its groups, not the config's own tp / pp / sp degrees (refused before they are laid out),
        # nor ZeRO-3 with a model axis, nor MoE layers (refused before prepare_experts gives them expert groups)
        refuse_with(mp, stage=cfg.sharding.stage, experts=bool(moe_layers(model)),
                    model_degrees=info.world_size // _data_parallel_size(cfg, info.world_size))  # fmt: skip
    if is_sequence_mpu(mpu):  # DeepSpeed's parallel_state_sp gives the sequence-parallel degree
        cfg = cfg.resolve_deferred({"parallelism.sp": degree_with_mpu(cfg.parallelism.sp, mpu)})

    # "auto" needs the world size, the model, the passed optimizer and the data; the batch is split over the
    # data-parallel ranks, what tensor / pipeline / context parallelism (or an mpu's model axis) leave of the world.
    dp_world = mp.dp if mp is not None else _data_parallel_size(cfg, info.world_size)
    cfg, batch, resolved = resolve_auto(cfg, model=model, optimizer=optimizer if is_optimizer(optimizer) else None,
                                        training_data=training_data, world_size=dp_world)  # fmt: skip
    log_resolved(resolved, info.rank)
    # Every decision, and every refusal raised now, before the model is cast, wrapped or sharded: a refused
    # config leaves it as it was. `torsh-migrate explain` prints this same plan.
    decided = plan(cfg, dp_world if mp is not None else info.world_size, optimizer_given=optimizer is not None)
    decided.check()
    _log_ddp_buckets(decided.sharding, info.rank)
    # Parameters deepspeed.zero.Init partitioned while the model was built: FSDP2 takes them shard by shard
    # (apply_sharding); the layouts that keep whole parameters gather each whole now, one at a time.
    if not (decided.fsdp and decided.tp == 1):
        materialize(model)

    # Names are the identity that survives casting and sharding (fully_shard replaces the parameters).
    name_of = {id(p): n for n, p in model.named_parameters()}
    # MoE layers get their expert groups now (collective), before the broadcast and DDP, which leave local experts
    experts = prepare_experts(model, stage=decided.sharding.stage, dp_world_size=dp_world,
                              kind="fsdp" if decided.fsdp else ("tp" if decided.tp > 1 else "ddp"))  # fmt: skip
    # Ulysses' sequence-parallel and sequence-data-parallel groups (collective), or those of a parallel_state_sp mpu
    sequence = build_sequence_groups(cfg.parallelism.sp, mpu=mpu,
                                     experts=experts is not None and experts.active)  # fmt: skip
    # the context-parallel groups (collective): the ranks that share each sequence, and the batch shards' ranks
    context = build_context_groups(decided.degrees, experts=experts is not None and experts.active, mpu=mpu)
    if experts is not None and optimizer is None:  # DeepSpeed's MoE parameter groups for the optimizer it builds
        model_parameters = experts.param_groups(model_parameters)
    groups = named_groups(model_parameters, name_of, list(name_of.values()),
                          section=cfg.optimizer if optimizer is None else None,
                          by_name=dict(model.named_parameters()))  # split as the configured optimizer needs

    # The apply_* steps, in the plan's order, each given the plan and its own section(s): every rank starts from
    # rank 0's weights; checkpointing wraps the blocks before sharding sees them; precision before sharding, so
    # that FSDP2 shards fp32 master weights; tensor parallelism before FSDP2, which shards over the data-parallel
    # sub-mesh it leaves; the optimizer after sharding, so that it holds the tensors the step updates.
    sync_module_states(model, info.device, cfg.sharding, skip=mp.start_up(model) if mp is not None else experts)
    apply_activation_checkpointing(model, cfg.activation_checkpointing, cfg.sharding.wrap)
    precision = apply_precision(model, cfg.precision, decided)
    if mp is not None:
        mp.attach(model)  # the parameters (and fp32 masters) the norm counts on model-parallel rank 0 only
    dp_group = mp.dp_group if mp is not None else None  # DDP's, ZeRO-1/2's and compression's group (None: world)
    _warn_section_not_built(cfg.optimizer, optimizer, info.rank)
    if decided.data_parallel in ("zero1", "zero2"):
        # ZeRO-1/2: the optimizer's groups decide the partition, and the optimizer steps its flat fp32 masters
        # (stage 1 keeps DDP for the whole-gradient reduction, and with it DDP's compression hook)
        build = functools.partial(build_expert_zero, plan=experts) if experts is not None and experts.active \
            else functools.partial(build_zero, process_group=dp_group)  # local experts: their expert-dp groups
        shard, optimizer = build(model, decided=decided, precision=precision, info=info,
                                 gradients=cfg.gradients, optimizer=cfg.optimizer, client=optimizer,
                                 groups=groups, name_of=name_of)  # fmt: skip
        compression_state = apply_compression(shard, cfg.compression, decided, dp_group)
    else:
        mesh = apply_tensor_parallel(model, cfg.parallelism, decided.degrees, info) if decided.tp > 1 else None
        shard = apply_sharding(model, decided, precision, info, gradients=cfg.gradients, offload=cfg.offload,
                               mesh=mesh, process_group=dp_group)  # fmt: skip
        compression_state = apply_compression(shard, cfg.compression, decided, dp_group)
        # the fp32 masters at stage 0 with low-precision compute, else the (sharded) parameters
        step_params = precision.masters.masters if precision.masters else dict(model.named_parameters())
        optimizer = build_step_optimizer(section=cfg.optimizer, client=optimizer, groups=groups, name_of=name_of,
                                         by_name=step_params, offload=decided.optimizer_on_cpu)  # fmt: skip
    # NVMe offload: the optimizer's per-element state in files (before the scheduler wraps its step)
    optimizer = attach_nvme(optimizer, cfg.offload, stage=cfg.sharding.stage, rank=info.rank)
    lr_scheduler = build_scheduler(cfg.scheduler, lr_scheduler, optimizer)
    loss_scaler = build_loss_scaler(cfg.precision.loss_scaling)
    degrees = mp if mp is not None else decided.degrees  # an mpu answers the engine's rank and size queries
    dataloader = _dataloader(training_data, cfg.data, degrees, info, batch, dp_world, collate_fn)
    engine = Engine(config=config_as_dict(config), policy=decided.step, monitor=Monitor(cfg.monitoring, info.rank),
                    batch=batch, info=info, shard=shard, precision=precision,
                    optimizer=optimizer, lr_scheduler=lr_scheduler, loss_scaler=loss_scaler,
                    training_dataloader=dataloader, degrees=degrees)  # fmt: skip
    engine.__dict__.update(mpu_members(mp))  # DeepSpeed's engine.mpu; the mpu's groups
    if sequence is not None:
        engine.__dict__.update(sequence.engine_members())  # DeepSpeed's seq_parallel_group, sequence_parallel_size...
    if context is not None:  # engine.context_parallel(...); data_parallel_group: the ranks of the batch shards
        engine.__dict__.update(_context_groups=context, _dp_group=context.replicas)
    engine.__dict__["_experts"] = experts if experts is not None and experts.active else None
    if experts is not None:
        engine.__dict__.update(experts.engine_members())  # DeepSpeed's has_moe_layers, num_experts, moe_layers...
    engine.compression_state = compression_state  # byte counts of the compressed reduction (None: dense)
    if decided.step.stage == 3 and shard.kind == "fsdp" and engine.optimizer is not None:
        attach_views(engine.optimizer, engine)  # DeepSpeed's ZeRO-3 gradient partitions, read by its tests
    if info.rank == 0:
        log.info("torsh engine: stage %d (%s), %s compute, world size %d, batch %d = %d x %d x %d",
                 cfg.sharding.stage, shard.kind, cfg.precision.param_dtype, info.world_size,
                 batch.global_batch_size, batch.micro_batch_size, batch.gradient_accumulation_steps,
                 dp_world)  # fmt: skip
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _log_ddp_buckets(layout: ShardingPlan, rank: int) -> None:
    """DDP's bucket from DeepSpeed's ``reduce_bucket_size`` (stages 0/1 of a job sized as DeepSpeed sizes it)."""
    if rank == 0 and layout.stage <= 1 and layout.buckets is not None:
        log.info("DDP gradient buckets of %.1f MiB: %s", layout.ddp.bucket_cap_mb, layout.ddp_bucket_why)


def _refuse_mesh_objects(mesh_param) -> None:
    if mesh_param is not None:
        raise ConfigError([Problem("mesh_param", type(mesh_param).__name__,
                                   "a mesh object is not read by the torsh engine: give the parallel degrees in "
                                   "the config (parallelism.tp, parallelism.pp) and the engine builds the mesh, "
                                   "or pass a Megatron-style mpu")])  # fmt: skip


def _warn_section_not_built(section: OptimizerConfig | None, optimizer, rank: int) -> None:
    if optimizer is not None and section is not None and section.name and rank == 0:
        log.warning("optimizer.name=%s is not built: the optimizer passed to initialize is used (as DeepSpeed "
                    "does); its \"auto\" values were filled from it", section.name)  # fmt: skip


def _dataloader(training_data, data: DataConfig, degrees, info, batch, dp_world: int, collate_fn):
    """The dataloader over ``training_data`` for this rank's data-parallel share (None: no training data)."""
    if training_data is None:
        return None
    dp_rank = degrees.dp_rank(info.rank) if degrees is not None else info.rank
    return build_dataloader(training_data, micro_batch_size=batch.micro_batch_size, data=data,
                            rank=dp_rank, world_size=dp_world, collate_fn=collate_fn)  # fmt: skip


def _with_tp_model_init(cfg: TorshConfig, model: torch.nn.Module) -> TorshConfig:
    """The tensor-parallel degree ``deepspeed.tp_model_init`` recorded on the model: the config is canonical, a
    missing degree is filled from it, a different one is an error (DeepSpeed's merge rules)."""
    recorded = getattr(model, "_torsh_tp_model_init", None)
    if recorded is None or recorded == cfg.parallelism.tp:
        return cfg
    if cfg.parallelism.tp != 1:
        raise ConfigError([Problem("tensor_parallel.autotp_size", cfg.parallelism.tp, f"tp_model_init recorded "
                                   f"tp_size={recorded}: give the same degree in both, or drop one")])  # fmt: skip
    return cfg.resolve_deferred({"parallelism.tp": recorded})


def _data_parallel_size(cfg: TorshConfig, world_size: int) -> int:
    """The ranks the batch is split over: the world size / (tp x pp x cp x sp) (the world itself when they do not
    divide it, which the plan refuses)."""
    from torsh.plan import pipeline_degree

    model = cfg.parallelism.tp * pipeline_degree(cfg) * cfg.parallelism.cp * cfg.parallelism.sp  # Ulysses' peers
    return world_size // model if world_size % model == 0 else world_size


def apply_compression(shard, compression: CompressionConfig, decided: EnginePlan,
                      process_group=None) -> object | None:  # fmt: skip
    """Gradient compression on the data-parallel reduction: a DDP comm hook (stages 0/1). Under FSDP2 a fp16/bf16
    "compression" is the reduce dtype ``apply_precision`` set; the plan refused the other methods there."""
    if decided.compression != "comm_hook":
        return None
    from .compression import apply_compression as register_hook

    return register_hook(shard.model, compression, process_group=process_group)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's ``--deepspeed``, ``--deepspeed_config`` (and deprecated ``--deepscale*``) options."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="a flag for the script's own use (the engine does not read it)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="the config file (DeepSpeed JSON or any dialect torsh reads)")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout=None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1,
                     world_size: int = -1) -> None:  # fmt: skip
    """``deepspeed.init_distributed``: start the default process group unless one exists (gloo on CPU)."""
    from torsh.config import CommunicationConfig

    comm = CommunicationConfig(backend=dist_backend or "auto", init_method=init_method,
                               timeout_s=timeout.total_seconds() if timeout is not None else None)  # fmt: skip
    start_process_group(comm, dist_init_required=dist_init_required, distributed_port=distributed_port)
