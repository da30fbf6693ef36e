"""The cold ids' wire format (cold_all_to_all.py) against a reference built from what was sent.

Each rank sends random bags (some (destination, feature) runs empty) and a report; the owner's
TBE inputs (one fixed-batch KJT per lane of features), where its bags sit in the lanes'
concatenated output and the reports must be exactly what the senders' bags and the extra bags
say, for 1 and 3 ranks, weighted or not, with one lane or two.
"""

import pytest
import torch

from tests.multiprocess import run_ranks

F = 3
LANES = {"one": [[0, 1, 2]], "two": [[0, 2], [1]]}
DIM = 4


def _sent(rank: int, world: int, weighted: bool, step: int = 0, most: int = 3):
    g = torch.Generator().manual_seed(100 + rank + 1000 * step)
    counts = torch.randint(0, most + 1, (world, F), generator=g)
    counts[0, 1] = 0  # an empty run on every rank
    lengths = torch.randint(1, 4, (int(counts.sum()),), generator=g)
    rows = torch.randint(0, 50, (int(lengths.sum()),), generator=g)
    weights = torch.rand(rows.numel(), generator=g) if weighted else None
    return counts, lengths, rows, weights


def _extras(rank: int):
    g = torch.Generator().manual_seed(200 + rank)
    per_feature = torch.randint(0, 3, (F,), generator=g)
    rows = torch.randint(0, 50, (int(per_feature.sum()),), generator=g)
    return per_feature, rows


def _rank(rank, world, weighted, lanes):
    import torch.distributed as dist

    from torchrec_hybrid.sharding.cold_all_to_all import ColdIdsAllToAll

    return _exchange(ColdIdsAllToAll(dist.group.WORLD, F, torch.device("cpu")), rank, world, weighted, lanes)


def _exchange(a2a, rank, world, weighted, lanes, step: int = 0, most: int = 3):
    from torchrec_hybrid.sharding.cells import LaneLayout
    from torchrec_hybrid.sharding.cold_all_to_all import ExtraBags

    counts, lengths, rows, weights = _sent(rank, world, weighted, step, most)
    # ids per (destination, feature): segment sums of the lengths
    ids = torch.zeros(world * F, dtype=torch.int64).index_add_(
        0, torch.repeat_interleave(torch.arange(world * F), counts.view(-1)), lengths)
    report = torch.tensor([rank, 7, -1, 2], dtype=torch.int32)
    bags = a2a(counts.view(-1), ids, lengths, rows, weights, report).wait().wait()
    per_feature, extra_rows = _extras(rank)
    layout = LaneLayout(lanes, [DIM] * F, torch.device("cpu"))
    keys = [[f"f{f}" for f in fs] for fs in lanes]
    extra = ExtraBags(torch.repeat_interleave(torch.arange(F), per_feature), extra_rows, F)
    kjts, batches, rows_per_feature, (q, feature) = bags.lane_inputs(layout, keys, extra)
    out = dict(lengths=[k.lengths().tolist() for k in kjts], values=[k.values().tolist() for k in kjts],
               weights=[None if k.weights_or_none() is None else k.weights().tolist() for k in kjts],
               stride=[k.stride() for k in kjts], keys=[k.keys() for k in kjts],
               length_per_key=[k.length_per_key() for k in kjts], positions=layout.positions(q, feature, batches),
               rows_per_feature=rows_per_feature, reports=bags.reports, counts=bags.bag_counts,
               split=[bags.host_return_units, bags.host_partial_units, bags.host_sent_bags,
                      bags.host_feature_bags, bags.host_feature_ids])
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in out.items()}  # plain data across processes


def _expected(owner: int, world: int, weighted: bool, lanes, step: int = 0, most: int = 3):
    sent = [_sent(s, world, weighted, step, most) for s in range(world)]
    per_feature, extra_rows = _extras(owner)
    bags = [[] for _ in range(F)]  # per feature: (length, ids, weights), sources in rank order
    cells = []
    for s, (counts, lengths, rows, weights) in enumerate(sent):
        bag0 = int(counts.view(-1)[: owner * F].sum())
        id0 = int(lengths[:bag0].sum())
        for f in range(F):
            for _ in range(int(counts[owner, f])):
                n = int(lengths[bag0])
                cells.append((f, len(bags[f])))
                bags[f].append((n, rows[id0:id0 + n], None if weights is None else weights[id0:id0 + n]))
                bag0, id0 = bag0 + 1, id0 + n
    received = [len(b) for b in bags]
    extra0 = 0
    for f in range(F):
        for r in extra_rows[extra0:extra0 + int(per_feature[f])]:
            bags[f].append((1, r.view(1), torch.ones(1) if weighted else None))
        extra0 += int(per_feature[f])
    # per lane: its features' bags as [features, batch] (batch: the lane's largest count);
    # the lanes' outputs [batch, features * DIM] concatenated, as rows of DIM
    out = dict(lengths=[], values=[], weights=[], stride=[], keys=[], length_per_key=[])
    base, row_of = 0, {}
    for fs in lanes:
        batch = max(1, max(len(bags[f]) for f in fs))
        lengths = torch.zeros(len(fs), batch, dtype=torch.int32)
        for i, f in enumerate(fs):
            lengths[i, : len(bags[f])] = torch.tensor([b[0] for b in bags[f]], dtype=torch.int32)
            for qq in range(len(bags[f])):
                row_of[(f, qq)] = base + qq * len(fs) + i
        out["lengths"].append(lengths.view(-1).tolist())
        out["values"].append(torch.cat([b[1] for f in fs for b in bags[f]] + [torch.empty(0, dtype=torch.int64)])
                             .tolist())
        out["weights"].append(torch.cat([b[2] for f in fs for b in bags[f]] + [torch.empty(0)]).tolist()
                              if weighted else None)
        out["stride"].append(batch)
        out["keys"].append([f"f{f}" for f in fs])
        out["length_per_key"].append(lengths.sum(1).tolist())
        base += batch * len(fs)
    return dict(out, positions=[row_of[c] for c in cells], rows_per_feature=received)


