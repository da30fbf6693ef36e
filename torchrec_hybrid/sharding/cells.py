"""The cell encoding of pooled outputs, in one place.

A pooled output ``[rows, sum(dims)]`` holds one bag per (row, feature) "cell", numbered
``row * F + feature`` (the sample side's output, :class:`CellPositions`); the owner's cold
output is the concatenation of its lanes' outputs (:class:`LaneLayout`). Data moves in
"units" of :func:`unit_width` elements (rows of ``[-1, U]``): a whole row when every feature
has width D, else the widths' greatest common divisor (a column-wise cold table's 16-wide
slices beside 64-wide tables move as 16-element units, not element by element).
"""

import math
from typing import Dict, List

import torch

from torchrec_hybrid.sharding.segments import segment_positions


def unit_width(dims: List[int]) -> int:
    """Elements per unit: the greatest common divisor of the widths (1 for none)."""
    return math.gcd(*dims) if dims else 1


def partial_units(dims: List[int]) -> List[int]:
    """Units of one bag's pooled vector per feature: its width / :func:`unit_width` (1 per
    feature when every feature has one width)."""
    u = unit_width(dims)
    return [d // u for d in dims]


class LaneLayout:
    """The owner's cold lookup split in lanes: one TBE call per lane, each with its own batch.

    The TBE pools one batch size per call, so a table that receives the global batch (the
    owner of a table-wise cold layout) would pad every other feature of its TBE to that
    count. Each group's tables are split in two lanes - the tables whose cold rows are mostly
    on this rank ("heavy") and the rest - and each lane is pooled as ``[batch_g, dims of its
    features]`` with ``batch_g`` its own largest bag count. The lane outputs, flattened and
    concatenated, are the owner's cold output; a bag's position there follows from its lane,
    its feature's place in the lane and its row q.

    Args:
        lane_features: per lane, its features (indices in the sharding's feature order).
        dims: output width of each feature (sharding order).
    """

    def __init__(self, lane_features: List[List[int]], dims: List[int], device: torch.device) -> None:
        F = self.num_features = len(dims)
        self.lane_features = lane_features
        self.order = [f for fs in lane_features for f in fs]  # lane order -> sharding feature
        units = partial_units(dims)
        self.unit = unit_width(dims)  # elements per unit
        self.one_unit = all(u == 1 for u in units)  # every bag's vector is one unit (a row)
        lane_of, local_of, unit_local = [0] * F, [0] * F, [0] * F
        lane_units = []
        for g, fs in enumerate(lane_features):  # set-up time loop over lanes
            off = 0
            for i, f in enumerate(fs):
                lane_of[f], local_of[f], unit_local[f] = g, i, off
                off += units[f]
            lane_units.append(off)
        as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        self.lane_of, self.local_of, self.unit_local, self.units = map(as_t, (lane_of, local_of, unit_local, units))
        self.order_t = as_t(self.order)
        self._orders: Dict[int, torch.Tensor] = {}
        self._units_per_row = as_t(lane_units)

    def receive_order(self, world: int, parts: int) -> torch.Tensor:
        """Segment order (FBGEMM ``permute_1D_sparse_data``) that turns what an owner received
        into its lanes' inputs: for each part (lengths, ids, weights) and feature in lane
        order, that feature's run from every source, then its extra run. Segments are
        numbered as laid out: the received runs ``(source, part, feature)``, then the extra
        runs ``(part, feature)``. Cached per part count."""
        if parts not in self._orders:  # features in no lane (a 0-row column slice) receive nothing: left out
            F = self.num_features
            s = torch.arange(world, dtype=torch.int32).view(1, 1, world)
            p = torch.arange(parts, dtype=torch.int32).view(parts, 1, 1)
            f = torch.tensor(self.order, dtype=torch.int32).view(1, len(self.order), 1)
            received = s * parts * F + p * F + f  # [part, feature, source]
            extra = world * parts * F + p * F + f  # [part, feature, 1]
            self._orders[parts] = torch.cat([received, extra], 2).reshape(-1).to(self.order_t.device)
        return self._orders[parts]

    def positions_in_lengths(self, q: torch.Tensor, feature: torch.Tensor, batches: List[int]) -> torch.Tensor:
        """Where the q-th bags of ``feature`` go in the lanes' lengths, ``[F_g, batch_g]``
        lane after lane."""
        per_lane = torch.tensor([len(fs) * b for fs, b in zip(self.lane_features, batches)], dtype=torch.int64,
                                device=q.device)
        lane = self.lane_of[feature]
        batch = torch.tensor(batches, dtype=torch.int64, device=q.device)[lane]
        return (torch.cumsum(per_lane, 0) - per_lane)[lane] + self.local_of[feature] * batch + q

    def positions(self, q: torch.Tensor, feature: torch.Tensor, batches: List[int]) -> torch.Tensor:
        """Positions (units, rows of ``[-1, unit]``) of the q-th bags of ``feature`` in the
        concatenated lane outputs of a step whose lanes had ``batches`` rows."""
        per_lane = torch.tensor(batches, dtype=torch.int64, device=q.device) * self._units_per_row
        base = (torch.cumsum(per_lane, 0) - per_lane)[self.lane_of[feature]]
        width = self._units_per_row[self.lane_of[feature]]
        if self.one_unit:
            return base + q * width + self.local_of[feature]
        return segment_positions(base + q * width + self.unit_local[feature], self.units[feature])


class CellPositions:
    """Cells ``row * F + feature`` of a pooled output -> positions in its units: the output
    as one lane of all F features (cells as they are when every feature has one width)."""

    def __init__(self, dims: List[int], device: torch.device) -> None:
        self.num_features = len(dims)
        self.layout = LaneLayout([list(range(len(dims)))], dims, device)

    def __call__(self, cells: torch.Tensor) -> torch.Tensor:
        if self.layout.one_unit:
            return cells
        F = self.num_features
        return self.layout.positions(torch.div(cells, F, rounding_mode="floor"), cells % F, [0])


def heavy_tables(world: int, local_rows: List[int], rows: List[int]) -> List[bool]:
    """Which tables this owner holds most cold rows of (so gets about the global batch of
    their bags): more than 1.5 times an even share."""
    return [world > 1 and lr * world > 1.5 * max(r, 1) for lr, r in zip(local_rows, rows)]
