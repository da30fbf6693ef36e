"""state_dict and torch.distributed.checkpoint round trips between hybrid and stock plans."""

import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torchrec
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

from tests.models import OPTIMIZERS, build, full_optimizer_state, full_weight, hot_ids, skewed_batch, tables
from tests.multiprocess import run_ranks
from torchrec_hybrid import HybridEmbeddingBagCollectionSharder

HYBRID = {"t0": "hybrid", "t1": "hybrid", "t2": "tw", "t3": "hybrid"}


SMALL_T3 = 3  # rows of t3 in the "hybrid_tw_small" case: fewer than the ranks


def _models(world, opt="rowwise_adagrad", layout="hybrid"):
    configs = tables()
    hot_t = hot_ids()
    if layout == "hybrid_tw_small":  # t3 with fewer rows than ranks: one whole-table shard, table-wise cold
        configs = [dataclasses.replace(c, num_embeddings=SMALL_T3) if c.name == "t3" else c for c in configs]
        hot_t["t3"] = torch.tensor([1])
        layout = "hybrid_tw"
    torch.manual_seed(0)
    ref = torchrec.EmbeddingBagCollection(tables=configs)
    kinds = {t: (layout if k == "hybrid" else k) for t, k in HYBRID.items()}
    if layout == "hybrid_cw":  # t3 is 4 wide: one slice (table-wise cold)
        kinds["t3"] = "hybrid_tw"
    # the stock plan: table_wise, or column_wise with the same slices for column-wise cold (row-wise
    # Adagrad keeps an accumulator per row of each slice)
    stock = {t: "cw" for t, k in kinds.items() if k == "hybrid_cw"}
    mh = build(configs, world, kinds, HybridEmbeddingBagCollectionSharder(hot_t, fused_params=dict(OPTIMIZERS[opt])))
    mt = build(configs, world, stock, EmbeddingBagCollectionSharder(fused_params=dict(OPTIMIZERS[opt])))
    return configs, ref, hot_t, mh, mt


def _train(model, configs, hot_t, rank, steps=3, seed=0):
    keys = [f for c in configs for f in c.feature_names]
    for step in range(steps):
        kjt = skewed_batch(configs, keys, batch=6, seed=seed + 100 * step + rank, hot=hot_t)
        d = model(kjt).wait().to_dict()
        out = torch.cat([d[k] for k in keys], dim=1)  # KeyedTensor column order depends on the plan
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()


def _outputs(model, configs, hot_t, rank):
    keys = [f for c in configs for f in c.feature_names]
    kjt = skewed_batch(configs, keys, batch=6, seed=999 + rank, hot=hot_t)
    with torch.no_grad():
        d = model(kjt).wait().to_dict()
    return torch.cat([d[k] for k in keys], dim=1)


def state_dict_shape(rank, world):
    configs, ref, hot_t, mh, _ = _models(world)
    sd = mh.state_dict()
    assert sorted(sd) == sorted(f"embedding_bags.{c.name}.weight" for c in configs)
    for c in configs:
        st = sd[f"embedding_bags.{c.name}.weight"]
        assert isinstance(st, ShardedTensor)
        assert tuple(st.size()) == (c.num_embeddings, c.embedding_dim)
    # load from an unsharded EBC: every logical row, hot ones included, equals the source
    mh.load_state_dict(ref.state_dict())
    for c in configs:
        key = f"embedding_bags.{c.name}.weight"
        assert torch.equal(full_weight(mh.state_dict()[key]), ref.state_dict()[key])
    # ... and the hot replicas were refreshed from it: outputs equal the unsharded module's
    keys = [f for c in configs for f in c.feature_names]
    kjt = skewed_batch(configs, keys, batch=6, seed=rank, hot=hot_t, hot_frac=1.0)
    with torch.no_grad():
        got, want = mh(kjt).wait().to_dict(), ref(kjt).to_dict()
    for k in keys:
        torch.testing.assert_close(got[k], want[k])