@pytest.mark.parametrize("lanes", sorted(LANES))
@pytest.mark.parametrize("world,weighted", [(1, False), (3, False), (3, True)])
def test_owner_receives_exactly_what_was_sent(world, weighted, lanes):
    out = run_ranks(_rank, world, weighted=weighted, lanes=LANES[lanes])
    for owner, got in enumerate(out):
        want = _expected(owner, world, weighted, LANES[lanes])
        for key in ("lengths", "values", "weights", "stride", "keys", "length_per_key", "positions",
                    "rows_per_feature"):
            assert got[key] == want[key], (owner, key)  # weights: bit-exact floats
        assert got["reports"] == [[s, 7, -1, 2] for s in range(world)], owner
        assert got["counts"] == [_sent(s, world, weighted)[0][owner].tolist() for s in range(world)], owner


# per step the most bags per (destination, feature) run: the rooms the first step sizes are kept, then
# outgrown (a spill: a second all-to-all), then far too large (resized), then kept again
STEPS = [3, 3, 30, 30, 1, 1]


def _rank_steps(rank, world, weighted, lanes, units):
    import torch.distributed as dist

    from torchrec_hybrid.sharding import cold_all_to_all

    cold_all_to_all.ROOM_PAD = 30  # this rank's process only: rooms the size of these runs
    a2a = cold_all_to_all.ColdIdsAllToAll(dist.group.WORLD, F, torch.device("cpu"), units)
    out = []
    for step, most in enumerate(STEPS):
        rooms = a2a.rooms
        got = _exchange(a2a, rank, world, weighted, lanes, step, most)
        out.append(dict(got, spills=a2a.spills, kept=a2a.rooms is rooms, send=a2a.rooms.send,
                        recv=a2a.rooms.recv))
    return out


def _split(owner: int, world: int, weighted: bool, step: int, most: int, units):
    """The output all-to-all's split sizes and the per-feature totals the owner's exchange must report."""
    sent = [_sent(s, world, weighted, step, most) for s in range(world)]
    u = torch.tensor(units or [1] * F)
    ids = [torch.zeros(world * F, dtype=torch.int64).index_add_(
        0, torch.repeat_interleave(torch.arange(world * F), c.view(-1)), ln).view(world, F) for c, ln, _, _ in sent]
    mine = sent[owner][0]
    returned = [int((sent[q][0][owner] * u).sum()) for q in range(world)]
    partial = [int((mine[d] * u).sum()) for d in range(world)]
    bags = [int(sum(sent[q][0][owner, f] for q in range(world))) for f in range(F)]
    id_totals = [int(sum(ids[q][owner, f] for q in range(world))) for f in range(F)]
    return [returned, partial, int(mine.sum()), bags, id_totals]


@pytest.mark.parametrize("world,weighted,units", [(2, False, None), (3, True, None), (3, False, [1, 2, 1])])
def test_fused_exchanges_receive_exactly_what_was_sent(world, weighted, units):
    """Step after step on one exchange: header and payload in one all-to-all from the second, rooms kept
    while the runs fit them, a run past its room sent in a second all-to-all, rooms resized after a run
    that outgrew them or left them far too large: every owner still receives exactly what was sent, the
    output all-to-all's split sizes (in units: several per bag where features differ in width) and the
    per-feature totals are what the senders' bags make, and both ends of each pair agree on its room."""
    lanes = LANES["two"]
    out = run_ranks(_rank_steps, world, weighted=weighted, lanes=lanes, units=units)
    for owner, steps in enumerate(out):
        for step, got in enumerate(steps):
            want = _expected(owner, world, weighted, lanes, step, STEPS[step])
            for key in ("lengths", "values", "weights", "stride", "keys", "length_per_key", "positions",
                        "rows_per_feature"):
                assert got[key] == want[key], (owner, step, key)
            assert got["split"] == _split(owner, world, weighted, step, STEPS[step], units), (owner, step)
            for q in range(world):
                assert out[q][step]["recv"][owner] == got["send"][q], (owner, q, step)  # one room, two ends
        assert [s["spills"] for s in steps] == [s["spills"] for s in out[0]], owner  # every rank saw the flags
    spills = [s["spills"] for s in out[0]]
    assert spills[0] == 0 and spills[2] > spills[1], spills  # 30 per run outgrows rooms sized for 3 or fewer
    kept = [s["kept"] for s in out[0]]
    assert any(kept[1:]) and not all(kept[1:]), kept  # rooms kept across some steps, resized at others


def test_next_room_keeps_a_room_the_run_fits_and_half_fills():
    from torchrec_hybrid.sharding.cold_all_to_all import ROOM_MIN_SLACK, next_room, room_for

    assert next_room(None, 1000) == room_for(1000) > 1000 * ROOM_MIN_SLACK  # the first exchange sizes it
    room = room_for(1000)
    assert next_room(room, 1000) == room and next_room(room, 800) == room  # fits: kept
    assert next_room(room, room) == room_for(room)  # no slack left: resized up
    assert next_room(room, 100) == room_for(100)  # far too large: resized down
