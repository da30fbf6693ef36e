"""AdaptiveHotSets on 2 gloo ranks: the same decay and hot sets on every rank; a long memory where the
data stand still and few lookups are counted per step, a short one where the popularity drifts fast."""

import pytest
import torch
from stats_testutils import one_feature_kjts, table

from torchrec_hybrid.spawn import spawn_ranks
from torchrec_hybrid.stats.adaptive import AdaptiveHotSets

ROWS, HOT = 3000, 60
TABLES = [table("t", ROWS, ["f"])]


def _batch(step: int, rank: int, shift: int, n: int) -> torch.Tensor:
    """``n`` Zipf(1.1) ids of step ``step``: popularity order rotated by ``shift`` ranks per step."""
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(0)).roll(-shift * step)
    p = torch.arange(1, ROWS + 1, dtype=torch.float64).pow(-1.1)
    g = torch.Generator().manual_seed(1000 * step + rank)
    return order[torch.multinomial(p, n, replacement=True, generator=g)]


def _worker(rank, world, emit, shift, n):
    torch.set_num_threads(1)
    sets = AdaptiveHotSets(TABLES)
    chosen = []
    for step in range(1, 201):
        for kjt in one_feature_kjts(_batch(step, rank, shift, n), "f", n):
            sets.update(kjt)
        if step % 10 == 0:
            hot = sets.hot_ids({"t": HOT})
            chosen.append(sets.chosen)
    emit({"chosen": chosen, "hot": hot["t"].tolist()})


@pytest.mark.parametrize("shift,n,memory", [(0, 100, "long"), (12, 2000, "short")], ids=["still", "drifting"])
def test_the_decay_follows_the_data(shift, n, memory):
    out = [r[0] for r in spawn_ranks(_worker, 2, timeout=120, shift=shift, n=n)]
    assert out[0]["chosen"] == out[1]["chosen"] and out[0]["hot"] == out[1]["hot"]
    assert len(out[0]["hot"]) == HOT
    late = out[0]["chosen"][5:]  # after the first refreshes
    typical = sorted(late)[len(late) // 2]
    assert (typical >= 0.95) if memory == "long" else (typical <= 0.8), out[0]["chosen"]


def test_adaptive_hot_sets_refuse_bad_decays():
    with pytest.raises(ValueError, match=r"decays must be distinct values in \(0, 1\), got \(0.5, 1.0\)"):
        AdaptiveHotSets(TABLES, decays=(0.5, 1.0))
    with pytest.raises(ValueError, match="first=0.7 is not one of the decays"):
        AdaptiveHotSets(TABLES, decays=(0.5, 0.9), first=0.7)
