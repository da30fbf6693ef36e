"""The cold ids' exchange (cold_all_to_all.py, fused.py) against a reference built from what was sent.

Each rank routes a random batch (some ids to each owner, some hot) through ``split_pack``, the exchange
and ``unpack_cold`` over a real gloo group, step after step: the owner's TBE inputs (one fixed-batch KJT
per lane), where each received bag's partial sum goes in the output all-to-all's send buffer, the
reports and the split sizes must be exactly what a plain loop over the senders' batches says - for 1
and 3 ranks, weighted or not, one lane or two, with rooms kept, outgrown (a spill) and resized, through
the fused ops and through their composed reference.
"""

import pytest
import torch

from tests.multiprocess import run_ranks

F, B, ROWS = 3, 4, 12
LANES = {"one": [[0, 1, 2]], "two": [[0, 2], [1]]}
DIM = 4


def _route_map(world: int) -> torch.Tensor:
    """Key ``f * ROWS + id`` -> bucket (an owner, or ``world``: hot) and row there (the key itself)."""
    g = torch.Generator().manual_seed(7)
    keys = torch.arange(F * ROWS)
    return keys * (world + 1) + torch.randint(0, world + 1, (F * ROWS,), generator=g)


def _batch(rank: int, world: int, weighted: bool, step: int, most: int):
    g = torch.Generator().manual_seed(100 + rank + 1000 * step)
    lengths = torch.randint(0, most + 1, (F * B,), generator=g)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return values, lengths, weights


def _extras(rank: int):
    g = torch.Generator().manual_seed(200 + rank)
    per_feature = torch.randint(0, 3, (F,), generator=g)
    rows = torch.randint(0, 50, (int(per_feature.sum()),), generator=g)
    return torch.repeat_interleave(torch.arange(F), per_feature), rows, per_feature.tolist()


# per step the most ids per bag: rooms sized by the first exchange are kept, then outgrown (a spill: a
# second all-to-all), then far too large (resized), then kept again
STEPS = [3, 3, 30, 30, 1, 1]


def _rank(rank, world, weighted, lanes, composed_ops):
    import os

    import torch.distributed as dist

    from torchrec_hybrid.sharding import cold_all_to_all, fused
    from torchrec_hybrid.sharding.cells import LaneLayout

    if composed_ops:  # this rank's process only: the composed reference instead of the fused ops
        os.environ["TORCHREC_HYBRID_FUSED_OPS"] = "0"
        fused._state.clear()
    cold_all_to_all.ROOM_PAD = 30  # this rank's process only: rooms the size of these runs
    a2a = cold_all_to_all.ColdIdsAllToAll(dist.group.WORLD, F, torch.device("cpu"))
    route_map = _route_map(world).to(torch.int32)
    offsets = torch.arange(F, dtype=torch.int64) * ROWS
    layout_lanes = LaneLayout(lanes, [DIM] * F, torch.device("cpu"))
    extra_features, extra_rows, extra_per_feature = _extras(rank)
    report = torch.tensor([rank, 7, -1, 2], dtype=torch.int32)
    out = []
    for step, most in enumerate(STEPS):
        values, lengths, weights = _batch(rank, world, weighted, step, most)
        before = a2a.layout
        layout = a2a.layout_for(2 * F + report.numel() + 1)
        pack = fused.split_pack(values, lengths, weights, route_map, offsets, world, report, layout, None)
        rows_in, work = a2a.start(pack, layout)
        if work is not None:
            work.wait()

        def unpack(ex):
            s = ex.sizes
            bags = [n + e for n, e in zip(s.feature_bags, extra_per_feature)]
            batches = layout_lanes.batches(bags)
            got = fused.unpack_cold(ex.rows_in, ex.rest_in, ex.layout, s.recv_words, F, weighted, layout_lanes,
                                    batches, extra_features, extra_rows, extra_per_feature, s.return_units,
                                    s.feature_bags, s.feature_ids)
            return got, batches, s

        got, batches, sizes = a2a.received(pack, layout, rows_in, weighted, report.numel(), unpack).wait()
        hot = pack.hot_offsets.to(torch.int64)
        out.append(dict(
            lengths=got.lengths.tolist(), ids=got.ids.tolist(),
            weights=None if got.weights is None else got.weights.tolist(), batches=batches,
            send_index=got.send_index.tolist(), row_pos=got.row_pos.tolist(), reports=sizes.reports,
            split=[sizes.return_units, sizes.sent_units, sum(sizes.sent_bags), sizes.feature_bags, sizes.feature_ids],
            hot_rows=pack.hot_rows[int(hot[0]):int(hot[-1])].tolist(), hot_lengths=hot.diff().tolist(),
            spills=a2a.spills, kept=a2a.layout is before, send=a2a.layout.rooms, recv=a2a.layout.recv_rooms))
    return out


