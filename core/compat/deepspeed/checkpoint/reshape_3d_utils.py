"""``deepspeed.checkpoint.reshape_3d_utils``: a checkpoint's pipeline x tensor x data parallel shape, read from its
files, and which source ZeRO files each rank of a smaller shape takes.

ZeRO files are numbered data-parallel-major (:func:`~.reshape_utils.sort_zero_files`): the file of model rank ``m``
at data rank ``d`` is ``d * (pp * tp) + m``. A reshaped (pipeline, tensor) cell takes, for each source model rank
:func:`~.reshape_meg_2d.reshape_meg_2d_parallel` gives it, that rank's files at every source data rank; the new
data ranks then split that list into consecutive equal parts.
"""

from __future__ import annotations

from torsh.engine.checkpoint.from_deepspeed import load_file

from .constants import CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE, LAYER_FILE_PREFIX
from .constants import MODEL_FILE_PREFIX
from .reshape_meg_2d import meg_2d_parallel_map, reshape_meg_2d_parallel
from .reshape_utils import get_files, get_files_with_prefix, get_zero_files, partition_data

PP_DIM, TP_DIM, DP_DIM = "PP", "TP", "DP"


class model_3d_desc:  # noqa: N801  (DeepSpeed's name)
    """The degrees of a checkpoint's pipeline, tensor and data parallelism."""

    def __init__(self, pp_degree=1, tp_degree=1, dp_degree=1):
        self.pp_degree = pp_degree
        self.tp_degree = tp_degree
        self.dp_degree = dp_degree

    def _dims(self, other=None):
        other = other or self
        return ((PP_DIM, self.pp_degree, other.pp_degree), (TP_DIM, self.tp_degree, other.tp_degree),
                (DP_DIM, self.dp_degree, other.dp_degree))  # fmt: skip

    def reshape(self, target_3d_desc, verbose=False) -> list[meg_2d_parallel_map]:
        """Per target data rank, the (pipeline, tensor) map of source ZeRO file indices it takes."""
        valid, errors = self.can_reshape(target_3d_desc)
        if not valid:
            raise ValueError(f"cannot reshape a checkpoint of {self.get_desc()} to {target_3d_desc.get_desc()}: "
                             + "; ".join(errors))  # fmt: skip
        grid = reshape_meg_2d_parallel(self.pp_degree, self.tp_degree, target_3d_desc.pp_degree,
                                       target_3d_desc.tp_degree, verbose=verbose)  # fmt: skip
        model_ranks = self.pp_degree * self.tp_degree
        per_dp = [meg_2d_parallel_map(grid.pp_degree, grid.tp_degree) for _ in range(target_3d_desc.dp_degree)]
        for i in range(grid.pp_degree):
            for j in range(grid.tp_degree):
                files = [rank + d * model_ranks for rank in grid.get_data(i, j) for d in range(self.dp_degree)]
                for part, cell in zip(partition_data(files, target_3d_desc.dp_degree), per_dp):
                    cell.add_data(i, j, part)
        return per_dp

    def get_desc(self) -> str:
        return f"{PP_DIM},{TP_DIM},{DP_DIM} = ({self.pp_degree}, {self.tp_degree}, {self.dp_degree})"

    def world_size(self) -> int:
        return self.pp_degree * self.tp_degree * self.dp_degree

    def is_valid(self, pp_index, tp_index, dp_index) -> tuple[bool, list[str]]:
        errors = [f"{name} indexing error: index {index} >= degree {degree}"
                  for (name, degree, _), index in zip(self._dims(), (pp_index, tp_index, dp_index)) if index >= degree]
        return not errors, errors

    def can_reshape(self, target_3d_desc) -> tuple[bool, list[str]]:
        """Whether every degree of ``target_3d_desc`` is at most this one's, and a message per one that is not."""
        errors = [f"Expansion reshape not supported - {name}: {old} ---> {new}"
                  for name, old, new in self._dims(target_3d_desc) if new > old]
        return not errors, errors


def get_model_3d_descriptor_from_metadata(file_list, zero_file_list, model_state_metadata) -> model_3d_desc:
    """The shape of a checkpoint from its file lists and each model-state file's recorded parallel dimensions
    (``[(path, {CHECKPOINT_PARALLEL_DIMS: dims or None}), ...]``). Files that record none (older DeepSpeed) are
    read by counting: one model-state file per (pipeline, tensor) rank, pipeline layers' ``layer_01-model_XX``
    files per tensor rank."""
    model_files = [path for path, _ in model_state_metadata]
    if not model_files:
        raise RuntimeError(f"no {MODEL_FILE_PREFIX}*_model_states.pt file: not a DeepSpeed checkpoint tag folder")
    recorded, missing = [], []
    for path, metadata in model_state_metadata:
        dims = metadata.get(CHECKPOINT_PARALLEL_DIMS)
        if dims is None:
            missing.append(path)
            continue
        if not isinstance(dims, dict):
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} must be a dictionary in {path}.")
        values = []
        for key in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE):
            value = dims.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RuntimeError(f"Checkpoint {key} must be a positive integer in {path}, got {value!r}.")
            values.append(value)
        recorded.append(tuple(values))
    if recorded:
        if missing:
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} is missing from model-state files: {missing}")
        if len(set(recorded)) != 1:
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} disagrees across model-state files: "
                               f"{recorded}")  # fmt: skip
        pp, tp = recorded[0]
        if len(model_files) != pp * tp:
            raise RuntimeError(f"Checkpoint model-state file count {len(model_files)} does not match "
                               f"{CHECKPOINT_PP_DEGREE}={pp} * {CHECKPOINT_TP_DEGREE}={tp}.")  # fmt: skip
        if len(zero_file_list) % (pp * tp):
            raise RuntimeError(f"Checkpoint ZeRO file count {len(zero_file_list)} is not divisible by "
                               f"{CHECKPOINT_PP_DEGREE}={pp} * {CHECKPOINT_TP_DEGREE}={tp}.")  # fmt: skip
    else:
        first_layer_files = len(get_files_with_prefix(file_list, f"{LAYER_FILE_PREFIX}01"))
        tp = first_layer_files or len(model_files)
        pp = len(model_files) // tp if first_layer_files else 1
    return model_3d_desc(pp, tp, max(1, len(zero_file_list) // (pp * tp)))


def get_model_3d_descriptor(dir) -> model_3d_desc:
    """The shape of the checkpoint in folder ``dir`` (each model-state file loaded once, for its dimensions)."""
    file_list = get_files(dir)
    metadata = []
    for path in get_files_with_prefix(file_list, MODEL_FILE_PREFIX):
        state = load_file(path)
        metadata.append((path, {CHECKPOINT_PARALLEL_DIMS: state.get(CHECKPOINT_PARALLEL_DIMS)}))
        del state
    return get_model_3d_descriptor_from_metadata(file_list, get_zero_files(dir), metadata)
