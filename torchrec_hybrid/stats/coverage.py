"""Share of a batch's lookups that a given hot set serves, per table (for a per-step check).

`HotSetCoverage` is built once per hot set: a bitset over all rows of all tables (table
``t``'s ids offset by the rows of the tables before it; one bit per row, 4 MiB for the 34M
rows of Criteo Kaggle) with the hot rows set. It then measures any number of batches with a
handful of vectorised ops: one ``repeat_interleave`` of the table index per lookup, one
gather of the batch's words from the bitset plus shifts, and two ``index_add_`` into
per-table counters; no Python loop over ids, rows or (beyond reading the KJT's keys)
tables. A trainer can watch it every step, e.g. to refresh the hot set when the measured
coverage drops below a threshold.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Sequence, Tuple, Union

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


class HotSetCoverage:
    """Measures which share of a batch's lookups rows ``hot_ids[table]`` serve.

    Args:
        tables: the tables (their ``feature_names`` map KJT keys to tables; keys of no
            table are ignored).
        hot_ids: hot row ids per table name (any order, duplicates ignored); tables not
            named have an empty hot set.
        device: where batches are measured.
        validate: check every batch's ids against their table's rows (one host sync);
            an id out of range raises ValueError instead of counting as a hit of a
            neighbouring table.
    """

    def __init__(self, tables: Sequence[EmbeddingBagConfig], hot_ids: Mapping[str, torch.Tensor],
                 device: Union[torch.device, str] = "cpu", validate: bool = True) -> None:
        self.tables = list(tables)
        self.device = torch.device(device)
        self.validate = validate
        names = [c.name for c in self.tables]
        index = {n: i for i, n in enumerate(names)}
        unknown = sorted(set(hot_ids) - set(index))
        if unknown:
            raise ValueError(f"hot_ids name unknown table(s) {unknown}; known: {names}")
        self._feature_table: Dict[str, int] = {f: i for i, c in enumerate(self.tables) for f in c.feature_names}
        rows = [c.num_embeddings for c in self.tables]
        starts = [0]
        for n in rows:
            starts.append(starts[-1] + n)
        T = len(self.tables)
        # one entry more than tables: index T collects lookups of keys that belong to no table
        self._rows = torch.tensor(rows + [1 << 62], dtype=torch.int64, device=self.device)
        self._start = torch.tensor(starts[:-1] + [0], dtype=torch.int64, device=self.device)
        self._total = starts[-1]
        parts: List[torch.Tensor] = []
        for name, ids in hot_ids.items():
            t = index[name]
            ids = torch.as_tensor(ids).to(self.device, torch.int64).view(-1)
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows[t]):
                raise ValueError(f"hot ids of table {name!r} must be in [0, {rows[t]}), got "
                                 f"[{int(ids.min())}, {int(ids.max())}]")
            parts.append(ids + starts[t])
        hot = torch.unique(torch.cat(parts)) if parts else torch.empty(0, dtype=torch.int64, device=self.device)
        self.num_hot: List[int] = torch.bincount(
            torch.bucketize(hot, torch.tensor(starts[1:], dtype=torch.int64, device=self.device), right=True),
            minlength=T)[:T].tolist()
        # distinct ids set distinct bits, so adding powers of two (wrapping at bit 63) is an OR
        self._bits = torch.zeros((self._total + 63) // 64, dtype=torch.int64, device=self.device)
        self._bits.scatter_add_(0, hot >> 6, torch.ones_like(hot) << (hot & 63))
        self._T = T

    @property
    def table_names(self) -> List[str]:
        return [c.name for c in self.tables]

    def counts(self, kjt: KeyedJaggedTensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(hits, lookups) per table, int64 tensors of length T in table order."""
        T = self._T
        if T == 0:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
        keys = kjt.keys()
        key_table = torch.tensor([self._feature_table.get(k, T) for k in keys], dtype=torch.int64,
                                 device=self.device)
        per_key = torch.tensor(kjt.length_per_key(), dtype=torch.int64, device=self.device)
        values = kjt.values().to(self.device, torch.int64)
        table = torch.repeat_interleave(key_table, per_key, output_size=values.numel())
        if self.validate and values.numel():
            bad = ((values < 0) | (values >= self._rows[table])) & (table < T)  # keys of no table: ignored
            if bool(bad.any()):
                at = int(torch.nonzero(bad)[0])
                t = int(table[at])
                raise ValueError(f"table {self.tables[t].name!r}: id {int(values[at])} is out of "
                                 f"range [0, {self.tables[t].num_embeddings})")
        lookups = torch.zeros(T + 1, dtype=torch.int64, device=self.device)
        lookups.index_add_(0, table, torch.ones_like(table))
        hits = torch.zeros(T + 1, dtype=torch.int64, device=self.device)
        if values.numel() and self._total:
            g = (values + self._start[table]).clamp_(0, self._total - 1)  # clamp: only unvalidated junk
            hit = self._bits[g >> 6].bitwise_right_shift_(g & 63).bitwise_and_(1)
            hits.index_add_(0, table, hit)  # lookups of no table land in the dropped entry T
        return hits[:T], lookups[:T]

    def __call__(self, kjt: KeyedJaggedTensor) -> Dict[str, float]:
        """Per table, the share of this batch's lookups that are hot (nan: no lookups)."""
        hits, lookups = self.counts(kjt)
        share = hits.to(torch.float64) / lookups.to(torch.float64)  # 0 / 0 -> nan
        return dict(zip(self.table_names, share.tolist()))

    def share(self, kjt: KeyedJaggedTensor) -> float:
        """Share of all this batch's lookups (in any table) that are hot (nan: none)."""
        hits, lookups = self.counts(kjt)
        total = int(lookups.sum())
        return int(hits.sum()) / total if total else float("nan")