def _sent_bags(source: int, owner: int, world: int, weighted: bool, step: int, most: int):
    """The bags ``source`` sends ``owner``, per feature in sample order: (sample, rows, weights) - a plain loop."""
    values, lengths, weights = _batch(source, world, weighted, step, most)
    route = _route_map(world)
    out = [[] for _ in range(F)]
    i = 0
    for f in range(F):
        for b in range(B):
            n = int(lengths[f * B + b])
            rows, ws = [], []
            for k in range(i, i + n):
                e = int(route[f * ROWS + int(values[k])])
                if e % (world + 1) == owner:
                    rows.append(e // (world + 1))
                    ws.append(float(weights[k]) if weighted else None)
            if rows:
                out[f].append((b, rows, ws))
            i += n
    return out


def _expected(owner: int, world: int, weighted: bool, lanes, step: int, most: int):
    ext_features, ext_rows, ext_per_feature = _extras(owner)
    bags = [[] for _ in range(F)]  # per feature: (length, rows, weights), sources in rank order, then extras
    arrival = []  # (source, feature, q): the received bags in the order their partial sums go home
    for s in range(world):
        for f, fb in enumerate(_sent_bags(s, owner, world, weighted, step, most)):
            for _, rows, ws in fb:
                arrival.append((s, f, len(bags[f])))
                bags[f].append((len(rows), rows, ws))
    received = [len(b) for b in bags]
    e0 = 0
    for f in range(F):
        for r in ext_rows[e0:e0 + ext_per_feature[f]].tolist():
            bags[f].append((1, [r], [1.0] if weighted else []))
        e0 += ext_per_feature[f]
    lengths, ids, wts, batches, base, pos = [], [], [], [], 0, {}
    for fs in lanes:
        batch = max(1, max(len(bags[f]) for f in fs))
        block = [[0] * batch for _ in fs]
        for i, f in enumerate(fs):
            for q, (n, rows, ws) in enumerate(bags[f]):
                block[i][q] = n
                pos[(f, q)] = base + q * len(fs) + i  # one unit (row of DIM) per bag: [batch, features] rows
                ids.extend(rows)
                wts.extend(ws)
        lengths.extend(x for row in block for x in row)
        batches.append(batch)
        base += batch * len(fs)
    rows_pos = [pos[(f, received[f] + k)] for f in range(F) for k in range(ext_per_feature[f])]
    send_index = []
    for s in range(world):
        send_index += [pos[(f, q)] for src, f, q in arrival if src == s] + rows_pos
    return dict(lengths=lengths, ids=ids, weights=wts if weighted else None, batches=batches, send_index=send_index,
                row_pos=rows_pos)


def _split(owner: int, world: int, weighted: bool, step: int, most: int):
    """The output all-to-all's split sizes and the per-feature totals the exchange must report."""
    into = [_sent_bags(s, owner, world, weighted, step, most) for s in range(world)]
    mine = [_sent_bags(owner, d, world, weighted, step, most) for d in range(world)]
    returned = [sum(len(fb) for fb in into[s]) for s in range(world)]
    partial = [sum(len(fb) for fb in mine[d]) for d in range(world)]
    bags = [sum(len(into[s][f]) for s in range(world)) for f in range(F)]
    id_totals = [sum(len(rows) for s in range(world) for _, rows, _ in into[s][f]) for f in range(F)]
    return [returned, partial, sum(partial), bags, id_totals]


def _hot(rank: int, world: int, weighted: bool, step: int, most: int):
    values, lengths, _ = _batch(rank, world, weighted, step, most)
    route = _route_map(world)
    rows, per_bag, i = [], [], 0
    for f in range(F):
        for b in range(B):
            n, k0 = int(lengths[f * B + b]), len(rows)
            for k in range(i, i + n):
                e = int(route[f * ROWS + int(values[k])])
                if e % (world + 1) == world:
                    rows.append(e // (world + 1))
            per_bag.append(len(rows) - k0)
            i += n
    return rows, per_bag


@pytest.mark.parametrize("composed_ops", [False, True], ids=["fused", "composed"])
@pytest.mark.parametrize("world,weighted,lanes", [(1, False, "one"), (3, False, "two"), (3, True, "one"),
                                                  (2, True, "two")])
def test_owners_receive_exactly_what_was_sent(world, weighted, lanes, composed_ops):
    """Step after step on one exchange: header and room in one all-to-all, rooms kept while the runs fit
    them, a run past its room sent in a second all-to-all, rooms resized after a run that outgrew them or
    left them far too large: every owner's lane inputs and send plan, every split size and report are
    what the senders' batches make, both ends of each pair agree on its room, every rank on the spills."""
    out = run_ranks(_rank, world, weighted=weighted, lanes=LANES[lanes], composed_ops=composed_ops)
    for owner, steps in enumerate(out):
        for step, got in enumerate(steps):
            want = _expected(owner, world, weighted, LANES[lanes], step, STEPS[step])
            for key in ("lengths", "ids", "weights", "batches", "send_index", "row_pos"):
                assert got[key] == want[key], (owner, step, key)  # weights: the same floats, bit for bit
            assert got["split"] == _split(owner, world, weighted, step, STEPS[step]), (owner, step)
            assert got["reports"] == [w for s in range(world) for w in (s, 7, -1, 2)], (owner, step)
            rows, per_bag = _hot(owner, world, weighted, step, STEPS[step])
            assert got["hot_rows"] == rows and got["hot_lengths"] == per_bag, (owner, step)
            for q in range(world):
                assert out[q][step]["recv"][owner] == got["send"][q], (owner, q, step)  # one room, two ends
        assert [s["spills"] for s in steps] == [s["spills"] for s in out[0]], owner  # every rank saw the flags
    spills = [s["spills"] for s in out[0]]
    assert spills[1] == 0 and spills[2] == 1, spills  # 30 ids per bag outgrow rooms sized for 3 or fewer
    kept = [s["kept"] for s in out[0]]
    assert kept[1] and not kept[2] and any(kept[3:]), kept  # rooms kept across some steps, resized at others


def test_next_room_keeps_a_room_the_run_fits_and_half_fills():
    from torchrec_hybrid.sharding.cold_all_to_all import ROOM_MIN_SLACK, next_room, room_for

    assert next_room(None, 1000) == room_for(1000) > 1000 * ROOM_MIN_SLACK  # the first exchange sizes it
    room = room_for(1000)
    assert next_room(room, 1000) == room and next_room(room, 800) == room  # fits: kept
    assert next_room(room, room) == room_for(room)  # no slack left: resized up
    assert next_room(room, 100) == room_for(100)  # far too large: resized down
