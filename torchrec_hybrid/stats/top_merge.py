"""Hot sets from every rank's statistics without merging them: only what can enter the hot set travels.

``all_reduce_`` sums every counter of every rank (MBs per refresh for large tables) to rank a
few thousand hot rows. :func:`merged_top_ids` instead has each rank send, per table, its own
``oversample`` x (hot size) most frequent ids with their counts - one all-gather of one flat
buffer - and ranks the union by the summed counts. An id outside some rank's candidates counts 0
there (an underestimate by at most that rank's last candidate's count), so with oversampling the
ids near the hot set's boundary are still ranked on nearly all their counts; the statistics stay
each rank's own (never merged), and every rank gets the same hot sets (ties by smaller id).
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Tuple

import torch
import torch.distributed as dist

from torchrec_hybrid.stats.sketch import top_by_count


def candidate_counts(sizes: Mapping[str, int], rows: Mapping[str, int], oversample: float,
                     floor: int) -> Dict[str, int]:
    """Per table with a hot set, how many candidates each rank sends: ``oversample`` x its hot size, at least
    ``floor``, at most its rows (sorted by name: the same layout on every rank)."""
    return {t: min(int(rows[t]), max(int(floor), math.ceil(oversample * n))) for t, n in sorted(sizes.items())
            if n > 0}


def merged_top_ids(stats, sizes: Mapping[str, int], group=None, oversample: float = 2.0,
                   floor: int = 64) -> Tuple[Dict[str, torch.Tensor], int]:
    """Per table of ``sizes``, its ``sizes[t]`` most frequent ids over all ranks of ``group`` (sorted
    ascending), from each rank's top candidates (module docstring). Collective: one all-gather of
    ``sum(candidates)`` (id, count) pairs per rank, 8 bytes each (int32 id, float32 count; 16 with
    float64 when a table has 2^31 rows or more). Returns ``(hot ids, bytes this rank contributed)``;
    a table without hot rows gets an empty set."""
    if oversample < 1:
        raise ValueError(f"merged_top_ids: oversample must be >= 1, got {oversample}")
    rows = {c.name: c.num_embeddings for c in stats.tables}
    unknown = sorted(set(sizes) - set(rows))
    if unknown:
        raise ValueError(f"merged_top_ids: tables {unknown} are not counted by these statistics")
    per_table = candidate_counts(sizes, rows, oversample, floor)
    total = sum(per_table.values())
    narrow = all(rows[t] < 2 ** 31 for t in per_table)
    ids_out = torch.full((total,), -1, dtype=torch.int32 if narrow else torch.float64)  # -1: padding, no id
    counts_out = torch.zeros(total, dtype=torch.float32 if narrow else torch.float64)
    at = 0
    for t, m in per_table.items():  # set-up per refresh (a loop over tables, not ids)
        ids, counts = stats.top_counts(t, m)
        ids_out[at:at + ids.numel()] = ids.to(ids_out.dtype)  # float64: exact below 2^53
        counts_out[at:at + ids.numel()] = counts.to(counts_out.dtype)
        at += m
    # one buffer: ids and the counts' bits side by side (int32 / float32, or float64 / float64)
    mine = torch.cat([ids_out, counts_out.view(ids_out.dtype)]).view(2, total)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world > 1:
        gathered = torch.empty(world * 2 * total, dtype=mine.dtype)
        dist.all_gather_into_tensor(gathered, mine.reshape(-1), group=group)
        everyone = gathered.view(world, 2, total)
    else:
        everyone = mine.view(1, 2, total)
    out: Dict[str, torch.Tensor] = {t: torch.empty(0, dtype=torch.int64) for t, n in sizes.items() if n <= 0}
    at = 0
    for t, m in per_table.items():
        ids = everyone[:, 0, at:at + m].reshape(-1)
        counts = everyone[:, 1, at:at + m].reshape(-1).view(counts_out.dtype).to(torch.float64)
        at += m
        keep = ids >= 0
        uniq, inverse = torch.unique(ids[keep].to(torch.int64), return_inverse=True)  # ascending
        summed = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inverse, counts[keep])
        top, _ = top_by_count(uniq, summed, int(sizes[t]))
        out[t] = torch.sort(top).values
    return out, int(mine.numel() * mine.element_size())
