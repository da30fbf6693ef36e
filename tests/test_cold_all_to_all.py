"""The cold ids' wire format (cold_all_to_all.py) against a reference built from what was sent.

Each rank sends random bags (some (destination, feature) runs empty) and a report; the owner's
padded TBE input, the cells its bags travel home in and the reports must be exactly what the
senders' bags and the extra bags say, for 1 and 3 ranks, weighted or not.
"""

import pytest
import torch

from tests.multiprocess import run_ranks

F = 3


def _sent(rank: int, world: int, weighted: bool):
    g = torch.Generator().manual_seed(100 + rank)
    counts = torch.randint(0, 4, (world, F), generator=g)
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


def _rank(rank, world, weighted):
    import torch.distributed as dist

    from torchrec_hybrid.sharding.cold_all_to_all import ColdIdsAllToAll

    counts, lengths, rows, weights = _sent(rank, world, weighted)
    # ids per (destination, feature): segment sums of the lengths
    ids = torch.zeros(world * F, dtype=torch.int64).index_add_(
        0, torch.repeat_interleave(torch.arange(world * F), counts.view(-1)), lengths)
    report = torch.tensor([rank, 7, -1, 2], dtype=torch.int32)
    a2a = ColdIdsAllToAll(dist.group.WORLD, F, 4, torch.device("cpu"))
    bags = a2a(counts.view(-1), ids, lengths, rows, weights, report).wait().wait()
    per_feature, extra_rows = _extras(rank)
    kjt, cells, rows_per_feature = bags.padded([f"f{i}" for i in range(F)], per_feature, extra_rows,
                                               torch.ones(extra_rows.numel(), dtype=torch.int32))
    out = dict(lengths=kjt.lengths(), values=kjt.values(), weights=kjt.weights_or_none(), stride=kjt.stride(),
               length_per_key=kjt.length_per_key(), cells=cells, rows_per_feature=rows_per_feature,
               reports=bags.reports, counts=bags.counts)
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in out.items()}  # plain data across processes


def _expected(owner: int, world: int, weighted: bool):
    sent = [_sent(s, world, weighted) for s in range(world)]
    per_feature, extra_rows = _extras(owner)
    bags = [[] for _ in range(F)]  # per feature: (length, ids, weights), sources in rank order
    cells = []
    for s, (counts, lengths, rows, weights) in enumerate(sent):
        bag0 = int(counts.view(-1)[: owner * F].sum())
        id0 = int(lengths[:bag0].sum())
        for f in range(F):
            for _ in range(int(counts[owner, f])):
                n = int(lengths[bag0])
                cells.append(len(bags[f]) * F + f)
                bags[f].append((n, rows[id0:id0 + n], None if weights is None else weights[id0:id0 + n]))
                bag0, id0 = bag0 + 1, id0 + n
    received = [len(b) for b in bags]
    extra0 = 0
    for f in range(F):
        for r in extra_rows[extra0:extra0 + int(per_feature[f])]:
            bags[f].append((1, r.view(1), torch.ones(1) if weighted else None))
        extra0 += int(per_feature[f])
    batch = max(1, max(len(b) for b in bags))
    lengths = torch.zeros(F, batch, dtype=torch.int32)
    for f in range(F):
        lengths[f, : len(bags[f])] = torch.tensor([b[0] for b in bags[f]], dtype=torch.int32)
    values = torch.cat([b[1] for f in range(F) for b in bags[f]] + [torch.empty(0, dtype=torch.int64)])
    weights = torch.cat([b[2] for f in range(F) for b in bags[f]] + [torch.empty(0)]) if weighted else None
    lpk = [int(sum(b[0] for b in bags[f])) for f in range(F)]
    return dict(lengths=lengths.view(-1).tolist(), values=values.tolist(), weights=None if weights is None else
                weights.tolist(), stride=batch, length_per_key=lpk, cells=cells, rows_per_feature=received)


@pytest.mark.parametrize("world,weighted", [(1, False), (3, False), (3, True)])
def test_owner_receives_exactly_what_was_sent(world, weighted):
    out = run_ranks(_rank, world, weighted=weighted)
    for owner, got in enumerate(out):
        want = _expected(owner, world, weighted)
        for key in ("lengths", "values", "weights", "stride", "length_per_key", "cells", "rows_per_feature"):
            assert got[key] == want[key], (owner, key)  # weights: bit-exact floats
        assert got["reports"] == [[s, 7, -1, 2] for s in range(world)], owner
        assert got["counts"] == [_sent(s, world, weighted)[0][owner].tolist() for s in range(world)], owner
