"""The cell encoding of pooled outputs, in one place.

A pooled output ``[rows, sum(dims)]`` holds one bag per (row, feature) "cell", numbered
``row * F + feature`` (the sample side's output, :class:`CellPositions`); the owner's cold
output is its lanes' outputs one after another (:class:`LaneLayout`). Data moves in
"units" of :func:`unit_width` elements (rows of ``[-1, U]``): a whole row when every feature
has width D, else the widths' greatest common divisor (a column-wise cold table's 16-wide
slices beside 64-wide tables move as 16-element units, not element by element).
"""

import math
from typing import Dict, List, Optional, Tuple

import torch

from torchrec_hybrid.sharding.segments import host_segment_positions, host_to_device, segment_positions, starts


def unit_width(dims: List[int]) -> int:
    """Elements per unit: the greatest common divisor of the widths (1 for none)."""
    return math.gcd(*dims) if dims else 1


def partial_units(dims: List[int]) -> List[int]:
    """Units of one bag's pooled vector per feature: its width / :func:`unit_width` (1 per
    feature when every feature has one width)."""
    u = unit_width(dims)
    return [d // u for d in dims]


class LaneLayout:
    """The owner's cold lookup as lanes: one TBE call per lane (one per table group).

    The TBE pools one batch size per call, so each feature of a table that receives the global
    batch ("heavy") is looked up as ``slots[f]`` (W) virtual features of the same table, its bags
    filling them in order (bag q in slot ``q // batch``, row ``q % batch``): one batch serves the
    whole group. Heavy multi-hot tables (and, with weight decay, every heavy table) get a lane of
    their own instead (lookup.py). A lane's output is ``[batch_g, widths of its slots]``; the lane
    outputs, flattened one after another, are the owner's cold output (docs/architecture.md §2
    step 3, §4 Cells).

    Args:
        lane_features: per lane, its features (indices in the sharding's feature order).
        dims: output width of each feature (sharding order).
        slots: virtual features per feature (sharding order; None: 1 each)."""

    def __init__(self, lane_features: List[List[int]], dims: List[int], device: torch.device,
                 slots: Optional[List[int]] = None) -> None:
        F = self.num_features = len(dims)
        self.lane_features = lane_features
        self.slots = slots = list(slots) if slots is not None else [1] * F
        self.virtual = any(n > 1 for n in slots)
        self.order = [f for fs in lane_features for f in fs]  # lane order -> sharding feature
        units = partial_units(dims)
        self.unit = unit_width(dims)  # elements per unit
        self.one_unit = all(u == 1 for u in units)  # every bag's vector is one unit (a row)
        lane_of, local_of, unit_local = [0] * F, [0] * F, [0] * F
        lane_units, self.lane_slots = [], []
        for g, fs in enumerate(lane_features):  # set-up time loop over lanes
            off = slot = 0
            for f in fs:
                lane_of[f], local_of[f], unit_local[f] = g, slot, off
                off += units[f] * slots[f]
                slot += slots[f]
            lane_units.append(off)
            self.lane_slots.append(slot)
        as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        self.lane_of, self.local_of, self.unit_local, self.units = map(as_t, (lane_of, local_of, unit_local, units))
        self._host = (lane_of, local_of if self.one_unit else unit_local, local_of, lane_units)
        self.lane_units = lane_units  # per lane, output units per row
        # what the fused unpack reads (fused.py): per feature its lane (-1: none), first slot, slots, units
        # before it in a row and units per bag; per lane its slots and units per row
        in_lane = set(self.order)
        self.feature_table = as_t([[g if f in in_lane else -1 for f, g in enumerate(lane_of)], local_of, slots,
                                   self._host[1], units])
        self.lane_table = as_t([self.lane_slots, lane_units]).view(2, len(lane_units))
        # per step's lane batches: per feature where its bags start in the outputs and in the lengths, and its
        # lane's batch, worked out on the host and copied to the device once (both position calls share it)
        self._per_feature: Tuple[Optional[Tuple[int, ...]], Optional[torch.Tensor]] = (None, None)
        self.host_units = units  # per feature, on the host: totals of positions without a sync
        self.order_t = as_t(self.order)
        self._orders: Dict[int, torch.Tensor] = {}
        self._units_per_row = as_t(lane_units)
        # per feature, its lane's units per row (none without lanes: such a rank places no bag);
        # one int when every feature's lane has the same (then no per-bag gather of it)
        widths = [lane_units[g] for g in lane_of] if lane_units else []
        self._feature_width = as_t(widths)
        self._one_width = widths[0] if len(set(widths)) == 1 else None

    def batches(self, bags: List[int]) -> List[int]:
        """Each lane's batch for a step with ``bags[f]`` bags per feature (host ints): the
        largest count per slot, at least 1."""
        return [max([1] + [-(-bags[f] // self.slots[f]) for f in fs]) for fs in self.lane_features]

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

    def host_offsets(self, batches: List[int]) -> List[int]:
        """``3 F`` host ints for lanes of ``batches`` rows: per feature, where its lane's output starts plus its own
        offset in a row (units); where its first slot starts in the lanes' lengths; its lane's batch."""
        lane_of, in_row, local_of, lane_units = self._host
        out_at = starts([b * u for b, u in zip(batches, lane_units)])
        len_at = starts([b * n for b, n in zip(batches, self.lane_slots)])
        return ([out_at[g] + o for g, o in zip(lane_of, in_row)]
                + [len_at[g] + s * batches[g] for g, s in zip(lane_of, local_of)]
                + [batches[g] for g in lane_of])

    def _feature_offsets(self, batches: List[int], device: torch.device) -> torch.Tensor:
        """:meth:`host_offsets` as ``[3, F]`` on the device: copied once per step (both position calls share it)."""
        key = tuple(batches)
        if self._per_feature[0] != key:
            self._per_feature = (key, host_to_device(self.host_offsets(batches), device).view(3, -1))
        offsets = self._per_feature[1]
        assert offsets is not None
        return offsets

    def lengths_positions(self, bags: List[int], batches: List[int], device: torch.device) -> torch.Tensor:
        """Where the bags go in the lanes' lengths, ``[slots_g, batch_g]`` lane after lane, for ``bags[f]`` bags
        of each feature f (host ints), feature after feature in lane order (a feature's slots are consecutive,
        so its bags simply follow on from its first): one segment gather sized on the host."""
        if not self.lane_features:
            return self._no_lanes(torch.empty(sum(bags), dtype=torch.int64, device=device))
        F = self.num_features
        first = self.host_offsets(batches)[F:2 * F]
        return host_segment_positions([first[f] for f in self.order], [bags[f] for f in self.order], device)

    @staticmethod
    def _no_lanes(q: torch.Tensor) -> torch.Tensor:
        """No lanes: a rank that holds no cold rows, which receives no bags (a shape check, no sync)."""
        if q.numel():
            raise ValueError(f"{q.numel()} bags to place in a layout with no lanes (this rank holds no cold rows)")
        return q.new_empty(0, dtype=torch.int64)

    def units_of(self, bags_per_feature: List[int]) -> int:
        """How many units ``bags_per_feature[f]`` bags of each feature f span (host ints)."""
        return sum(n * u for n, u in zip(bags_per_feature, self.host_units))

    def positions(self, q: torch.Tensor, feature: torch.Tensor, batches: List[int],
                  total: Optional[int] = None) -> torch.Tensor:
        """Positions (units, rows of ``[-1, unit]``) of the q-th bags of ``feature`` in the
        concatenated lane outputs of a step whose lanes had ``batches`` rows. ``total``: how
        many units the bags span, when known on the host (else, with several widths, reading
        it is a host sync)."""
        if not self.lane_features:
            return self._no_lanes(q)
        offsets = self._feature_offsets(batches, q.device)
        start = offsets[0]
        slot = None
        if self.virtual:  # bag q of a feature is row q % batch of its slot q // batch
            batch = offsets[2].index_select(0, feature)
            slot = torch.div(q, batch, rounding_mode="floor")
            q = q - slot * batch
        width = self._one_width if self._one_width is not None else self._feature_width.index_select(0, feature)
        first = start.index_select(0, feature) + q.to(torch.int64) * width
        if self.one_unit:
            return first if slot is None else first + slot
        units = self.units.index_select(0, feature)
        return segment_positions(first if slot is None else first + slot * units, units, total)


class CellPositions:
    """Cells ``row * F + feature`` of a pooled output -> positions in its units: the output
    as one lane of all F features (cells as they are when every feature has one width)."""

    def __init__(self, dims: List[int], device: torch.device) -> None:
        self.num_features = len(dims)
        self.layout = LaneLayout([list(range(len(dims)))], dims, device)
        # the fused ops' view (fused.receive_plan): per feature its units before it in a row and per bag
        self.fused_table = self.layout.feature_table[3:5].contiguous()
        self.row_units = self.layout.lane_units[0] if dims else 0

    def __call__(self, cells: torch.Tensor, total: Optional[int] = None) -> torch.Tensor:
        """``total``: how many units the cells' bags span, when known on the host (no sync)."""
        if self.layout.one_unit:
            return cells
        F = self.num_features
        return self.layout.positions(torch.div(cells, F, rounding_mode="floor"), cells % F, [0], total)
