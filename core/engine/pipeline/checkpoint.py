"""Checkpoints of the pipeline engine, in DeepSpeed's pipeline layout::

    save_dir/latest                                   the tag (rank 0, after every rank has written)
    save_dir/<tag>/layer_NN-model_states.pt           one layer's state_dict (the stage's first replica writes)
    save_dir/<tag>/mp_rank_SS_model_states.pt         per stage: counters, scheduler, client state; the
                                                      optimizer state (fp32 without ZeRO: DeepSpeed's form)
    save_dir/<tag>/zero_pp_rank_D_mp_rank_SS_optim_states.pt   ZeRO-1: each rank's optimizer partition

A checkpoint resumes on the same pipeline and data-parallel degrees. At fp32 without ZeRO the files are
DeepSpeed's, so each engine loads the other's checkpoint. Under ZeRO-1 the stage file holds the whole state too
(the partition's whole view: per-parameter optimizer state over the fp32 masters, what stage 0 with master
weights writes), which is what a load reads, so a checkpoint moves between stage 0 and ZeRO-1 (and partition
layouts) exactly; each rank's file holds its partition (``optimizer.state_dict()``), as DeepSpeed's layout has it.
ZeRO-1 checkpoints written when it was torch's ``ZeroRedundancyOptimizer`` (no whole state in the stage file;
each rank's file its torch per-rank state and the fp32 masters) still load on the same degrees. Between the
engines at ZeRO-1 the weights move (``load_optimizer_states=False``), not the optimizer partitions: DeepSpeed's
are a CheckpointError here, and DeepSpeed refuses torsh's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint.ds_model_states import model_states_file
from ..checkpoint.state import RANK_STATE
from ..zero.partition import ZERO_SLOT


def _model_file(engine: Any, root: Path) -> Path:
    return root / model_states_file(engine.grid.get_model_parallel_rank())


def _optim_file(engine: Any, root: Path) -> Path:
    return root / (f"zero_pp_rank_{engine.get_data_parallel_rank()}_mp_rank_"
                   f"{engine.grid.get_model_parallel_rank():02d}_optim_states.pt")  # fmt: skip


def _zero(engine: Any) -> bool:
    return engine._shard.partition is not None


def _optimizer_state(engine: Any) -> dict | None:
    """The optimizer's state and, with bf16 weights, the fp32 masters it steps; under ZeRO-1 the partition's
    whole view (collective over the stage's replicas), as stage 0 with master weights has them."""
    if engine.optimizer is None:
        return None
    part = engine._shard.partition
    if part is not None:
        with part.full_view(engine.module, engine.optimizer, load=False) as (module, view):
            return {"optimizer": view.state_dict(),
                    "fp32_masters": {n: m.detach().clone() for n, m in module.named_parameters()}}  # fmt: skip
    state = {"optimizer": engine.optimizer.state_dict()}
    masters = engine._precision.masters
    if masters is not None:
        state["fp32_masters"] = {n: m.detach().clone() for n, m in masters.masters.items()}
    return state


def _plain(engine: Any) -> bool:
    """fp32 without ZeRO: the optimizer state goes into the stage file as DeepSpeed puts it there (the torch
    optimizer's ``state_dict``), so that either engine loads the other's checkpoint."""
    return not _zero(engine) and engine._precision.masters is None


def save(engine: Any, save_dir, tag, client_state: dict, save_latest: bool, exclude_frozen: bool) -> bool:
    if not save_dir:
        raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    root = Path(save_dir) / tag
    root.mkdir(parents=True, exist_ok=True)
    engine.module.save_state_dict(str(root), exclude_frozen_params=exclude_frozen)
    first_replica = engine.get_data_parallel_rank() == 0
    optim = _optimizer_state(engine)
    if first_replica:
        _atomic_save(_stage_state(engine, optim, client_state), _model_file(engine, root))
    if _zero(engine) and optim is not None:
        partition = {"optimizer": engine.optimizer.state_dict(),
                     "fp32_partition": [m.detach().clone() for m in engine._shard.partition.masters]}  # fmt: skip
        _atomic_save({"optimizer_state_dict": partition, "ds_version": "0.19.8+torsh"}, _optim_file(engine, root))
    dist.barrier()
    if save_latest and engine.global_rank == 0:
        tmp = Path(save_dir) / ".latest.tmp"
        tmp.write_text(tag)
        os.replace(tmp, Path(save_dir) / "latest")
    dist.barrier()
    return True


def _stage_state(engine: Any, optim: dict | None, client_state: dict) -> dict[str, Any]:
    """A stage file's contents: the counters and degrees, the scheduler, the optimizer state (as DeepSpeed's
    ``optimizer`` entry when plain, else as ``torsh_optimizer`` with the fp32 masters), and the client state."""
    plain = _plain(engine)
    return {"module": None, "global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps,
            "dp_world_size": engine.dp_world_size, "mp_world_size": engine.mp_world_size,
            "num_stages": engine.num_stages,
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "optimizer": optim["optimizer"] if (optim is not None and plain) else None,
            "torsh_optimizer": optim if not plain else None,
            "ds_version": "0.19.8+torsh", **dict(client_state or {})}  # fmt: skip


def load(engine: Any, load_dir, tag, strict: bool, load_optimizer: bool, load_scheduler: bool,
         module_only: bool):  # fmt: skip
    if tag is None:
        latest = Path(load_dir) / "latest"
        if not latest.is_file():
            return None, None
        tag = latest.read_text().strip()
    root = Path(load_dir) / str(tag)
    state = _read_stage_file(engine, root)
    engine.module.load_state_dir(str(root), strict=strict)
    masters = engine._precision.masters
    if masters is not None:
        masters.params_to_master()
    if engine._shard.partition is not None:
        engine._shard.partition.params_to_master()
    if not module_only:
        _load_training_state(engine, root, state, load_optimizer, load_scheduler)
    engine.loaded_checkpoint_dp_world_size = state["dp_world_size"]
    own = {"module", "global_steps", "global_samples", "micro_steps", "skipped_steps", "dp_world_size",
           "mp_world_size", "num_stages", "lr_scheduler", "optimizer", "torsh_optimizer", *DEEPSPEED_OWN}
    return str(root), {k: v for k, v in state.items() if k not in own}


def _load_training_state(engine: Any, root: Path, state: dict[str, Any], load_optimizer: bool,
                         load_scheduler: bool) -> None:  # fmt: skip
    """What a load beyond the module restores: optimizer, scheduler, counters."""
    if load_optimizer and engine.optimizer is not None:
        _load_optimizer(engine, _saved_optimizer(engine, root, state))
    if load_scheduler and engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.global_steps = state["global_steps"]
    engine.global_samples = state["global_samples"]
    engine.micro_steps = state.get("micro_steps", state["global_steps"] * engine.micro_batches)
    engine.skipped_steps = state["skipped_steps"]
    engine.loaded_checkpoint_mp_world_size = state["mp_world_size"]


def _read_stage_file(engine: Any, root: Path) -> dict[str, Any]:
    """This stage's file of the checkpoint ``root``, checked to be written by the same pipeline and data-parallel
    degrees."""
    model_file = _model_file(engine, root)
    if not model_file.is_file():
        raise FileNotFoundError(f"{model_file} not found: not a pipeline checkpoint of this pipeline "
                                f"({engine.num_stages} stages)")  # fmt: skip
    state = torch.load(model_file, map_location="cpu", weights_only=False)
    # DeepSpeed's stage files do not record the stages: the model-parallel world of a pipeline is its stages
    saved = (state.get("num_stages", state.get("mp_world_size")), state.get("dp_world_size"))
    if saved != (engine.num_stages, engine.dp_world_size):
        raise ValueError(f"the checkpoint {root} was written by {saved[0]} stages x {saved[1]} data-parallel "
                         f"replicas; this job runs {engine.num_stages} x {engine.dp_world_size}: resume with the "
                         "same degrees")  # fmt: skip
    return state


def _saved_optimizer(engine: Any, root: Path, state: dict[str, Any]) -> dict | None:
    """The optimizer state as :func:`_optimizer_state` made it, from where :func:`save` put it (None: none saved);
    under ZeRO-1 also the rank's file ZeRO-1 wrote before it ran on the partition."""
    if state.get("torsh_optimizer") is not None:
        return state["torsh_optimizer"]
    if state.get("optimizer") is not None:
        return {"optimizer": state["optimizer"]}
    if _zero(engine) and _optim_file(engine, root).is_file():
        saved = torch.load(_optim_file(engine, root), map_location="cpu", weights_only=False)["optimizer_state_dict"]
        if "optimizer" not in saved:  # DeepSpeed's own ZeRO optimizer partition (base_optimizer_state, ...)
            from ..checkpoint.io import CheckpointError

            raise CheckpointError(f"{_optim_file(engine, root)} holds DeepSpeed's ZeRO-1 optimizer partition, which "
                                  "the pipeline engine does not read: load_checkpoint(..., load_optimizer_states="
                                  "False) loads the weights, counters and scheduler and the optimizer starts afresh")
        return saved
    return None


def _load_optimizer(engine: Any, optim: dict | None) -> None:
    """The optimizer's state and, when saved with it, the fp32 masters (copied into the parameters too)."""
    if optim is None:
        return
    if engine._shard.partition is not None:
        _load_partition(engine, optim)
        return
    engine.optimizer.load_state_dict(optim["optimizer"])
    masters = engine._precision.masters
    if masters is not None and "fp32_masters" in optim:
        with torch.no_grad():
            for name, value in optim["fp32_masters"].items():
                masters.masters[name].copy_(value)
        masters.master_to_params()


def _load_partition(engine: Any, optim: dict) -> None:
    """ZeRO-1: whole per-parameter state (and fp32 masters) sliced into this rank's partition (collective over the
    stage's replicas); or the per-rank state of torch's ``ZeroRedundancyOptimizer`` ZeRO-1 wrote before, which
    every replica's file together completes."""
    part, saved, masters = engine._shard.partition, optim["optimizer"], optim.get("fp32_masters") or {}
    if RANK_STATE in saved:
        by_name = dict(engine.module.named_parameters())
        for name, value in masters.items():
            if name in by_name and hasattr(by_name[name], ZERO_SLOT):
                part.set_full_master(by_name[name], value)
        part.load_legacy_state(engine.optimizer, saved)
        return
    with part.full_view(engine.module, engine.optimizer, load=True) as (module, view), torch.no_grad():
        view.load_state_dict(saved)
        for name, p in module.named_parameters():
            if name in masters:
                p.copy_(masters[name])


#: What else DeepSpeed writes into a stage file (not client state when torsh loads DeepSpeed's checkpoint).
DEEPSPEED_OWN = ("buffer_names", "param_shapes", "frozen_param_shapes", "shared_params", "frozen_param_fragments",
                 "data_sampler", "random_ltd", "sparse_tensor_module_names", "ds_config", "ds_version")


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)
