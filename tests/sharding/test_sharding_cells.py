"""Units of the hybrid's pooled data: rows when all features share a width, else runs of the
widths' common divisor; positions checked against the element layout of the lane outputs."""

import torch

from torchrec_hybrid.sharding.cells import CellPositions, LaneLayout, partial_units, unit_width


def _element_runs(lane_features, dims, batches, bags):
    """Reference: the elements of each (q, feature) bag in the concatenated, flattened lane
    outputs ``[batch_g, sum of the lane's widths]`` (test-time loops)."""
    out, base = [], {}
    start = 0
    for g, fs in enumerate(lane_features):
        width = sum(dims[f] for f in fs)
        off = 0
        for f in fs:
            base[f] = (start, width, off)
            off += dims[f]
        start += batches[g] * width
    for q, f in bags:
        s, width, off = base[f]
        first = s + q * width + off
        out.extend(range(first, first + dims[f]))
    return out


def test_mixed_widths_move_in_common_divisor_units():
    dims = [64, 16, 32, 16]
    assert unit_width(dims) == 16 and partial_units(dims) == [4, 1, 2, 1]
    lane_features, batches = [[0, 2], [1, 3]], [3, 5]
    lanes = LaneLayout(lane_features, dims, torch.device("cpu"))
    bags = [(2, 0), (0, 1), (4, 3), (1, 2), (0, 0), (4, 1)]
    q = torch.tensor([b[0] for b in bags])
    f = torch.tensor([b[1] for b in bags])
    units = lanes.positions(q, f, batches)
    assert units.numel() == sum(partial_units(dims)[b[1]] for b in bags)  # 4 units per 64-wide bag, not 64
    total = sum(b * sum(dims[x] for x in fs) for b, fs in zip(batches, lane_features))
    flat = torch.arange(total).view(-1, lanes.unit)
    assert flat.index_select(0, units).reshape(-1).tolist() == _element_runs(lane_features, dims, batches, bags)


def test_one_width_moves_rows_and_cells_stay_cells():
    dims = [32, 32, 32]
    assert unit_width(dims) == 32 and partial_units(dims) == [1, 1, 1]
    cells = torch.tensor([0, 4, 8, 5])
    assert torch.equal(CellPositions(dims, torch.device("cpu"))(cells), cells)
    mixed = CellPositions([32, 16], torch.device("cpu"))  # units of 16: a row is 2 + 1 units
    # cell 3 (row 1, feature 1) is unit 3 + 2 = 5; cell 2 (row 1, feature 0) units 3 and 4
    assert mixed(torch.tensor([3])).tolist() == [5]
    assert mixed(torch.tensor([2])).tolist() == [3, 4]


def test_virtual_features_take_a_heavy_features_bags_in_turn():
    """A feature looked up as several virtual features (slots) fills them in order: bag q in
    slot q // batch, row q % batch of its lane; positions checked against the element layout
    and the lengths layout ``[slots_g, batch_g]`` (test-time loops)."""
    dims, slots = [64, 16, 32, 16], [1, 3, 1, 2]
    lane_features = [[0, 1], [2, 3]]
    lanes = LaneLayout(lane_features, dims, torch.device("cpu"), slots)
    counts = [2, 7, 1, 5]  # bags per feature this step
    batches = lanes.batches(counts)
    assert batches == [3, 3]  # feature 1: 7 bags over 3 slots; feature 3: 5 over 2
    bags = [(q, f) for f in range(4) for q in range(counts[f])]
    q = torch.tensor([b[0] for b in bags])
    f = torch.tensor([b[1] for b in bags])
    expected, expected_by_feature, start, len_start = [], {}, {}, {}
    elements = lengths = 0
    for g, fs in enumerate(lane_features):
        width = sum(dims[x] * slots[x] for x in fs)
        off = slot = 0
        for x in fs:
            start[x] = (elements, width, off, len_start.setdefault(g, lengths) + slot * batches[g], batches[g])
            off, slot = off + dims[x] * slots[x], slot + slots[x]
        elements += batches[g] * width
        lengths += batches[g] * slot
    for qq, x in bags:
        e0, width, off, l0, batch = start[x]
        first = e0 + (qq % batch) * width + off + (qq // batch) * dims[x]
        expected.extend(range(first, first + dims[x]))
        expected_by_feature.setdefault(x, []).append(l0 + qq)
    units = lanes.positions(q, f, batches)
    flat = torch.arange(elements).view(-1, lanes.unit)
    assert flat.index_select(0, units).reshape(-1).tolist() == expected
    per_feature = [sum(1 for _, x in bags if x == y) for y in range(len(dims))]
    in_lane_order = [l0 for y in lanes.order for l0 in expected_by_feature[y]]
    assert lanes.lengths_positions(per_feature, batches, torch.device("cpu")).tolist() == in_lane_order
    assert lanes.lane_slots == [4, 3]


def test_a_rank_with_no_lanes_has_no_positions():
    """A rank that holds no cold rows of its tables (every lane dropped) looks nothing up: its
    positions are empty, whatever the widths (the lookup asks with no bags)."""
    for dims in ([8, 8], [8, 16]):
        lanes = LaneLayout([], dims, torch.device("cpu"))
        q, f = torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
        assert lanes.positions(q, f, [], total=0).numel() == 0
        assert lanes.lengths_positions([0] * len(dims), [], torch.device("cpu")).numel() == 0


def test_bags_for_a_layout_with_no_lanes_are_refused():
    lanes = LaneLayout([], [8, 8], torch.device("cpu"))
    q, f = torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    for call in (lambda: lanes.positions(q, f, [], total=3),
                 lambda: lanes.lengths_positions([3, 0], [], torch.device("cpu"))):
        try:
            call()
        except ValueError as e:
            assert "3 bags" in str(e) and "no lanes" in str(e)
        else:
            raise AssertionError("bags placed in a layout with no lanes")
