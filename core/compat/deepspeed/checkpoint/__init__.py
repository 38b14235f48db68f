"""``deepspeed.checkpoint``: DeepSpeed's checkpoint file names per rank (``get_model_ckpt_name_for_rank`` and its ZeRO
and layer counterparts), ``utils.clone_tensors_for_torch_save`` (Accelerate's ``get_state_dict`` and the Hugging Face
Trainer's ``save_model`` call it at ZeRO 0-2), the keys of the files (:mod:`.constants`), and the readers conversion
tools use on Megatron-DeepSpeed checkpoint folders: ``DeepSpeedCheckpoint``, ``ZeROCheckpoint`` and the pipeline x
tensor x data reshaping maps (``model_3d_desc``, ``get_model_3d_descriptor``, ``reshape_meg_2d_parallel``). Writing
universal checkpoints (``enable_universal_checkpoint``, ``ds_to_universal``) is not done by torsh."""

from .._unsupported import unsupported_function
from .constants import *  # noqa: F403  (DeepSpeed exports its constants here)
from .deepspeed_checkpoint import DeepSpeedCheckpoint
from .reshape_3d_utils import get_model_3d_descriptor, model_3d_desc
from .reshape_meg_2d import reshape_meg_2d_parallel
from .reshape_utils import merge_state
from .utils import (
    clone_tensors_for_torch_save,
    get_layer_ckpt_name_for_rank,
    get_model_ckpt_name_for_rank,
    get_zero_ckpt_name_for_rank,
)
from .zero_checkpoint import ZeROCheckpoint

enable_universal_checkpoint = unsupported_function(
    "checkpoint.enable_universal_checkpoint", "torsh writes no universal checkpoint; a torsh checkpoint loads at any "
    "world size and stage (engine.load_checkpoint), and torsh-migrate merge writes one state dict")  # fmt: skip

__all__ = ["clone_tensors_for_torch_save", "get_model_ckpt_name_for_rank", "get_zero_ckpt_name_for_rank",
           "get_layer_ckpt_name_for_rank", "DeepSpeedCheckpoint", "ZeROCheckpoint", "model_3d_desc",
           "get_model_3d_descriptor", "reshape_meg_2d_parallel", "merge_state", "enable_universal_checkpoint"]
