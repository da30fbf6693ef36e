"""frequency_hybrid must train exactly like stock table_wise (same init, same fused optimizer).

Every case builds both models in the same process group, feeds both the same batches, and
compares pooled outputs every step, then weights and fused optimizer state after training.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torchrec
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

from tests.models import (
    DEFAULT_HOT,
    OPTIMIZERS,
    build,
    expanded_batch,
    full_optimizer_state,
    full_weight,
    hot_ids,
    refused,
    skewed_batch,
    tables,
    variable_batch,
)
from tests.multiprocess import run_ranks
from torchrec_hybrid import HybridEmbeddingBagCollectionSharder, refresh_hot_sets

ALL_HOT = {"t0": [3, 7, 21, 35, 40], "t1": [0, 29, 5], "t2": [1], "t3": [16, 2]}
# a different hot set: tables grow, shrink, empty and fill, ids move between owners
NEW_HOT = {"t0": [0, 1, 2, 39], "t1": [0, 4, 11, 12, 13, 14, 28], "t2": [5, 22], "t3": []}


def _hybrid_forward(mh, kjt, step: int, refresh, hot_t):
    """One hybrid forward; at each step of ``refresh["at"]`` the hot sets switch first (to the
    next of ``refresh["hot"]``), or, with ``in_flight``, between this batch's input dist and its
    lookup (as under a pipeline)."""
    at = list(refresh["at"]) if refresh else []
    if step not in at:
        return mh(kjt).wait().to_dict(), hot_t
    new = hot_ids(refresh["hot"][at.index(step) % len(refresh["hot"])])
    if refresh.get("in_flight"):
        sebc = mh.module
        ctx = sebc.create_context()
        pending = sebc.input_dist(ctx, kjt)
        changed = refresh_hot_sets(mh, hot_ids=new)
        out = sebc.compute_and_output_dist(ctx, pending.wait().wait()).wait().to_dict()
    else:
        changed = refresh_hot_sets(mh, hot_ids=new)
        out = mh(kjt).wait().to_dict()
    assert any(changed.values()), changed
    assert all(torch.equal(v, torch.sort(new[k]).values) for k, v in mh.module.hot_ids().items())
    return out, new


def train_pair(rank, world, opt="sgd", mean=False, weighted=False, steps=5, kinds=None, ref_kinds=None, hot=None,
               mode="mixed", rank0_mode=None, refresh=None, variable=False, rows=None, keep=None):
    """Trains the hybrid and the table_wise model on the same batches and compares them; ``keep``: a list
    the hybrid model is appended to (for the caller's own checks; ranks return nothing else)."""
    configs = [dataclasses.replace(c, num_embeddings=(rows or {}).get(c.name, c.num_embeddings))
               for c in tables(mean=mean)]
    torch.manual_seed(0)
    ref = torchrec.EmbeddingBagCollection(tables=configs, is_weighted=weighted)
    hot_t = hot_ids(hot)
    kinds = kinds or {c.name: "hybrid" for c in configs}
    if ref_kinds is None:  # the same plan with table_wise in place of frequency_hybrid (column_wise for
        # column-wise cold: row-wise Adagrad keeps one accumulator per row of each column slice)
        ref_kinds = {t: ("cw" if k == "hybrid_cw" else "tw" if k.startswith("hybrid") else k) for t, k in kinds.items()}
    fused = OPTIMIZERS[opt]
    mh = build(configs, world, kinds, HybridEmbeddingBagCollectionSharder(hot_t, fused_params=dict(fused)),
               weighted=weighted)
    mt = build(configs, world, ref_kinds, EmbeddingBagCollectionSharder(fused_params=dict(fused)), weighted=weighted)
    mh.load_state_dict(ref.state_dict())
    mt.load_state_dict(ref.state_dict())
    keys = [f for c in configs for f in c.feature_names]
    for step in range(steps):
        m = rank0_mode if (rank == 0 and rank0_mode) else mode[step % len(mode)] if isinstance(mode, list) else mode
        kjt = skewed_batch(configs, keys, batch=6, seed=100 * step + rank, hot=hot_t, weighted=weighted, mode=m)
        ref_kjt = kjt
        if variable:  # a VBE batch: a different batch per feature and per rank
            kjt = ref_kjt = variable_batch(kjt, seed=100 * step + rank)
            if variable == "expanded":
                ref_kjt = expanded_batch(kjt)
        oh, hot_t = _hybrid_forward(mh, kjt, step, refresh, hot_t)
        ot = mt(ref_kjt).wait().to_dict()
        assert sorted(oh) == sorted(ot) == sorted(keys)
        vh = torch.cat([oh[k] for k in keys], dim=1)
        vt = torch.cat([ot[k] for k in keys], dim=1)
        torch.testing.assert_close(vh, vt, atol=1e-5, rtol=1e-5)
        coef = torch.randn(vt.shape, generator=torch.Generator().manual_seed(7 + step + rank))
        (vh * coef).sum().backward()
        (vt * coef).sum().backward()
    sh, st = mh.state_dict(), mt.state_dict()
    assert sorted(sh.keys()) == sorted(st.keys())
    for k in st:
        wh, wt = full_weight(sh[k]), full_weight(st[k])
        torch.testing.assert_close(wh, wt, atol=1e-5, rtol=1e-5)
        table = k.split(".")[1]
        if kinds.get(table) != "dp":
            assert not torch.equal(wt, full_weight(ref.state_dict()[k])), f"{k} never trained"
    oh_state = full_optimizer_state(mh.fused_optimizer, world)
    ot_state = full_optimizer_state(mt.fused_optimizer, world)
    assert sorted(oh_state) == sorted(ot_state)
    for k in oh_state:
        torch.testing.assert_close(oh_state[k], ot_state[k], atol=1e-5, rtol=1e-5)
    # hot replicas: a forward of one-hot-id bags pools exactly the owners' rows, bit for bit, on every rank
    _check_hot_replicas(mh, configs, kinds, hot_t, weighted, world, mean_rw=mean and "rw" in kinds.values())
    if keep is not None:
        keep.append(mh)


def _check_hot_replicas(mh, configs, kinds, hot_t, weighted: bool, world: int, mean_rw: bool) -> None:
    """One more forward whose bag b of each hybrid feature is that table's b-th hot id alone
    (weight 1): SUM and MEAN of one row are the row, so the output must equal the owners'
    rows in the state_dict exactly (``mean_rw``: up to TorchRec's MEAN divisor), the same on
    every rank (the replicas are copies of the owners' rows, they never drift)."""
    hybrid = [c for c in configs if kinds.get(c.name, "").startswith("hybrid") and hot_t[c.name].numel()]
    if not hybrid:
        return
    ids = {c.name: torch.unique(hot_t[c.name]) for c in hybrid}
    B = max(v.numel() for v in ids.values())
    keys = [f for c in configs for f in c.feature_names]
    table_of = {f: c.name for c in configs for f in c.feature_names}
    values, lengths = [], []
    for f in keys:
        v = ids.get(table_of[f], torch.empty(0, dtype=torch.int64))
        values.append(v)
        lengths.append((torch.arange(B) < v.numel()).to(torch.int32))
    vals = torch.cat(values)
    kjt = torchrec.KeyedJaggedTensor(keys=keys, values=vals, lengths=torch.cat(lengths),
                                     weights=torch.ones(vals.numel()) if weighted else None)
    out = mh(kjt).wait().to_dict()
    sh = mh.state_dict()
    for f in keys:
        t = table_of[f]
        if t not in ids:
            continue
        rows = out[f][: ids[t].numel()]
        owners = full_weight(sh[f"embedding_bags.{t}.weight"])[ids[t]]
        # TorchRec divides a module's every output by (1 + eps) when it holds a stock row-wise MEAN table
        tol = 2e-6 if mean_rw else 0.0
        torch.testing.assert_close(rows, owners, rtol=tol, atol=tol, msg=f"{t}: replica differs from the owners' rows")
        gathered = [torch.empty_like(rows) for _ in range(world)]
        dist.all_gather(gathered, rows.contiguous())
        assert all(torch.equal(gathered[0], g) for g in gathered), "hot replicas diverged"


@pytest.mark.parametrize("world,opt", [(w, o) for w in (1, 2) for o in ("sgd", "adagrad", "rowwise_adagrad",
                                                                     "emainplace_rowwise_adagrad")]
                         + [(4, "sgd"), (4, "rowwise_adagrad")])  # adagrad at 4 ranks: the layouts' tests
def test_hybrid_trains_like_table_wise(world, opt):
    run_ranks(train_pair, world, opt=opt)


def _build_small_table(rank, world, opt):
    configs = [dataclasses.replace(c, num_embeddings=3 if c.name == "t3" else c.num_embeddings) for c in tables()]
    sharder = HybridEmbeddingBagCollectionSharder(hot_ids({"t3": [1]}), fused_params=dict(OPTIMIZERS[opt]))
    return refused(lambda: build(configs, world, {c.name: "hybrid" for c in configs}, sharder))


@pytest.mark.parametrize("opt", ["rowwise_adagrad"])  # refused at shard time, whatever the optimizer
def test_empty_row_block_is_refused_on_every_rank(opt):
    """Even row blocks of a 3-row table on 4 ranks leave rank 3 none: FBGEMM's CPU TBE fails on
    such a 0-row table now and then, on that rank alone, so a hand-written plan asking for it
    is refused at shard time on every rank, naming the table (the planner never offers it)."""
    for outcome, message in run_ranks(_build_small_table, 4, opt=opt):
        assert outcome == "raised" and "table 't3'" in message and "ranks [3]" in message, message


@pytest.mark.parametrize("opt,hot", [("sgd", {"t3": [1]}), ("rowwise_adagrad", {"t3": []})],
                         ids=["hot-row-sgd", "no-hot-row-rowwise_adagrad"])
def test_table_with_fewer_rows_than_ranks_table_wise_cold(opt, hot):
    """A 3-row table on 4 ranks, table-wise cold (written as stock table_wise writes it: one
    shard on its owner, no TBE table elsewhere) beside even row-wise cold tables, trains like
    table_wise: forward, weights and optimizer state after several steps, replicas."""
    hot = {**DEFAULT_HOT, **hot}
    run_ranks(train_pair, 4, opt=opt, rows={"t3": 3}, hot=hot,
              kinds={"t0": "hybrid", "t1": "hybrid_tw", "t2": "hybrid", "t3": "hybrid_tw"})


@pytest.mark.parametrize("kinds,rows,hot", [
    ({"t0": "tw", "t1": "tw", "t2": "tw", "t3": "hybrid_tw"}, {"t3": 3}, {**DEFAULT_HOT, "t3": [1]}),
    ({"t0": "hybrid_cw", "t1": "tw", "t2": "tw", "t3": "tw"}, None, None),
], ids=["lone-small-table", "lone-column-slices"])
def test_ranks_holding_no_cold_rows_train_like_table_wise(kinds, rows, hot):
    """The module's only hybrid table has no rows on some ranks (one shard of a 3-row table on 4
    ranks; two column slices on 4 ranks): those ranks look nothing up cold, yet take part in the
    output all-to-all both ways, and everything still matches table_wise."""
    run_ranks(train_pair, 4, opt="rowwise_adagrad", rows=rows, hot=hot, kinds=kinds)


def test_table_with_fewer_rows_than_ranks_refreshes_its_hot_set():
    """The same 3-row table's hot set switched twice (one row -> two -> none) keeps matching table_wise."""
    small = {"t0": [0, 1, 2, 39], "t1": [0, 4, 11], "t2": [5, 22], "t3": [0, 2]}
    run_ranks(train_pair, 4, opt="rowwise_adagrad", rows={"t3": 3}, hot={**DEFAULT_HOT, "t3": [1]}, steps=12,
              kinds={"t0": "hybrid", "t1": "hybrid_tw", "t2": "hybrid", "t3": "hybrid_tw"},
              refresh=dict(at=(3, 7), hot=(small, {**ALL_HOT, "t3": []}), in_flight=False))


@pytest.mark.parametrize(
    "case",
    [
        dict(mean=True, opt="rowwise_adagrad"),
        dict(weighted=True, opt="adagrad"),
        dict(hot=ALL_HOT, mode="hot_only"),
        dict(mode="cold_only", opt="rowwise_adagrad"),
        dict(hot=ALL_HOT, rank0_mode="hot_only"),  # a rank that sends no cold ids at all
        dict(kinds={"t0": "hybrid", "t1": "cw", "t2": "rw", "t3": "dp"}, opt="adagrad"),
        dict(kinds={"t0": "tw", "t1": "hybrid", "t2": "hybrid", "t3": "tw"}),
        # two hybrid tables of one width: their hot rows share one replica table
        dict(kinds={"t0": "hybrid", "t1": "tw", "t2": "hybrid", "t3": "tw"}, opt="rowwise_adagrad"),
        # same with an optimizer FBGEMM has no variable-batch lookup for (padded cold batch)
        dict(kinds={"t0": "hybrid", "t1": "tw", "t2": "hybrid", "t3": "tw"}, opt="adagrad"),
        # no hot row anywhere: nothing to replicate, every lookup goes to its owner
        dict(hot={"t0": [], "t1": [], "t2": [], "t3": []}, mode="cold_only", opt="adagrad"),
    ],
    ids=["mean", "weighted", "hot-only", "cold-only", "rank-without-cold", "mixed-cw-rw-dp",
         "mixed-tw", "one-width", "one-width-padded", "no-hot-rows"],
)
def test_inputs_match_table_wise(case):
    run_ranks(train_pair, 2, **case)


@pytest.mark.parametrize("world,opt,in_flight,kinds", [
    (2, "sgd", False, None),
    (4, "rowwise_adagrad", True, None),
    (3, "adagrad", True, {"t0": "hybrid_tw", "t1": "hybrid", "t2": "hybrid_uneven", "t3": "hybrid"}),
    (2, "rowwise_adagrad_wd", True, None),  # only looked-up hot rows travel: the mask follows the new set
])
def test_refreshed_hot_sets_train_like_table_wise(world, opt, in_flight, kinds):
    """Hot sets switched 3 times in 20 steps (between steps, or with a batch already split by
    the old set) keep matching table_wise: outputs, weights, optimizer state, replicas."""
    run_ranks(train_pair, world, opt=opt, kinds=kinds, steps=20,
              refresh=dict(at=(4, 9, 15), hot=(NEW_HOT, ALL_HOT, NEW_HOT), in_flight=in_flight))


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("layout", ["hybrid_tw", "hybrid_tw_mh", "hybrid_uneven", "hybrid_cw"])
def test_cold_layouts_train_like_table_wise(world, layout):
    """Table-wise cold (every cold row on one owner), uneven row blocks and column slices, multi-hot bags
    (column slices against stock column_wise: row-wise Adagrad keeps an accumulator per slice)."""
    kinds = {t: layout for t in ("t0", "t1", "t2", "t3")}
    if layout == "hybrid_cw":  # t3 is 4 wide: no two slices of a multiple of 4 columns
        kinds["t3"] = "hybrid_tw"
    run_ranks(train_pair, world, opt="rowwise_adagrad", kinds=kinds)


@pytest.mark.parametrize(
    "case",
    [
        dict(opt="sgd", weighted=True),
        dict(opt="rowwise_adagrad", mean=True),
        dict(opt="rowwise_adagrad_wd", mode="cold_only", rank0_mode="mixed"),
    ],
    ids=["weighted-sgd", "mean", "weight-decay"],
)
def test_mixed_cold_layouts_match_table_wise(case):
    """One EBC holding every cold layout next to a stock table, on 3 ranks (two of them in
    turn column slices: a two-feature table, and the MEAN one)."""
    kinds = {"t0": "hybrid_tw", "t1": "hybrid_uneven", "t2": "hybrid", "t3": "tw"}
    run_ranks(train_pair, 3, kinds=kinds, **case)
    if case.get("mean"):
        sliced = {"t0": "hybrid_tw", "t1": "hybrid_cw", "t2": "hybrid_uneven", "t3": "tw"}
    else:
        sliced = {"t0": "hybrid_cw", "t1": "hybrid_uneven", "t2": "hybrid_tw", "t3": "tw"}
    run_ranks(train_pair, 3, kinds=sliced, **case)


def _owner_lanes(rank, world, opt):
    """A table-wise cold table planned multi-hot is looked up in a TBE call of its own where that
    reaches FBGEMM's fast CPU backward (row-wise AdaGrad, a table of one feature); a one-hot one,
    one of two features (t0) or any with another optimizer as W virtual features beside the light
    tables."""
    from torchrec_hybrid.sharding.lookup import HybridLookup

    configs = tables()
    kinds = {"t0": "hybrid_tw_mh", "t1": "hybrid_tw", "t2": "hybrid_tw", "t3": "hybrid_tw_mh"}
    sharder = HybridEmbeddingBagCollectionSharder(hot_ids(), fused_params=dict(OPTIMIZERS[opt]))
    mh = build(configs, world, kinds, sharder)
    (lookup,) = [m for m in mh.module._lookups if isinstance(m, HybridLookup)]
    owned = [c for i, c in enumerate(configs) if (i + 1) % world == rank]
    alone = {c.name for c in owned if kinds[c.name] == "hybrid_tw_mh" and len(c.feature_names) == 1
             and opt == "rowwise_adagrad"}
    multi = [f for c in owned if c.name in alone for f in c.feature_names]
    virtual = [f"{f}@{v}" for c in owned if c.name not in alone for f in c.feature_names for v in range(world)]
    keys = lookup.lane_keys
    if multi:
        assert keys[1:] == [multi], keys
    else:
        assert len(keys) == 1, keys
    assert set(virtual) <= set(keys[0]) and not any("@" in k for k in keys[0] if k not in virtual), keys


@pytest.mark.parametrize("world,opt", [(2, "rowwise_adagrad"), (3, "rowwise_adagrad"), (2, "sgd")])
def test_multi_hot_heavy_tables_get_a_tbe_call_of_their_own(world, opt):
    run_ranks(_owner_lanes, world, opt=opt)


@pytest.mark.parametrize("case", [dict(opt="rowwise_adagrad"), dict(opt="rowwise_adagrad", weighted=True),
                                  dict(opt="rowwise_adagrad", mean=True)],
                         ids=["rowwise-adagrad", "weighted", "mean"])
def test_one_hot_and_multi_hot_heavy_tables_train_like_table_wise(case):
    """Virtual features and a lane of its own in one owner's lookup, on 2 and 3 ranks."""
    kinds = {"t0": "hybrid_tw_mh", "t1": "hybrid_tw", "t2": "hybrid_tw", "t3": "hybrid_tw_mh"}
    for world in (2, 3):
        run_ranks(train_pair, world, kinds=kinds, **case)


def _without_key_maps(rank, world, **case):
    from torchrec_hybrid.sharding import input_dist
    input_dist.DENSE_MAP_MAX_ROWS = 0  # as for tables too large in total for dense key maps
    train_pair(rank, world, **case)


@pytest.mark.parametrize("case", [dict(opt="sgd", weighted=True), dict(opt="rowwise_adagrad_wd", mode="cold_only",
                                                                      rank0_mode="mixed")],
                         ids=["weighted-sgd", "weight-decay"])
def test_tables_too_large_for_key_maps_train_like_table_wise(case):
    """Without dense key maps the input dist finds hot ids and owners by binary search; every
    cold layout and the looked-up-rows exchange must route exactly as with the maps."""
    run_ranks(_without_key_maps, 3, kinds={"t0": "hybrid_tw", "t1": "hybrid_cw", "t2": "hybrid_uneven", "t3": "hybrid"},
              **case)


def test_weight_decay_updates_only_looked_up_hot_rows():
    """Weight decay moves a row even on a zero gradient, so owners may update (and send) only
    hot rows some rank looked up; here rank 1 looks up no hot row at all."""
    run_ranks(train_pair, 2, opt="rowwise_adagrad_wd", mode="cold_only", rank0_mode="mixed")


def test_odd_world_size():
    run_ranks(train_pair, 3, opt="rowwise_adagrad", mean=True)


def test_row_wise_mean_next_to_hybrid():
    """A stock row-wise MEAN table in the same EBC: its divisor must not touch hybrid features."""
    run_ranks(train_pair, 2, mean=True, kinds={"t0": "hybrid", "t1": "rw", "t2": "hybrid", "t3": "tw"},
              ref_kinds={})


def weighted_mean_step(rank, world):
    configs = tables(mean=True)
    torch.manual_seed(0)
    ref = torchrec.EmbeddingBagCollection(tables=configs, is_weighted=True)
    hot_t = hot_ids()
    mh = build(configs, world, {c.name: "hybrid" for c in configs},
               HybridEmbeddingBagCollectionSharder(hot_t, fused_params=dict(OPTIMIZERS["sgd"])), weighted=True)
    mt = build(configs, world, {}, EmbeddingBagCollectionSharder(fused_params=dict(OPTIMIZERS["sgd"])), weighted=True)
    mh.load_state_dict(ref.state_dict())
    mt.load_state_dict(ref.state_dict())
    keys = [f for c in configs for f in c.feature_names]
    kjt = skewed_batch(configs, keys, batch=6, seed=rank, hot=hot_t, weighted=True)
    oh, ot = mh(kjt).wait().to_dict()["f1"], mt(kjt).wait().to_dict()["f1"]
    torch.testing.assert_close(oh, ot)  # forward: equal to stock table_wise
    g = torch.randn(oh.shape, generator=torch.Generator().manual_seed(rank))
    (oh * g).sum().backward()
    # exact gradient of sum(w_i * E[id_i]) / len, mean over ranks (DMP semantics)
    w = ref.embedding_bags["t1"].weight.detach().clone().requires_grad_()
    jt = kjt["f1"]
    pooled = torch.nn.functional.embedding_bag(jt.values(), w, jt.offsets()[:-1], mode="sum",
                                               per_sample_weights=jt.weights())
    (pooled / jt.lengths().clamp(min=1)[:, None] * g).sum().backward()
    grad = w.grad.clone()
    dist.all_reduce(grad)
    expected = w.detach() - OPTIMIZERS["sgd"]["learning_rate"] * grad / world
    torch.testing.assert_close(full_weight(mh.state_dict()["embedding_bags.t1.weight"]), expected)


def test_weighted_mean_matches_exact_gradient():
    """Weighted MEAN: forward equals table_wise; the update equals the exact gradient.

    Stock TorchRec is not the reference for this update: FBGEMM 1.8's CPU MEAN kernel leaves
    out the 1/length in its weighted backward (table_wise and row_wise both differ from the
    exact gradient by up to 0.24 on this case), while ours pools SUM and divides in autograd.
    """
    run_ranks(weighted_mean_step, 2)


def nan_padding_pair(rank, world, **case):
    """train_pair with every uninitialised tensor filled with NaN (PyTorch's deterministic
    mode does that), the owners' padding-bag gradients among them."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    probe = torch.empty(4)
    assert torch.isnan(probe).all(), "uninitialised memory is not NaN-filled: the test would prove nothing"
    train_pair(rank, world, **case)


@pytest.mark.parametrize("case", [dict(opt="adagrad"), dict(opt="rowwise_adagrad", weighted=True),
                                  dict(opt="sgd", mean=True)], ids=["adagrad", "rowwise-weighted", "sgd-mean"])
def test_padding_gradients_are_never_read(case):
    """The output dist leaves the gradient of padding bags uninitialised: the TBE backward
    must never read it (a NaN there would reach the weights)."""
    run_ranks(nan_padding_pair, 2, **case)


@pytest.mark.parametrize("world,case", [
    (1, dict(opt="sgd")),
    (2, dict(opt="rowwise_adagrad")),
    (3, dict(opt="sgd", weighted=True)),
    (4, dict(opt="rowwise_adagrad", kinds={"t0": "hybrid", "t1": "tw", "t2": "hybrid_tw", "t3": "tw"})),
    # stock plans cannot take these as VBE on CPU: FBGEMM has no VBE Adagrad, TorchRec 1.8
    # merges the TBEs of MEAN and SUM groups into a pre-allocated output FBGEMM refuses on CPU,
    # cannot concatenate a data_parallel table's output with VBE ones, and row_wise's VBE path
    # all-gathers tensors of different sizes, which gloo refuses; the reference gets
    # the same samples as one batch per feature
    (2, dict(opt="rowwise_adagrad", mean=True, variable="expanded")),
    (4, dict(opt="adagrad", kinds={"t0": "hybrid", "t1": "rw", "t2": "hybrid_tw", "t3": "dp"},
             variable="expanded")),
], ids=["w1", "w2", "w3-weighted", "w4-mixed", "w2-mean", "w4-adagrad"])
def test_variable_batch_trains_like_table_wise(world, case):
    """VBE batches (a different batch per feature and per rank, inverse_indices naming each
    sample's bag) train like table_wise: outputs every step ([B, dims] as stock returns them),
    then weights and optimizer state."""
    case.setdefault("variable", True)
    run_ranks(train_pair, world, **case)


def _cold_exchanges(rank, world, room_pad, **case):
    """Trains the pair (``train_pair``) with the cold exchange's spare room per pair set to ``room_pad``
    words, then reports each hybrid input dist's cold exchange: its rows per peer out and in for the next
    step (header + room) and how many of its fused exchanges spilled into a second all-to-all."""
    from torchrec_hybrid.sharding import cold_all_to_all

    cold_all_to_all.ROOM_PAD = room_pad  # this rank's process only: small batches then outgrow their rooms
    kept: list = []
    train_pair(rank, world, keep=kept, **case)
    mh = kept[0]
    return [(c.rooms.send_rows, c.rooms.recv_rows, c.spills) for c in mh.module.cold_exchanges()]


@pytest.mark.parametrize("world", [2, 3])
def test_cold_exchange_past_its_room_trains_like_table_wise(world):
    """After the first step the cold ids travel in one all-to-all, each pair of ranks given a room sized from
    what it sent before; a step with far more cold ids than the last (hot-only, then cold-only batches)
    overflows some rooms, and every rank sends the rest in a second all-to-all: still table_wise's
    outputs, weights and optimizer state; every rank agrees on the spills, and each pair's ends on its room."""
    steps = ["hot_only", "cold_only", "mixed", "hot_only", "cold_only", "cold_only"]
    per_rank = run_ranks(_cold_exchanges, world, room_pad=4, opt="rowwise_adagrad", hot=ALL_HOT,
                         steps=len(steps), mode=steps, weighted=True)
    spills = [[n for *_, n in dists] for dists in per_rank]
    assert all(s == spills[0] for s in spills) and spills[0] and min(spills[0]) >= 2, per_rank
    for r, dists in enumerate(per_rank):
        for i, (send_rows, _, _) in enumerate(dists):
            assert [per_rank[q][i][1][r] for q in range(world)] == send_rows, per_rank  # q's rows from r


def _refresh_counts(rank, world):
    configs = tables()
    mh = build(configs, world, {c.name: "hybrid" for c in configs},
               HybridEmbeddingBagCollectionSharder(hot_ids({"t0": [3], "t1": [0, 29, 5], "t2": [], "t3": [16]}),
                                                   fused_params=dict(OPTIMIZERS["sgd"])))
    new = {"t0": torch.tensor([3, 4, 5, 6]), "t1": torch.tensor([0, 5, 7]), "t2": torch.tensor([1, 2]),
           "t3": torch.tensor([], dtype=torch.int64)}
    return refresh_hot_sets(mh, hot_ids=new)


def test_refresh_counts_the_ids_that_entered_each_hot_set():
    """A set that grows, one of the same size and an empty one that fills count their new ids (growing
    and filled sets used to report 0: only removals were counted)."""
    for changed in run_ranks(_refresh_counts, 2, timeout=120):
        assert changed == {"t0": 3, "t1": 1, "t2": 2, "t3": 0}


def _composed_pair(rank, world, **case):
    """``train_pair`` with the hot path's composed ops (sharding/composed.py: what CUDA tensors, or a build
    without the fused CPU ops, run) instead of the fused ones, in this rank's process only."""
    import os

    from torchrec_hybrid.sharding import fused

    os.environ["TORCHREC_HYBRID_FUSED_OPS"] = "0"
    fused._state.clear()
    assert not fused.available()
    train_pair(rank, world, **case)


@pytest.mark.parametrize("world,case", [
    (2, dict(opt="rowwise_adagrad", weighted=True, kinds={"t0": "hybrid", "t1": "hybrid_tw", "t2": "hybrid_uneven",
                                                          "t3": "tw"})),
    (3, dict(opt="sgd", mean=True, kinds={"t0": "hybrid_cw", "t1": "hybrid_tw_mh", "t2": "hybrid", "t3": "tw"})),
    (4, dict(opt="adagrad", steps=6, hot=ALL_HOT, mode=["hot_only", "cold_only", "mixed"])),
], ids=["w2-weighted-layouts", "w3-mean-column-wise", "w4-adagrad-spills"])
def test_composed_ops_train_like_table_wise(world, case):
    """The composed reference of the fused ops trains like table_wise too (outputs every step, then weights
    and optimizer state): the path CUDA tensors take, checked where there is no GPU."""
    run_ranks(_composed_pair, world, **case)
