import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

device_type = "cuda" if torch.cuda.is_available() else "cpu"
mesh = init_device_mesh(device_type, (dist.get_world_size(),))
fsdp_kwargs = dict(
    mesh=mesh,
    reshard_after_forward=True,
    mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
)

full_state = model.state_dict() if dist.get_rank() == 0 else {}  # rank 0 loaded the weights
shard_classes = {'LlamaDecoderLayer'}
blocks = [m for m in model.modules() if m is not model and type(m).__name__ in shard_classes]
for block in blocks:
    fully_shard(block, **fsdp_kwargs)
fully_shard(model, **fsdp_kwargs)
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
# build the optimizer after sharding, from model.parameters()
