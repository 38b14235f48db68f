"""What ``accelerate launch --config_file X`` makes of a YAML, without starting processes.

The launcher's own argument parser and validation (``_validate_launch_command``), its environment for the
processes (``prepare_multi_gpu_env`` / ``prepare_deepspeed_cmd_env``), and the plugin Accelerate then builds from
that environment in each process (``FullyShardedDataParallelPlugin`` / ``DeepSpeedPlugin``), reduced to plain
values to compare with the source config.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def launch_view(config_file: str | Path, *extra: str, script: str = "probe.py") -> dict[str, Any]:
    """Validate a config the way ``accelerate launch`` does and return what the processes would be given.

    Raises what ``accelerate launch`` raises for a file it refuses.
    """
    from unittest import mock

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config_file), *extra, script])
    # nothing is launched: whether this machine's port is taken now (by another test) is not the file's doing
    free = mock.patch("accelerate.utils.launch.is_port_in_use", return_value=False)
    with _environment(dict(os.environ)), warnings.catch_warnings(), free:
        warnings.simplefilter("ignore")
        logging.getLogger("accelerate").setLevel(logging.ERROR)
        args, defaults, mp_from_config = _validate_launch_command(args)
        if args.use_deepspeed:
            args.deepspeed_fields_from_accelerate_config = ",".join(
                list(defaults.deepspeed_config.keys()) + (["mixed_precision"] if mp_from_config else []))
            _, env = prepare_deepspeed_cmd_env(args)
        elif args.use_fsdp or args.multi_gpu:
            env = prepare_multi_gpu_env(args)
        else:
            env = dict(os.environ, ACCELERATE_MIXED_PRECISION=str(args.mixed_precision))
    view: dict[str, Any] = {
        "distributed_type": str(defaults.distributed_type).split(".")[-1],
        "num_processes": args.num_processes, "num_machines": args.num_machines,
        "mixed_precision": env.get("ACCELERATE_MIXED_PRECISION", "no"),
        "use_fsdp": bool(args.use_fsdp), "use_deepspeed": bool(args.use_deepspeed),
    }
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG") == "true":
        view["parallelism"] = parallelism_view(env)
    if args.use_fsdp:
        view["fsdp"] = fsdp_plugin_view(env)
    if args.use_deepspeed:
        view["deepspeed"] = deepspeed_plugin_view(env)
    return view


def fsdp_plugin_view(env: dict[str, str]) -> dict[str, Any]:
    """The FullyShardedDataParallelPlugin Accelerate builds in a process with this environment."""
    from unittest import mock

    import accelerate.utils.dataclasses as dataclasses_module
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin

    # The FSDP1 plugin asks for an accelerator's current device when sync_module_states is on (the meta-device
    # init function); this machine has none, so the plugin is built as on a one-GPU node.
    with _environment({**env, "ACCELERATE_USE_FSDP": "true"}), warnings.catch_warnings(), \
            mock.patch.object(dataclasses_module, "is_cuda_available", lambda: True), \
            mock.patch.object(torch.cuda, "current_device", lambda: 0):
        warnings.simplefilter("ignore")
        plugin = FullyShardedDataParallelPlugin()
    wrap = plugin.auto_wrap_policy
    wrap_name = None if wrap is None else getattr(wrap, "__name__", str(wrap))
    reshard = plugin.reshard_after_forward
    return {
        "version": plugin.fsdp_version,
        "reshard_after_forward": reshard if isinstance(reshard, bool) else getattr(reshard, "name", reshard),
        "sharding_strategy": getattr(plugin.sharding_strategy, "name", plugin.sharding_strategy),
        "cpu_offload": bool(getattr(plugin.cpu_offload, "offload_params", False)) if plugin.fsdp_version == 1
        else type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy",
        "auto_wrap_policy": wrap_name,
        "transformer_cls_names_to_wrap": plugin.transformer_cls_names_to_wrap,
        "min_num_params": plugin.min_num_params,
        "backward_prefetch": getattr(plugin.backward_prefetch, "name", None),
        "state_dict_type": getattr(plugin.state_dict_type, "name", str(plugin.state_dict_type)),
        "activation_checkpointing": plugin.activation_checkpointing,
    }


def deepspeed_plugin_view(env: dict[str, str]) -> dict[str, Any]:
    """The DeepSpeedPlugin Accelerate builds in a process with this environment: its DeepSpeed config."""
    from accelerate.utils import DeepSpeedPlugin

    with _environment({**env, "ACCELERATE_USE_DEEPSPEED": "true"}), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plugin = DeepSpeedPlugin()
    return {"zero_stage": plugin.zero_stage, "config": plugin.deepspeed_config,
            "offload_optimizer_device": plugin.offload_optimizer_device,
            "offload_param_device": plugin.offload_param_device}  # fmt: skip


def parallelism_view(env: dict[str, str]) -> dict[str, Any]:
    """The ParallelismConfig ``Accelerator()`` builds in a process with this environment: its sizes and total."""
    from accelerate.parallelism_config import ParallelismConfig

    with _environment({k: v for k, v in env.items() if k.startswith("PARALLELISM_CONFIG_")}):
        config = ParallelismConfig()
    sizes = {name: getattr(config, f"{name}_size") for name in ("dp_replicate", "dp_shard", "tp", "cp", "sp")}
    return {**sizes, "total_size": config.total_size}
