"""``deepspeed.checkpoint.reshape_meg_2d``: which source model-parallel ranks (files) each rank of a smaller
Megatron pipeline x tensor parallel grid takes.

The source grid numbers its ranks pipeline-major: rank ``i`` is pipeline stage ``i // tp`` and tensor slice
``i % tp``. Contracting the tensor dimension gives each new slice a consecutive run of a stage's old slices;
contracting the pipeline dimension then gives each new stage a consecutive run of a slice's old stages. A degree
may only shrink, by a factor that divides it.
"""

from __future__ import annotations

from .reshape_utils import partition_data


class meg_2d_parallel_map:  # noqa: N801  (DeepSpeed's name)
    """(pipeline index, tensor index) -> list of source rank indices."""

    def __init__(self, pp_degree, tp_degree):
        self.pp_degree = pp_degree
        self.tp_degree = tp_degree
        self.map: dict[str, list] = {}

    def simple_init(self) -> None:
        """Each cell holds its own rank of the pipeline-major numbering."""
        self.map = {self._make_key(i // self.tp_degree, i % self.tp_degree): [i]
                    for i in range(self.pp_degree * self.tp_degree)}  # fmt: skip

    def add_data(self, pp_index, tp_index, data) -> None:
        self._validate_indices(pp_index, tp_index)
        if not isinstance(data, list):
            raise TypeError(f"meg_2d_parallel_map.add_data takes a list of rank indices, not {type(data).__name__}")
        self.map.setdefault(self._make_key(pp_index, tp_index), []).extend(data)

    def get_data(self, pp_index=None, tp_index=None) -> list:
        """The indices of one cell, or of a whole row/column/grid (``None`` = every index of that dimension)."""
        self._validate_indices(pp_index, tp_index)
        rows = range(self.pp_degree) if pp_index is None else [pp_index]
        columns = range(self.tp_degree) if tp_index is None else [tp_index]
        return [rank for i in rows for j in columns for rank in self.map[self._make_key(i, j)]]

    def print_data(self, tag) -> None:
        print(tag)
        for key, value in self.map.items():
            print(f"{key} = {value}")

    def _validate_indices(self, pp_index, tp_index) -> None:
        for name, index, degree in (("pipeline", pp_index, self.pp_degree), ("tensor", tp_index, self.tp_degree)):
            if index is not None and not 0 <= index < degree:
                raise IndexError(f"{name}-parallel index {index} is outside the degree {degree}")

    @staticmethod
    def _make_key(i, j) -> str:
        return f"{i},{j}"


def reshape_meg_2d_parallel(old_pp_degree, old_tp_degree, new_pp_degree, new_tp_degree, verbose=False):
    """The :class:`meg_2d_parallel_map` of the ``new_pp_degree`` x ``new_tp_degree`` grid over the source ranks."""
    if new_pp_degree > old_pp_degree or new_tp_degree > old_tp_degree:
        raise ValueError(f"a checkpoint reshapes only to smaller degrees: pipeline {old_pp_degree} -> "
                         f"{new_pp_degree}, tensor {old_tp_degree} -> {new_tp_degree}")  # fmt: skip
    grid = meg_2d_parallel_map(old_pp_degree, old_tp_degree)
    grid.simple_init()
    if verbose:
        grid.print_data("original_2d_map:")
    if new_tp_degree != old_tp_degree:
        narrower = meg_2d_parallel_map(old_pp_degree, new_tp_degree)
        for i in range(old_pp_degree):
            for j, ranks in enumerate(partition_data(grid.get_data(pp_index=i), new_tp_degree)):
                narrower.add_data(i, j, ranks)
        grid = narrower
    if verbose:
        grid.print_data("after_tp_reshape:")
    if new_pp_degree != old_pp_degree:
        shorter = meg_2d_parallel_map(new_pp_degree, grid.tp_degree)
        for j in range(grid.tp_degree):
            for i, ranks in enumerate(partition_data(grid.get_data(tp_index=j), new_pp_degree)):
                shorter.add_data(i, j, ranks)
        grid = shorter
    if verbose:
        grid.print_data("final_2d_map:")
    return grid
