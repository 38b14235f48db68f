"""``deepspeed.checkpoint.zero_checkpoint``: the ZeRO optimizer-state files of a DeepSpeed checkpoint folder, and the
merged state each rank of a smaller pipeline x tensor x data shape would load."""

from __future__ import annotations

import torch

from torsh.engine.checkpoint.from_deepspeed import load_file

from .constants import BASE_OPTIMIZER_STATE, GROUP_PADDINGS, OPTIMIZER_STATE_DICT, PARTITION_COUNT
from .reshape_3d_utils import get_model_3d_descriptor, model_3d_desc
from .reshape_utils import basic_folder_validation, get_zero_files, merge_state

GROUP_STATE_KEY = "state"


class ZeROCheckpoint:
    """The ZeRO files of folder ``dir``; ``source_3d`` (the checkpoint's shape) is read from its files if not given."""

    def __init__(self, dir, source_3d=None):
        basic_folder_validation(dir)
        self.dir = dir
        self.file_list = get_zero_files(dir)
        self.num_files = len(self.file_list)
        if not self.file_list:
            raise FileNotFoundError(f"No ZeRO files found in {dir} (*zero_pp_rank_<dp>_mp_rank_<mp>_optim_states.pt)")
        self.src_3d = get_model_3d_descriptor(dir) if source_3d is None else source_3d
        self.reshape(model_3d_desc(self.src_3d.pp_degree, self.src_3d.tp_degree, self.src_3d.dp_degree))

    def get_src_world_size(self) -> int:
        return self.src_3d.world_size()

    def get_src_tp_degree(self) -> int:
        return self.src_3d.tp_degree

    def get_src_pp_degree(self) -> int:
        return self.src_3d.pp_degree

    def get_src_dp_degree(self) -> int:
        return self.src_3d.dp_degree

    def reshape(self, target_3d_desc: model_3d_desc) -> None:
        """Map the files onto the ranks of ``target_3d_desc`` (degrees no larger than the source's)."""
        self.target_3d = target_3d_desc
        self._3d_file_map = self.src_3d.reshape(target_3d_desc)

    def get_file_indices_for_rank(self, pp_index, tp_index, dp_index) -> list[int]:
        if not 0 <= dp_index < len(self._3d_file_map):
            raise IndexError(f"DP index {dp_index} >= DP degree {len(self._3d_file_map)}")
        return self._3d_file_map[dp_index].get_data(pp_index, tp_index)

    def get_files_for_rank(self, pp_index, tp_index, dp_index) -> list[str]:
        return [self.file_list[i] for i in self.get_file_indices_for_rank(pp_index, tp_index, dp_index)]

    def get_state_for_rank(self, pp_index, tp_index, dp_index, keys_to_ignore=(), strip_tensor_paddings=True):
        """The files of that rank loaded and merged (flat state tensors concatenated), each file's padding removed
        first when ``strip_tensor_paddings``; ``partition_count`` becomes the target's data-parallel degree."""
        merged = None
        for path in self.get_files_for_rank(pp_index, tp_index, dp_index):
            state = load_file(path)
            for key in keys_to_ignore:
                state.pop(key, None)
            if strip_tensor_paddings:
                _strip_paddings(state)
            merged = state if merged is None else merge_state(merged, state)
            optimizer_state = merged.get(OPTIMIZER_STATE_DICT) or {}
            if optimizer_state.get(PARTITION_COUNT):
                optimizer_state[PARTITION_COUNT] = [self.target_3d.dp_degree] * len(optimizer_state[PARTITION_COUNT])
            if strip_tensor_paddings and optimizer_state.get(GROUP_PADDINGS):
                optimizer_state[GROUP_PADDINGS] = [0] * len(optimizer_state[GROUP_PADDINGS])
        return merged

    def print_3d_index_map(self, tag=None) -> None:
        if tag:
            print(f"3D index map: {tag}")
        for dp_index, grid in enumerate(self._3d_file_map):
            grid.print_data(f"dp = {dp_index}")

    def print_3d_file_map(self, tag=None) -> None:
        if tag:
            print(f"3D file map: {tag}")
        for dp_index, grid in enumerate(self._3d_file_map):
            for pp_index in range(grid.pp_degree):
                for tp_index in range(grid.tp_degree):
                    files = [self.file_list[i] for i in grid.get_data(pp_index, tp_index)]
                    print(f"{pp_index}, {tp_index}, {dp_index} => {files}")


def _strip_paddings(state: dict) -> None:
    """Cut each optimizer group's flat state tensors (not ``step``) to their length without the group's padding."""
    optimizer_state = state.get(OPTIMIZER_STATE_DICT) or {}
    paddings = optimizer_state.get(GROUP_PADDINGS)
    groups = (optimizer_state.get(BASE_OPTIMIZER_STATE) or {}).get(GROUP_STATE_KEY)
    if not groups or not paddings:
        return
    for key, group_state in groups.items():
        if not paddings[key]:
            continue
        for name, value in group_state.items():
            if name != "step" and torch.is_tensor(value):
                group_state[name] = value.narrow(0, 0, value.numel() - paddings[key]).clone()
