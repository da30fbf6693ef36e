"""The fused CPU ops (csrc/hybrid_ops.cpp) against their composed reference (sharding/composed.py).

One exchange is simulated in one process: W ranks' random batches are split and packed, each owner's
received rows are cut out of the senders' send rows (and the words past a room out of their payloads,
as the spill all-to-all sends them), then summarised, unpacked into lanes and planned for the output
all-to-all - every step by both implementations, which must agree exactly (weights bit for bit) on
every word that is read. Covers 1-4 ranks, int32 / int64 ids, weights or none, reports or none,
rooms that hold every run, none (the first exchange) or some, features of several widths (units),
lanes with virtual features, features in no lane, empty batches.
"""

import itertools

import pytest
import torch

from torchrec_hybrid.sharding import composed, fused
from torchrec_hybrid.sharding.cells import CellPositions, LaneLayout, partial_units
from torchrec_hybrid.sharding.composed import exchange_layout

pytestmark = pytest.mark.skipif(not fused.available(), reason="the fused ops are not built (scripts/setup.sh)")


def _batch(g, F, B, rows, weighted, dtype):
    lengths = torch.randint(0, 4, (F * B,), generator=g)
    lengths[torch.rand(F * B, generator=g) < 0.3] = 0
    per_feature = lengths.view(F, B).sum(1)
    values = torch.cat([torch.randint(0, rows[f], (int(per_feature[f]),), generator=g) for f in range(F)])
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return values.to(dtype), lengths.to(dtype), weights


