"""``deepspeed.runtime.pipe.module`` (``deepspeed.pipe``): ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``.

The partition, build order and seeding are the engine's (:mod:`torsh.engine.pipeline.module`); DeepSpeed's class
differs only in what it takes from the rest of DeepSpeed: ``deepspeed.checkpointing.checkpoint`` as its activation
checkpoint function (so that ``deepspeed.checkpointing.configure(checkpoint_in_cpu=True)`` applies to it) and the
device of ``get_accelerator()`` (``DS_ACCELERATOR``, ``set_accelerator``).
"""

from __future__ import annotations

from torsh.engine.pipeline import module as engine_module
from torsh.engine.pipeline.module import LayerSpec, PipelineError, TiedLayerSpec  # noqa: F401

from ...accelerator import get_accelerator
from ..activation_checkpointing import checkpointing


class PipelineModule(engine_module.PipelineModule):
    __doc__ = engine_module.PipelineModule.__doc__

    _non_reentrant_checkpoint = staticmethod(checkpointing.non_reentrant_checkpoint)

    def __init__(self, layers, num_stages=None, topology=None, loss_fn=None, seed_layers=False, seed_fn=None,
                 base_seed=1234, partition_method="parameters", activation_checkpoint_interval=0,
                 activation_checkpoint_func=checkpointing.checkpoint, checkpointable_layers=None,
                 dynamic_shape=False):  # fmt: skip
        super().__init__(layers, num_stages=num_stages, topology=topology, loss_fn=loss_fn, seed_layers=seed_layers,
                         seed_fn=seed_fn, base_seed=base_seed, partition_method=partition_method,
                         activation_checkpoint_interval=activation_checkpoint_interval,
                         activation_checkpoint_func=activation_checkpoint_func,
                         checkpointable_layers=checkpointable_layers, dynamic_shape=dynamic_shape)  # fmt: skip

    def _stage_device(self) -> str:
        return get_accelerator().device_name(self.local_rank)
