"""The per-step counter of collectives, host syncs and ops (benchmarks/step_counts.py) counts
what a hand-written step really issues, on 2 gloo ranks."""

import torch

from tests.multiprocess import run_ranks


def _counted(rank, world):
    import torch.distributed as dist

    from benchmarks.step_counts import counting

    x = torch.arange(4.0) + rank
    with counting() as c:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)  # collective 1
        dist.all_reduce(out)  # collective 2
        out.nonzero()  # sync 1 (data-dependent size)
        out.tolist()  # sync 2 (tensor -> Python, not dispatched)
        int(out[0])  # sync 3 (scalar read)
        torch.repeat_interleave(torch.arange(2), torch.tensor([2, 1]))  # sync 4 (no output_size)
        torch.repeat_interleave(torch.arange(2), torch.tensor([2, 1]), output_size=3)  # no sync
        out[out > 100]  # sync 5 (a boolean mask: the size is the mask's count)
        out[out > 100] = 0  # sync 6
        torch.bincount(torch.tensor([1, 2]))  # sync 7 (its length is the largest value's)
        out[torch.tensor([0, 1])]  # no sync (integer index)
        dist.barrier()  # not a collective of the step
    return c.summary()


def test_counts_what_a_step_issues():
    for summary in run_ranks(_counted, 2):
        assert summary["collectives"] == 2
        assert summary["host_syncs"] == 7
        assert summary["ops"] >= 14


def _counted_steps(rank, world, models):
    """Per-step counts of one training step for each ``(name, hybrid sharder?, plan kinds)`` of
    ``models``: the test EBC, row-wise Adagrad, the same batch for all (after a warm-up step)."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from benchmarks.step_counts import count_training_step
    from tests.models import OPTIMIZERS, build, hot_ids, skewed_batch, tables
    from torchrec_hybrid import HybridEmbeddingBagCollectionSharder

    configs = tables()
    hot = hot_ids(None)
    keys = [f for c in configs for f in c.feature_names]
    fused = OPTIMIZERS["rowwise_adagrad"]
    out = {}
    for name, ours, kinds in models:
        sharder = (HybridEmbeddingBagCollectionSharder(hot, fused_params=dict(fused)) if ours
                   else EmbeddingBagCollectionSharder(fused_params=dict(fused)))
        model = build(configs, world, {c.name: kinds[i % len(kinds)] for i, c in enumerate(configs)}, sharder)
        batch = skewed_batch(configs, keys, batch=6, seed=rank, hot=hot, weighted=False, mode="mixed")
        model(batch).wait().values().sum().backward()  # warm-up: first-step set-up is not a step
        out[name] = count_training_step(model, batch)
    return out


def test_hybrid_issues_no_more_collectives_or_host_syncs_than_table_wise():
    """Issue 15's budget: an all-hybrid EBC issues per step (forward and backward) no more
    collectives and no more host syncs than the same EBC sharded table_wise (before the input
    dist went sync-free: 12 in the forward against table_wise's 5)."""
    for counts in run_ranks(_counted_steps, 2, models=[("hybrid", True, ["hybrid"]), ("tw", False, ["tw"])]):
        h, t = counts["hybrid"], counts["tw"]
        assert h["fwd_collectives"] + h["bwd_collectives"] <= t["fwd_collectives"] + t["bwd_collectives"], counts
        assert h["fwd_collectives"] > 0 and t["fwd_collectives"] > 0, counts
        # both counted on a fresh batch (step_counts.fresh); the hybrid's owner makes one TBE
        # call per group, as table_wise does (FBGEMM's row-wise Adagrad reads its iteration
        # counter, a host tensor even on a GPU, twice per call)
        assert h["fwd_host_syncs"] + h["bwd_host_syncs"] <= t["fwd_host_syncs"] + t["bwd_host_syncs"], counts
        assert t["fwd_host_syncs"] > 0, counts


def test_a_stock_plan_costs_no_collective_or_host_sync_more_under_our_sharder():
    """When the planner falls back to stock types the user still runs our sharder, which leaves a module
    the plan keeps all stock unchecked by default (``validate_ids=None``), so the step issues exactly
    TorchRec's collectives and host syncs."""
    for kinds in (["tw"], ["tw", "rw", "dp"]):
        for counts in run_ranks(_counted_steps, 2, models=[("ours", True, kinds), ("torchrec", False, kinds)]):
            ours, stock = counts["ours"], counts["torchrec"]
            for k in ("fwd_collectives", "bwd_collectives", "fwd_host_syncs", "bwd_host_syncs"):
                assert ours[k] == stock[k], (kinds, k, counts)
            assert stock["fwd_collectives"] > 0, counts
