"""What a config means at run time, in words: batch math, the precision contract, loss scaling, the engine plan
(:mod:`torsh.plan`'s decisions, as ``torsh.initialize`` runs them).

Pure functions of the core model (no torch): ``torsh-migrate explain`` prints them for a config of any dialect,
and the engine shows the same contract when it starts, so what a user reads before a run is what runs.

The precision contract is the table users rebuilt by hand when a DeepSpeed job was ported to FSDP and stopped
converging: the dtype of every tensor class, from model load to checkpoint. DeepSpeed keeps fp32 master
weights and optimizer state, reduces in the compute dtype and accumulates gradients in it unless told
otherwise; a port that silently changes any one of these cells changes the training.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import BatchConfig, CheckpointConfig, OffloadConfig, PrecisionConfig, ShardingConfig, TorshConfig
from .deferred import Deferred
from .errors import ConfigError

AUTO_TEXT = "auto (chosen at start-up)"


@dataclass(frozen=True)
class ContractRow:
    """One tensor class of the precision contract."""

    tensor: str
    """What is held (model load, parameters in compute, master weights, ...)."""
    dtype: str
    """Its dtype (fp32 / bf16 / fp16), or a short phrase when it depends on the script."""
    detail: str
    """Where it lives and why, in a sentence."""


def _dtype(value: object) -> str:
    return AUTO_TEXT if isinstance(value, Deferred) else str(value)


def precision_contract(precision: PrecisionConfig, sharding: ShardingConfig, offload: OffloadConfig,
                       checkpoint: CheckpointConfig, reduce_op: str = "mean") -> list[ContractRow]:  # fmt: skip
    """The dtype of every tensor class in training, in the order a step touches them."""
    p = precision
    param = _dtype(p.param_dtype)
    low = p.param_dtype != "fp32"
    where_master = "sharded across data-parallel ranks" if sharding.stage >= 1 else "replicated on every rank"
    if offload.optimizer != "none":
        where_master += f", offloaded to {offload.optimizer}"
    if p.autocast:
        compute = ContractRow("parameters in compute", "fp32",
                              f"parameters stay fp32; forward runs under torch.autocast({param}), which keeps "
                              "some ops in fp32")  # fmt: skip
        load = ContractRow("model load", "as built (fp32 expected)", "no cast: autocast works on fp32 parameters")
    else:
        compute = ContractRow("parameters in compute", param,
                              "parameters are cast to it (the whole forward and backward run in it)" if low
                              else "full precision")  # fmt: skip
        load = ContractRow("model load", "as built by the script",
                           f"cast to {param} for compute; the {_dtype(p.master_dtype)} master copy is made from "
                           "the loaded values (loading in bf16 loses the low bits before training starts)"
                           if low else "used as is (load in fp32 for an fp32 run)")  # fmt: skip
    reduce_detail = {"mean": "averaged", "sum": "summed", "adasum": "combined with Adasum"}[reduce_op]
    return [
        load,
        compute,
        ContractRow("master weights", _dtype(p.master_dtype), f"the copy the optimizer updates; {where_master}"),
        ContractRow("gradient reduction", _dtype(p.effective_reduce_dtype),
                    f"gradients are {reduce_detail} across ranks in this dtype"
                    + ("" if p.reduce_dtype is not None else " (follows the compute dtype)")),  # fmt: skip
        ContractRow("gradient accumulation", _dtype(p.effective_grad_accum_dtype),
                    "micro-batch gradients are summed in this dtype until the optimizer step"
                    + ("" if p.grad_accum_dtype is not None else " (follows the compute dtype)")),  # fmt: skip
        ContractRow("optimizer state", _dtype(p.optimizer_state_dtype),
                    "Adam moments; " + ("on " + offload.optimizer if offload.optimizer != "none" else where_master)),
        ContractRow("buffers", _dtype(p.buffer_dtype) if p.buffer_dtype else "as loaded",
                    "cast to this dtype" if p.buffer_dtype else "not cast with the parameters (e.g. RoPE inv_freq "
                    "keeps its precision)"),  # fmt: skip
        ContractRow("checkpoint", f"weights {'fp32' if p.autocast else param}, master {_dtype(p.master_dtype)}",
                    "model weights are saved as held (in the compute dtype unless autocast), master weights and "
                    "optimizer state "
                    f"({_dtype(p.optimizer_state_dtype)}) in the optimizer state"
                    + ("; consolidated 16-bit weights are also saved" if checkpoint.save_full_weights else "")),
    ]


def loss_scaling_rule(precision: PrecisionConfig) -> str:
    """How the loss is scaled and when a step is skipped, in one paragraph."""
    ls = precision.loss_scaling
    skip = ("steps with a non-finite gradient norm skip the optimizer and LR-scheduler step"
            if precision.skip_step_on_nonfinite else "steps are never skipped")  # fmt: skip
    if ls.mode == "none":
        return f"No loss scaling; {skip}."
    if ls.mode == "static":
        return f"Static loss scale {ls.static_scale:g}; {skip}."
    start = f"{ls.initial_scale:g}"
    if ls.semantics == "torch_grad_scaler":
        rule = (f"torch GradScaler rules: start at {start}, multiply by {ls.backoff_factor:g} on every overflow "
                f"(no floor), by {ls.growth_factor:g} after exactly {ls.growth_interval} clean steps")
    elif ls.semantics == "deepspeed_stage0":
        rule = (f"DeepSpeed stage-0 rules: start at {start}, halve on every overflow (hysteresis is ignored) down "
                f"to {ls.min_scale:g}, double after {ls.growth_interval + 1} clean steps and then every "
                f"{ls.growth_interval}")  # fmt: skip
    else:
        rule = (f"DeepSpeed ZeRO rules: start at {start}; an overflow halves the scale only after {ls.hysteresis} "
                f"overflow(s) (hysteresis{', refilled by every clean step' if ls.consecutive_hysteresis else ''}); "
                f"the floor is {ls.min_scale:g} and an overflow at the floor is an error; double after "
                f"{ls.growth_interval + 1} clean steps and then every {ls.growth_interval}")  # fmt: skip
    return f"Dynamic loss scaling, {rule}; {skip}."


def engine_plan(cfg: TorshConfig, world_size: int | None = None) -> list[str]:
    """What ``torsh.initialize`` builds for this config, in build order: :func:`torsh.plan.plan`'s steps
    (``world_size`` None: the config's own, else 1)."""
    from .plan import plan

    return list(plan(cfg, _world_size(cfg, world_size)).steps)


def batch_math(batch: BatchConfig, world_size: int) -> str:
    """The resolved batch sizes for ``world_size`` data-parallel ranks, or why they cannot be resolved yet."""
    deferred = [k for k, v in batch if isinstance(v, Deferred)]
    if deferred:
        return f"not resolved yet: {', '.join(deferred)} are \"auto\" (torsh.initialize fills them from the " \
               "dataloader and the world size)"
    try:
        r = batch.resolve(world_size)
    except ConfigError as exc:
        return f"cannot resolve for {world_size} rank(s): " + "; ".join(p.reason for p in exc.problems)
    return (f"global batch {r.global_batch_size} = micro batch {r.micro_batch_size} x gradient accumulation "
            f"{r.gradient_accumulation_steps} x {r.world_size} data-parallel rank(s)")


def config_world_size(cfg: TorshConfig) -> tuple[int, str] | None:
    """The number of processes the config itself states, and from where; None when it does not say.

    The launch section (Accelerate's num_processes, torchrun's nnodes x nproc_per_node, a hostfile's slots), else
    DeepSpeed's batch triple (train_batch_size = micro batch x accumulation x data-parallel ranks).
    """
    launch = cfg.launch
    if isinstance(launch.world_size, int):
        return launch.world_size, "the config's process count"
    per_node = launch.nproc_per_node
    if isinstance(per_node, int) and not isinstance(per_node, bool):
        nodes = launch.nnodes if isinstance(launch.nnodes, int) else 1
        return nodes * per_node, f"{nodes} node(s) x {per_node} process(es)"
    b = cfg.batch
    sizes = (b.global_batch_size, b.micro_batch_size, b.gradient_accumulation_steps)
    if all(isinstance(v, int) for v in sizes) and sizes[0] % (sizes[1] * sizes[2]) == 0:
        # the batch counts data-parallel ranks: each is tp x pp x cp x sp processes (DeepSpeed's batch rule)
        par = cfg.parallelism
        model = par.tp * par.cp * par.sp * (par.pp if isinstance(par.pp, int) else 1)
        ranks = sizes[0] // (sizes[1] * sizes[2])
        return ranks * model, (f"global batch {sizes[0]} / (micro batch {sizes[1]} x accumulation {sizes[2]})"
                               + (f" x {model} model-parallel ranks each" if model > 1 else ""))  # fmt: skip
    return None


def launch_world_size(cfg: TorshConfig) -> int | None:
    """The number of processes the launch section states (not the batch: it counts data-parallel ranks)."""
    stated = config_world_size(cfg)
    return stated[0] if stated is not None and not stated[1].startswith("global batch") else None


def _world_size(cfg: TorshConfig, world_size: int | None) -> int:
    if world_size is not None:
        return world_size
    stated = config_world_size(cfg)
    return stated[0] if stated else 1


def explain(cfg: TorshConfig, world_size: int | None = None) -> dict:
    """Everything ``torsh-migrate explain`` prints, as data; ``world_size`` None: the config's own, else 1."""
    from .plan import plan

    world_size = _world_size(cfg, world_size)
    decided = plan(cfg, world_size)  # an optimizer assumed passed to initialize
    laid = decided.degrees
    dp = laid.dp if laid is not None else world_size  # the batch is split over the data-parallel ranks only
    return {
        "world_size": world_size,
        "data_parallel_size": dp,
        "mesh": dict(laid.dims) if laid is not None else None,
        "batch": batch_math(cfg.batch, dp),
        "precision_contract": precision_contract(cfg.precision, cfg.sharding, cfg.offload, cfg.checkpoint,
                                                 cfg.gradients.reduce_op),
        "loss_scaling": loss_scaling_rule(cfg.precision),
        "engine": list(decided.steps),
        "deferred": cfg.deferred_paths(),
        # what torsh.initialize would refuse before touching the model
        "refused": [str(p) for p in decided.refused],
    }
