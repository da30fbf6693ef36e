"""frequency_hybrid must train exactly like stock table_wise (same init, same fused optimizer)."""

import pytest
import torch
import torch.distributed as dist
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
import torchrec

from tests.models import OPTIMIZERS, build, full_weight, hot_ids, skewed_batch, tables
from tests.multiprocess import run_ranks
from torchrec_hybrid import HybridEmbeddingBagCollectionSharder


def train_pair(rank, world, opt="sgd", mean=False, weighted=False, steps=5, hybrid_kinds=None, hot=None):
    configs = tables(mean=mean)
    torch.manual_seed(0)
    ref = torchrec.EmbeddingBagCollection(tables=configs, is_weighted=weighted)
    hot_t = hot_ids(hot)
    kinds = hybrid_kinds or {c.name: "hybrid" for c in configs}
    mh = build(configs, world, kinds, HybridEmbeddingBagCollectionSharder(hot_t, fused_params=dict(OPTIMIZERS[opt])),
               weighted=weighted)
    mt = build(configs, world, {}, EmbeddingBagCollectionSharder(fused_params=dict(OPTIMIZERS[opt])), weighted=weighted)
    mh.load_state_dict(ref.state_dict())
    mt.load_state_dict(ref.state_dict())
    keys = [f for c in configs for f in c.feature_names]
    worst = 0.0
    for step in range(steps):
        kjt = skewed_batch(configs, keys, batch=6, seed=100 * step + rank, hot=hot_t, weighted=weighted)
        oh, ot = mh(kjt).wait().to_dict(), mt(kjt).wait().to_dict()
        assert sorted(oh) == sorted(ot) == sorted(keys)
        vh = torch.cat([oh[k] for k in keys], dim=1)
        vt = torch.cat([ot[k] for k in keys], dim=1)
        worst = max(worst, (vh - vt).abs().max().item())
        torch.testing.assert_close(vh, vt, atol=1e-5, rtol=1e-5)
        coef = torch.randn(vt.shape, generator=torch.Generator().manual_seed(7 + step + rank))
        (vh * coef).sum().backward()
        (vt * coef).sum().backward()
    sh, st = mh.state_dict(), mt.state_dict()
    assert sorted(sh.keys()) == sorted(st.keys())
    for k in st:
        wh, wt = full_weight(sh[k]), full_weight(st[k])
        assert wh.shape == wt.shape
        torch.testing.assert_close(wh, wt, atol=1e-5, rtol=1e-5)
        assert not torch.equal(wt, full_weight(ref.state_dict()[k])), f"{k} never trained"
    # hot replicas: bit-identical across ranks and equal to the logical table's rows
    replicas = [rep for lk in mh.module.hybrid_lookups() for rep in lk.hot_replicas()]
    assert replicas
    for rep in replicas:
        for t_w in rep.tbe.split_embedding_weights():
            gathered = [torch.empty_like(t_w) for _ in range(world)]
            dist.all_gather(gathered, t_w.contiguous())
            assert all(torch.equal(gathered[0], g) for g in gathered), "hot replicas diverged"
    return worst


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("opt", ["sgd", "adagrad", "rowwise_adagrad"])
def test_hybrid_trains_like_table_wise(world, opt):
    run_ranks(train_pair, world, opt=opt)
