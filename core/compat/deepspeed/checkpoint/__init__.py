"""``deepspeed.checkpoint``: ``utils.clone_tensors_for_torch_save`` (Accelerate's ``get_state_dict`` and the Hugging
Face Trainer's ``save_model`` call it at ZeRO 0-2) and DeepSpeed's checkpoint file names per rank
(``get_model_ckpt_name_for_rank`` and its ZeRO and layer counterparts). DeepSpeed's checkpoint reshaping classes
(Megatron universal checkpoints) import and fail with a clear message when used."""

from .._unsupported import unsupported_class, unsupported_function
from .utils import (
    clone_tensors_for_torch_save,
    get_layer_ckpt_name_for_rank,
    get_model_ckpt_name_for_rank,
    get_zero_ckpt_name_for_rank,
)

_INSTEAD = ("reshaping Megatron/universal checkpoints is not done by torsh; torsh checkpoints load at any world size "
            "and stage (engine.load_checkpoint), and torsh-migrate merge writes one state dict")
DeepSpeedCheckpoint = unsupported_class("checkpoint.DeepSpeedCheckpoint", _INSTEAD)
ZeROCheckpoint = unsupported_class("checkpoint.ZeROCheckpoint", _INSTEAD)
enable_universal_checkpoint = unsupported_function("checkpoint.enable_universal_checkpoint", _INSTEAD)

__all__ = ["clone_tensors_for_torch_save", "get_model_ckpt_name_for_rank", "get_zero_ckpt_name_for_rank",
           "get_layer_ckpt_name_for_rank", "DeepSpeedCheckpoint", "ZeROCheckpoint", "enable_universal_checkpoint"]