def dcp_round_trip(rank, world, path, layout="hybrid"):
    """hybrid -> DCP -> table_wise and table_wise -> DCP -> hybrid, weights and optimizer state."""
    configs, ref, hot_t, mh, mt = _models(world, layout=layout)
    mh.load_state_dict(ref.state_dict())
    mt.load_state_dict(ref.state_dict())
    _train(mh, configs, hot_t, rank, seed=1)
    _train(mt, configs, hot_t, rank, seed=2)  # different training: the loads must overwrite it
    dcp.save({"model": mh.state_dict(), "optim": mh.fused_optimizer.state_dict()}, checkpoint_id=f"{path}/h")
    target = {"model": mt.state_dict(), "optim": mt.fused_optimizer.state_dict()}
    dcp.load(target, checkpoint_id=f"{path}/h")
    mt.load_state_dict(target["model"])
    mt.fused_optimizer.load_state_dict(target["optim"])
    for k, v in mh.state_dict().items():
        assert torch.equal(full_weight(v), full_weight(mt.state_dict()[k])), k
    torch.testing.assert_close(_outputs(mh, configs, hot_t, rank), _outputs(mt, configs, hot_t, rank))

    # back: a table_wise checkpoint into a fresh hybrid model (trained differently first)
    _, _, _, mh2, _ = _models(world, layout=layout)
    _train(mh2, configs, hot_t, rank, seed=3)
    _train(mt, configs, hot_t, rank, seed=4)
    dcp.save({"model": mt.state_dict(), "optim": mt.fused_optimizer.state_dict()}, checkpoint_id=f"{path}/t")
    target = {"model": mh2.state_dict(), "optim": mh2.fused_optimizer.state_dict()}
    dcp.load(target, checkpoint_id=f"{path}/t")
    mh2.fused_optimizer.load_state_dict(target["optim"])
    mh2.load_state_dict(target["model"])  # refreshes hot replicas (weights and optimizer state)
    for k, v in mt.state_dict().items():
        assert torch.equal(full_weight(v), full_weight(mh2.state_dict()[k])), k
    torch.testing.assert_close(_outputs(mh2, configs, hot_t, rank), _outputs(mt, configs, hot_t, rank))
    sh, st = full_optimizer_state(mh2.fused_optimizer, world), full_optimizer_state(mt.fused_optimizer, world)
    assert sorted(sh) == sorted(st)
    for k in sh:
        assert torch.equal(sh[k], st[k]), k
    # and both keep training identically (optimizer state came along, hot rows included)
    _train(mh2, configs, hot_t, rank, seed=5)
    _train(mt, configs, hot_t, rank, seed=5)
    for k, v in mt.state_dict().items():
        torch.testing.assert_close(full_weight(v), full_weight(mh2.state_dict()[k]), atol=1e-6, rtol=1e-6)


def test_state_dict_is_one_logical_table_per_hybrid_table():
    run_ranks(state_dict_shape, 2)


@pytest.mark.parametrize("layout,world", [("hybrid", 2), ("hybrid_tw", 2), ("hybrid_uneven", 3), ("hybrid_cw", 3),
                                          ("hybrid_tw_small", 4)])
def test_dcp_between_hybrid_and_table_wise(tmp_path, layout, world):
    """Every cold layout (even / table-wise / uneven row blocks) to stock table_wise and back; column
    slices to stock column_wise and back; a table with fewer rows than ranks, table-wise cold."""
    run_ranks(dcp_round_trip, world, path=str(tmp_path), layout=layout)


def wrong_shapes_refused(rank, world):
    configs, ref, hot_t, mh, _ = _models(world)
    before = {k: full_weight(v).clone() for k, v in mh.state_dict().items()}
    out = {}
    for case, shape in (("fewer rows", (36, 8)), ("more rows", (50, 8)), ("wider", (41, 16))):
        full = {k: full_weight(v) for k, v in mh.state_dict().items()}  # the logical tables, as plain tensors
        full["embedding_bags.t0.weight"] = torch.zeros(shape)
        try:
            mh.load_state_dict(full)
            out[case] = "loaded"
        except ValueError as e:
            out[case] = str(e)
    out["unchanged"] = all(torch.equal(before[k], full_weight(v)) for k, v in mh.state_dict().items())
    full = {k: full_weight(v) * 0 + 1 for k, v in mh.state_dict().items()}  # the right shapes still load
    mh.load_state_dict(full)
    out["loads"] = all(bool((full_weight(v) == 1).all()) for v in mh.state_dict().values())
    return out


def test_a_table_of_the_wrong_shape_is_refused_on_every_rank_before_any_loads():
    """TorchRec slices a whole table into each rank's shard; a wrong-sized one loaded on one rank and failed on
    another (or loaded a corner of it everywhere). Now every rank refuses it first, naming the key."""
    for out in run_ranks(wrong_shapes_refused, 2):
        for case, shape in (("fewer rows", (36, 8)), ("more rows", (50, 8)), ("wider", (41, 16))):
            assert f"'embedding_bags.t0.weight' has shape {shape}, the table is (41, 8)" in out[case], out[case]
        assert out["unchanged"] is True and out["loads"] is True