def _case(seed, W, F, B, weighted, dtype, report_words, room_kind, units):
    g = torch.Generator().manual_seed(seed)
    rows = [int(x) for x in torch.randint(3, 40, (F,), generator=g)]
    offsets = torch.tensor([0] + list(itertools.accumulate(rows))[:-1], dtype=torch.int64)
    # the key map: every key to a bucket (an owner, or W: hot) and a row there
    total = sum(rows)
    route_map = (torch.randint(0, 30, (total,), generator=g) * (W + 1)
                 + torch.randint(0, W + 1, (total,), generator=g)).to(dtype)
    if room_kind == "none":
        rooms = [[0] * W for _ in range(W)]
    elif room_kind == "large":
        rooms = [[500] * W for _ in range(W)]
    else:
        rooms = [[int(x) for x in torch.randint(0, 12, (W,), generator=g)] for _ in range(W)]
    if F == 4:  # feature 2 lies in no lane of the owners (a 0-row column slice): its ids are never cold
        start = int(offsets[2])
        route_map[start:start + rows[2]] = (route_map[start:start + rows[2]] // (W + 1)) * (W + 1) + W
    # per feature the output units of a bag, as the sharding derives them from the widths (cells.partial_units)
    per_bag = partial_units(_dims(F, units))
    feature_units = None if all(u == 1 for u in per_bag) else torch.tensor(per_bag, dtype=torch.int64)
    batches = [_batch(g, F, B, rows, weighted, dtype) for _ in range(W)]
    report = [torch.randint(-5, 5, (report_words,), generator=g).to(torch.int32) for _ in range(W)]
    return dict(rows=rows, offsets=offsets, route_map=route_map, rooms=rooms, feature_units=feature_units,
                batches=batches, report=report, g=g)


def _dims(F, units):
    return [4 * u for u in (units or [1] * F)[:F]]


def _layout(c, r, W, F, report_words):
    head = 2 * F + report_words + 1
    return exchange_layout(c["rooms"][r], [c["rooms"][s][r] for s in range(W)], head, torch.device("cpu"))


def _split(impl, c, W, F, report_words):
    out = []
    for r, (values, lengths, weights) in enumerate(c["batches"]):
        out.append(impl.split_pack(values, lengths, weights, c["route_map"], c["offsets"], W, c["report"][r],
                                   _layout(c, r, W, F, report_words), c["feature_units"]))
    return out


def _received(packs, c, W, F, report_words, owner):
    """The owner's received rows (each source's header + room for it) and the words past the rooms."""
    head = 2 * F + report_words + 1
    rows, rest = [], []
    for q, p in enumerate(packs):
        rooms = c["rooms"][q]
        at = sum(head + r for r in rooms[:owner])
        rows.append(p.send_rows[at:at + head + rooms[owner]])
        words = p.stats[0].tolist()
        spilled = composed.spill_words(p.payload, words, rooms)
        over = [max(0, n - r) for n, r in zip(words, rooms)]
        start = sum(over[:owner])
        rest.append(spilled[start:start + over[owner]])
    return torch.cat(rows), torch.cat(rest)


def _hot(p):
    off = p.hot_offsets.to(torch.int64)
    rows = p.hot_rows[int(off[0]):int(off[-1])]
    weights = None if p.hot_weights is None else p.hot_weights[int(off[0]):int(off[-1])]
    return off - off[0], rows, weights


CASES = [
    # seed, W, F, B, weighted, dtype, report words, rooms, units
    (0, 1, 2, 5, False, torch.int64, 4, "none", None),
    (1, 2, 3, 4, True, torch.int32, 4, "some", None),
    (2, 3, 3, 6, False, torch.int32, 0, "large", None),
    (3, 4, 2, 3, True, torch.int64, 4, "some", [1, 2]),
    (4, 3, 4, 5, False, torch.int64, 0, "some", [2, 1, 1, 3]),
    (5, 2, 3, 0, True, torch.int32, 4, "none", None),  # an empty batch
    (6, 3, 1, 7, True, torch.int64, 4, "none", [2]),
    (7, 3, 3, 6, True, torch.int32, 4, "some", [1, 3, 2]),
]


@pytest.mark.parametrize("case", CASES, ids=[f"seed{c[0]}-W{c[1]}" for c in CASES])
def test_fused_ops_equal_their_composed_reference(case):
    seed, W, F, B, weighted, dtype, report_words, room_kind, units = case
    c = _case(seed, W, F, B, weighted, dtype, report_words, room_kind, units)
    ref, got = _split(composed, c, W, F, report_words), _split(fused, c, W, F, report_words)
    for r, (a, b) in enumerate(zip(ref, got)):
        words, bags = a.stats[0].sum(), a.stats[2].sum()
        assert torch.equal(a.stats, b.stats), r
        assert torch.equal(a.send_rows, b.send_rows), r
        assert torch.equal(a.payload[:words], b.payload[:words]), r
        assert torch.equal(a.sent_cells[:bags], b.sent_cells[:bags]), r
        assert torch.equal(a.sent_counts, b.sent_counts), r
        (ao, ar, aw), (bo, br, bw) = _hot(a), _hot(b)
        assert torch.equal(ao, bo) and torch.equal(ar, br), r
        assert (aw is None) == (bw is None) and (aw is None or torch.equal(aw, bw)), r
    # the owner's side, on the same received words
    lanes_of = [list(range(F))] if F < 3 else [[0, 2], [1]] if F == 3 else [[0, 3], [1]]  # F=4: feature 2 in no lane
    slots = [W if f == 0 and W > 1 else 1 for f in range(F)]  # feature 0 heavy: W virtual features
    dims = _dims(F, units)
    lanes = LaneLayout(lanes_of, dims, torch.device("cpu"), slots)
    for owner in range(W):
        rows_in, rest_in = _received(ref, c, W, F, report_words, owner)
        layout = _layout(c, owner, W, F, report_words)
        summary = composed.exchange_summary(rows_in, layout, F, c["feature_units"], ref[owner].stats)
        assert torch.equal(summary, fused.exchange_summary(rows_in, layout, F, c["feature_units"], got[owner].stats))
        host = summary.tolist()
        bags_in, ids_in = host[3 * W:5 * W:2], host[3 * W + 1:5 * W:2]
        return_units = host[5 * W:6 * W]
        feature_bags, feature_ids = host[6 * W:6 * W + F], host[6 * W + F:6 * W + 2 * F]
        runs = [b + (2 if weighted else 1) * n for b, n in zip(bags_in, ids_in)]
        assert sum(max(0, n - r) for n, r in zip(runs, layout.recv_rooms)) == rest_in.numel()
        in_lane = [f for fs in lanes_of for f in fs]
        assert all(feature_bags[f] == 0 for f in range(F) if f not in in_lane)
        picks = torch.randint(0, len(in_lane), (5,), generator=c["g"]).tolist()
        extra_features = torch.tensor(sorted(in_lane[i] for i in picks), dtype=torch.int64)  # sorted by feature
        extra_rows = torch.randint(0, 30, (extra_features.numel(),), generator=c["g"])
        extra_per_feature = torch.bincount(extra_features, minlength=F).tolist()
        batches = lanes.batches([n + e for n, e in zip(feature_bags, extra_per_feature)])
        args = (rows_in, rest_in, layout, runs, F, weighted, lanes, batches, extra_features, extra_rows,
                extra_per_feature, return_units, feature_bags, feature_ids)
        a, b = composed.unpack_cold(*args), fused.unpack_cold(*args)
        for name in ("lengths", "ids", "send_index", "source", "row_pos", "row_dst"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (owner, name)
        assert (a.weights is None) == (b.weights is None)
        assert a.weights is None or torch.equal(a.weights.view(torch.int32), b.weights.view(torch.int32))
    # the sample side's receive plan
    cells = CellPositions(dims, torch.device("cpu"))
    for r in range(W):
        p = ref[r]
        partial = p.stats[1].tolist()
        replica = [int(x) for x in torch.randint(0, 4, (W,), generator=c["g"])]
        order = torch.randint(0, max(1, sum(replica)), (7,), generator=c["g"]) if sum(replica) else torch.zeros(
            0, dtype=torch.int64)
        pooled = B * cells.row_units
        a = composed.receive_plan(p.sent_cells[:int(p.stats[2].sum())], cells, partial, replica, order, pooled)
        b = fused.receive_plan(got[r].sent_cells, cells, partial, replica, order, pooled)
        assert torch.equal(a.recv_pos, b.recv_pos) and torch.equal(a.row_src, b.row_src), r
        assert (a.replica_src is None) == (b.replica_src is None), r
        assert a.replica_src is None or torch.equal(a.replica_src, b.replica_src), r


def _hot_state(dims, features, hot_sizes):
    """A real one-group hot set of tables of widths ``dims`` (``features[t]`` features each, ``hot_sizes[t]``
    hot rows), on one rank (hot_state.build_hot_state)."""
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig, \
        ShardedEmbeddingTable
    from torchrec.modules.embedding_configs import DataType, PoolingType

    from torchrec_hybrid.sharding.hot_state import build_hot_state

    tables = [ShardedEmbeddingTable(num_embeddings=50, embedding_dim=d, name=f"t{t}", local_rows=50, local_cols=d,
                                    feature_names=[f"t{t}_f{i}" for i in range(n)])
              for t, (d, n) in enumerate(zip(dims, features))]
    group = GroupedEmbeddingConfig(DataType.FP32, PoolingType.SUM, False, False, EmbeddingComputeKernel.FUSED, tables)
    hot = [torch.arange(h, dtype=torch.int64) * 3 for h in hot_sizes]
    return build_hot_state([group], [hot], [[[0, 50]] * len(dims)], 1, 0, torch.device("cpu"))


@pytest.mark.parametrize("weighted,dims,dtype", [(False, [8, 8], torch.int32), (True, [8, 4], torch.int64),
                                                 (False, [4, 12, 4], torch.int64)])
def test_fused_hot_pooling_equals_the_dense_tbe_and_index_add(weighted, dims, dtype):
    """The fused hot pooling (one pass: FBGEMM's dense TBE over the replica, then the received units
    added at their positions) against those two composed, forward and both gradients."""
    features = [2] + [1] * (len(dims) - 1)
    state = _hot_state(dims, features, [5, 3, 4][:len(dims)])
    g = torch.Generator().manual_seed(3)
    F, B = sum(features), 6
    rep = state.replicas[0]
    lengths = torch.randint(0, 3, (F * B,), generator=g)
    table_of = [t for t, n in enumerate(features) for _ in range(n)]
    sizes = [5, 3, 4]
    rows = torch.cat([torch.randint(0, sizes[table_of[f]], (int(lengths[f * B:(f + 1) * B].sum()),), generator=g)
                      for f in range(F)]).to(dtype)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(dtype)
    weights = torch.rand(rows.numel(), generator=g) if weighted else None
    unit = 4
    total = B * sum(dims[table_of[f]] for f in range(F)) // unit
    recv_pos = torch.randint(0, total, (9,), generator=g)
    grad = torch.randn(B, sum(dims[table_of[f]] for f in range(F)), generator=g)
    out = {}
    for name, impl in (("composed", composed), ("fused", fused)):
        replica = torch.randn(rep.flat_size, generator=torch.Generator().manual_seed(5)).requires_grad_()
        recv = torch.randn(9 * unit, generator=torch.Generator().manual_seed(6)).requires_grad_()
        pooled = impl.hot_pool_add(state, replica, rows, offsets, weights, B, recv, recv_pos, unit)
        pooled.backward(grad)
        out[name] = (pooled.detach(), replica.grad, recv.grad)
    for a, b in zip(out["composed"], out["fused"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bad", ["none", "id", "weight", "both", "unknown_key"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_fused_id_check(bad, dtype):
    """fused.check_ids against the check written out in torch ops: the verdict (1: an id of a feature's key
    out of range, else 2: a non-finite weight, else 0), ids clamped and weights zeroed only where needed
    (the same tensors when nothing is), keys that are no feature left alone."""
    g = torch.Generator().manual_seed(11)
    counts = [5, 0, 7, 3]
    limit = torch.tensor([9, 4, 19, 2], dtype=dtype)
    feature_of_key = torch.tensor([0, 1, -1 if bad == "unknown_key" else 2, 3])
    values = torch.cat([torch.randint(0, int(lim) + 1, (n,), generator=g) for n, lim in zip(counts, limit)]).to(dtype)
    weights = torch.rand(values.numel(), generator=g)
    if bad in ("id", "both", "unknown_key"):
        values[6] = -3 if bad != "unknown_key" else 99  # in key 2 (no feature when unknown_key: not checked)
        values[13] = 7  # key 3, limit 2 ("unknown_key": in range, see below)
        if bad == "unknown_key":
            values[13] = 1
    if bad in ("weight", "both"):
        weights[2] = float("nan")
        weights[14] = float("inf")
    code, ids, w = fused.check_ids(values, limit, counts, feature_of_key, weights, True)
    key = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    known = feature_of_key[key] >= 0
    lim = limit[key]
    want_ids = torch.where(known, values.clamp(min=0).minimum(lim), values)
    bad_w = ~torch.isfinite(weights) & known
    want_code = 1 if bool((want_ids != values).any()) else 2 if bool(bad_w.any()) else 0
    assert int(code) == want_code
    assert torch.equal(ids, want_ids) and torch.equal(w, torch.where(bad_w, 0.0, weights))
    assert (ids is values) == (want_code != 1)  # no copy unless an id changed
    assert (w is weights) == (not bool(bad_w.any()))
