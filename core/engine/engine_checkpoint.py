"""The engine's checkpoint methods (DeepSpeed's ``save_checkpoint`` / ``load_checkpoint`` and their private
helpers that DeepSpeed's tests and scripts reach), a base class of :class:`torsh.engine.engine.Engine`."""

from __future__ import annotations

import contextlib
import logging
import os
import stat

from torch import nn

from .zero.partition import attach as _attach
from .zero.partition import attach_buffers as _attach_buffers


class CheckpointMethods:
    """Checkpoint methods of the engine (they read the engine's module, optimizer, scheduler and counters)."""

    def _engine_state(self) -> dict:
        """The counters and sizes a checkpoint records, and the tied parameters (``shared_params``: each further
        name -> the first, as DeepSpeed records them), which the merge of a checkpoint keeps as one tensor."""
        from .checkpoint.ds_model_states import shared_params

        return {"global_steps": self.global_steps, "global_samples": self.global_samples,
                "micro_steps": self.micro_steps, "skipped_steps": self.skipped_steps,
                "dp_world_size": self.dp_world_size, "mp_world_size": self.mp_world_size,
                "shared_params": shared_params(self.module)}  # fmt: skip

    @property
    def checkpoint_mp_rank(self) -> int:
        """The model-parallel rank whose ``mp_rank_XX`` files this rank writes and reads (DeepSpeed's member): the
        rank in the model-parallel group (an mpu's, or tensor parallelism's) where the model is split, else 0 (an
        mpu of model-parallel size 1, such as a sequence-parallel one, writes ``mp_rank_00``)."""
        return self.get_model_parallel_rank() if self.mp_world_size > 1 else 0

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 (DeepSpeed's)
                        exclude_frozen_parameters=False) -> bool:  # fmt: skip
        """Save model, optimizer, scheduler, loss scaler, counters and ``client_state`` under
        ``save_dir/<tag>/`` (tag default ``global_step{N}``) and, if ``save_latest``, ``save_dir/latest``;
        ``exclude_frozen_parameters`` leaves out the parameters that do not require a gradient. Where every rank
        holds the whole model, DeepSpeed's ``mp_rank_00_model_states.pt`` is written too (see
        :mod:`torsh.engine.checkpoint.ds_model_states`)."""
        from .checkpoint.ds_model_states import model_states as deepspeed_model_states
        from .checkpoint.moe_experts import for_save
        from .checkpoint.save_load import save_checkpoint

        if not save_dir:  # DeepSpeed's check: None or "" would write into the working directory
            raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
        frozen = frozenset(n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad)
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        section = self.config.get("checkpoint") if isinstance(self.config, dict) else None
        validation = section.get("tag_validation", "warn") if isinstance(section, dict) else "warn"
        model_states = deepspeed_model_states(self, client_state=dict(client_state or {}),
                                              exclude_frozen=exclude_frozen_parameters)  # fmt: skip
        # MoE layers: DeepSpeed's expert files, and each expert under its global name in the DCP files
        model_states, rank_files, key_map = for_save(self, model_states, exclude_frozen=exclude_frozen_parameters)
        if self.__dict__.get("_mpu") is not None:  # DeepSpeed's mp_rank_XX file per model-parallel rank
            model_states, rank_files, key_map = self._mpu.checkpoint_files(model_states, self.module.state_dict())
        with self._checkpoint_state(load=False) as (module, optimizer):
            return save_checkpoint(save_dir, tag, model=module, optimizer=optimizer, lr_scheduler=self.lr_scheduler,
                                   loss_scaler=self.loss_scaler, engine_state=self._engine_state(),
                                   client_state=dict(client_state or {}), save_latest=save_latest,
                                   frozen=frozen if exclude_frozen_parameters else frozenset(),
                                   tag_validation=str(validation), model_states=model_states, key_map=key_map,
                                   rank_files=rank_files)  # fmt: skip

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):  # fmt: skip
        """Load a checkpoint written by :meth:`save_checkpoint` (at any world size); returns
        ``(load_path, client_state)``, ``(None, None)`` when there is none."""
        from .checkpoint.moe_experts import for_load
        from .checkpoint.save_load import load_checkpoint

        key_map, experts = for_load(self)  # MoE layers: their experts' global names and files
        mpu, model_parallel = self.__dict__.get("_mpu"), (0, 1)
        if mpu is not None:  # each model-parallel rank's slices under its own keys (DeepSpeed's: mp_rank_XX files)
            key_map, model_parallel = mpu.key_map(self.module.state_dict()), (mpu.checkpoint_mp_rank, mpu.tp)
        if custom_load_fn is not None:
            raise NotImplementedError("load_checkpoint(custom_load_fn=...) is not supported by the torsh engine")
        with self._checkpoint_state(load=True) as (module, optimizer):
            path, client_state, state = load_checkpoint(
                load_dir, tag, model=module, optimizer=optimizer, lr_scheduler=self.lr_scheduler,
                loss_scaler=self.loss_scaler, load_module_strict=load_module_strict,
                load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=load_lr_scheduler_states,
                load_module_only=load_module_only, key_map=key_map, experts=experts,
                model_parallel=model_parallel)  # fmt: skip
        if path is None:
            return None, None
        if state and not load_module_only:
            self.global_steps = state.get("global_steps", self.global_steps)
            self.global_samples = state.get("global_samples", self.global_steps * self.train_batch_size())
            self.micro_steps = state.get("micro_steps", self.global_steps * self.gradient_accumulation_steps())
            self.skipped_steps = state.get("skipped_steps", 0)
            self.loaded_checkpoint_mp_world_size = state.get("mp_world_size", 1)
        if state:
            # DeepSpeed sets it also when loading the module only
            self.loaded_checkpoint_dp_world_size = state.get("dp_world_size")
        if self._precision.masters is not None:
            self._precision.masters.master_to_params()  # the checkpoint holds the fp32 masters
        self._publish_scale()  # the loaded loss scale
        return path, client_state

    @contextlib.contextmanager
    def _checkpoint_state(self, *, load: bool):
        """The module and optimizer a checkpoint holds: under ZeRO-2 whole fp32 views of the partitions (collective;
        with ``load``, sliced back into the partition afterwards), else :meth:`_checkpoint_module` and the
        engine's optimizer."""
        part = self._shard.partition
        if part is None:
            yield self._checkpoint_module(), self.optimizer
            return
        with part.full_view(self.module, self.optimizer, load=load) as pair:
            yield pair

    def _checkpoint_module(self) -> nn.Module:
        """The module whose state is saved: the user's module, or - with master weights - the same names
        holding the fp32 masters (the tensors the optimizer state belongs to) and the module's buffers."""
        masters = self._precision.masters
        if masters is None:
            return self.module
        if self._master_module is None:
            root = nn.Module()
            for name, tensor in masters.masters.items():
                _attach(root, name, tensor, parameter=True)
            _attach_buffers(root, self.module)  # the persistent buffers, as module.state_dict()
            self.__dict__["_master_module"] = root  # not a submodule: engine.parameters() stays the model's
        return self._master_module

    def _get_optimizer_ckpt_name(self, checkpoints_path, tag, expp_rank=None) -> str:  # noqa: ARG002 (DeepSpeed's)
        """DeepSpeed's name of an expert-parallel rank's optimizer-state file under ``checkpoints_path/tag`` (its
        engine opens it when loading a MoE model's optimizer state; DeepSpeed's tests watch it to check that a load
        without optimizer states asks for no optimizer file). A torsh checkpoint keeps the optimizer state in that
        directory's DCP files and never asks for the name."""
        name = f"expp_rank_{expp_rank}_mp_rank_{self.get_model_parallel_rank():02d}_optim_states.pt"
        return os.path.join(str(checkpoints_path), str(tag), name)

    def _change_recovery_script_permissions(self, dst: str) -> None:
        """DeepSpeed's step after copying ``zero_to_fp32.py`` into a save: make it executable; a file system that
        refuses (an Azure file share), or a missing file, is logged and not an error."""
        try:
            os.chmod(dst, os.stat(dst).st_mode | stat.S_IEXEC)
        except OSError as err:  # DeepSpeed's logger: scripts and DeepSpeed's tests watch it
            logging.getLogger("DeepSpeed").info(f"Warning: Could not change permissions for {dst} due to error: "
                                                f"{err}. Continuing without changing permissions.")
