"""The cell encoding of pooled outputs, in one place.

A pooled output ``[rows, sum(dims)]`` holds one bag per (row, feature) "cell", numbered
``row * F + feature``. The sample side's output uses the sharding's F features; the owner's
padded lookup output uses its V feature copies (:class:`PaddedCells`). Data moves in "units":
whole rows of ``[-1, D]`` when every feature has width D, else single elements.
"""

from dataclasses import dataclass
from typing import List, Optional

import torch

from torchrec_hybrid.sharding.segments import exclusive_cumsum, segment_positions


class CellPositions:
    """Cells of a pooled output -> positions in its units (rows or elements)."""

    def __init__(self, dims: List[int], device: torch.device) -> None:
        d = torch.tensor(dims, dtype=torch.int64)
        self.num_features = len(dims)
        self.total_dim = int(d.sum())
        self.uniform_dim: Optional[int] = dims[0] if len(set(dims)) == 1 else None
        self.dims = d.to(device)
        self.dim_offsets = exclusive_cumsum(d).to(device)

    def __call__(self, cells: torch.Tensor) -> torch.Tensor:
        if self.uniform_dim is not None:
            return cells
        F = self.num_features
        feature, row = cells % F, torch.div(cells, F, rounding_mode="floor")
        return segment_positions(row * self.total_dim + self.dim_offsets[feature], self.dims[feature])


@dataclass
class PaddedCells:
    """Where the owner's bags sit in its padded lookup output ``[batch, V * dim]``.

    The TBE needs one batch size for all its features, so a feature that gets many bags
    (the owner of a table-wise cold layout gets the global batch) would pad every other
    feature to its count. Instead feature f is looked up as ``copies[f]`` TBE features of
    the same table ("copies", V in all, feature f's from ``first_copy[f]``): its q-th bag
    takes row ``q % batch`` of copy ``q // batch``, i.e. cell ``(q % batch) * V + copy``.
    """

    batch: int
    first_copy: torch.Tensor  # [F] int64
    num_copies: int  # V

    def copy_of(self, q: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        return self.first_copy[feature] + torch.div(q, self.batch, rounding_mode="floor")

    def cells(self, q: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        """Cells ``row * V + copy`` of the q-th bags of features ``feature``."""
        return (q % self.batch) * self.num_copies + self.copy_of(q, feature)


def feature_copies(world: int, local_rows: List[int], rows: List[int]) -> List[int]:
    """TBE copies per feature for an owner: about its share of the table's rows times W
    (the owner of every row gets about the global batch, W local batches; a block of
    1/W of the rows about one); at least one."""
    return [max(1, round(world * lr / max(r, 1))) for lr, r in zip(local_rows, rows)]
