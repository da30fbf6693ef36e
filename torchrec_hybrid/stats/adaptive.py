"""Hot sets from statistics whose decay is chosen from the data, refresh by refresh.

How much history ranks the hot set best depends on the data: few lookups per step or a flat skew
need a long memory to rank the hot set's boundary, fast drift a short one. ``AdaptiveHotSets``
counts every batch with several decays at once (``decays``; plus, undecayed, the lookups since the
last refresh). At each refresh it scores the hot sets each decay proposed at the previous refresh on
the lookups of the interval since - the coverage each would actually have had, summed over the
ranks - keeps the decay that did best, and returns that decay's new proposal. Every proposal comes
from :func:`merged_top_ids` (each rank's top candidates only). Collective: every rank, same step.
"""

from __future__ import annotations

import logging
import math
from typing import Dict, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from torchrec_hybrid.stats.frequency import FrequencyStats
from torchrec_hybrid.stats.top_merge import merged_top_ids

logger = logging.getLogger(__name__)

DECAYS = (0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 0.98)  # memories of about 1.25, 1.7, 2.5, 5, 10, 20 and 50 batches


class AdaptiveHotSets:
    """Per-rank statistics under several decays, and the refresh that picks the decay (module docstring).

    Args:
        tables: the tables to count (those of the hybrid tables to refresh).
        decays: the candidate decays per batch (each in (0, 1)); the first refresh, with nothing
            to score yet, uses ``first`` (default: the middle one).
        oversample: candidates per rank and table in the merge, as a multiple of its hot size.
    """

    def __init__(self, tables: Sequence, decays: Sequence[float] = DECAYS, first: Optional[float] = None,
                 oversample: float = 2.0) -> None:
        decays = tuple(float(d) for d in decays)
        if not decays or any(not 0 < d < 1 for d in decays) or len(set(decays)) != len(decays):
            raise ValueError(f"AdaptiveHotSets: decays must be distinct values in (0, 1), got {decays}")
        if first is not None and first not in decays:
            raise ValueError(f"AdaptiveHotSets: first={first} is not one of the decays {decays}")
        self.decays = decays
        self.chosen = decays[len(decays) // 2] if first is None else float(first)
        self.oversample = float(oversample)
        self.stats = {d: FrequencyStats(tables, decay=d) for d in decays}
        self.interval = FrequencyStats(tables)  # lookups since the last refresh (scores the proposals)
        self.proposals: Dict[float, Dict[str, torch.Tensor]] = {}
        self.history: List[Dict[str, object]] = []

    def update(self, kjt) -> None:
        """Counts one batch of this rank (every decay, and the interval)."""
        for s in self.stats.values():
            s.update(kjt)
        self.interval.update(kjt)

    def _scores(self, group) -> Optional[List[float]]:
        """Each decay's previous proposal: the share of the interval's lookups (all ranks) it would have served;
        None before the first refresh. One all-reduce of ``len(decays) + 1`` numbers."""
        if not self.proposals:
            return None
        names = self.interval.table_names
        hits = []
        for d in self.decays:  # per refresh: loops over decays and tables, not ids
            share = self.interval.hot_share(self.proposals[d])
            hits.append(sum(share[t] * self.interval.lookups(t) for t in names if not math.isnan(share[t])))
        total = sum(self.interval.lookups(t) for t in names)
        both = torch.tensor(hits + [total], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(both, group=group)
        return [h / both[-1].item() for h in both[:-1].tolist()] if both[-1] > 0 else None

    def hot_ids(self, sizes: Mapping[str, int], group=None) -> Dict[str, torch.Tensor]:
        """The hot sets (``sizes[t]`` ids per table, identical on every rank) of the decay whose last proposal
        served the interval best; starts a new interval. Collective."""
        scores = self._scores(group)
        if scores is not None:
            best = max(range(len(self.decays)), key=lambda i: (scores[i], i == self.decays.index(self.chosen)))
            self.chosen = self.decays[best]
        # the chosen decay's hot sets from oversampled candidates; the others', only scored at the next
        # refresh, from each rank's top hot-size ids (a few boundary ids may differ: the scores barely)
        self.proposals = {d: merged_top_ids(s, sizes, group, oversample=self.oversample if d == self.chosen
                                            else 1.0, floor=64 if d == self.chosen else 0)[0]
                          for d, s in self.stats.items()}
        self.interval = FrequencyStats(self.interval.tables)
        self.history.append({"decay": self.chosen, "scores": scores})
        logger.info("hot-set refresh: statistics decayed by %s per batch (last interval served by each decay's "
                    "hot sets: %s)", self.chosen, scores)
        return self.proposals[self.chosen]
