"""``deepspeed.utils.zero_to_fp32``: consolidating a DeepSpeed ZeRO checkpoint directory."""

from .._unsupported import unsupported_function

_INSTEAD = ("torsh checkpoints are torch.distributed.checkpoint directories; load them into the engine with "
            "engine.load_checkpoint, or read the weights with engine.module.state_dict() inside "
            "deepspeed.zero.GatheredParameters(engine.module.parameters())")
get_fp32_state_dict_from_zero_checkpoint = unsupported_function(
    "utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint", _INSTEAD)
convert_zero_checkpoint_to_fp32_state_dict = unsupported_function(
    "utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict", _INSTEAD)
load_state_dict_from_zero_checkpoint = unsupported_function(
    "utils.zero_to_fp32.load_state_dict_from_zero_checkpoint", _INSTEAD)
