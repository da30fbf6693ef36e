"""Per-row lookup frequencies of embedding tables, counted batch by batch.

`FrequencyStats` is what the frequency-hybrid planner reads to choose hot rows. It counts
how often each row of each table is looked up (lookups, not weights) over a stream of
KeyedJaggedTensors:

- tables with at most ``exact_max_rows`` rows are counted exactly, all of them in one flat
  int64 vector (one ``bincount`` / ``scatter_add_`` per batch, no Python loop over ids);
- larger tables get a bounded-memory `CountMinTopK` sketch (see sketch.py for its error
  bound), so statistics for a 40M-row table fit in a few tens of MB.

Statistics merge across workers (`merge_`, `merged`, `all_reduce_`) and persist to one
versioned file (`save`, `load`), so they can be computed once, offline or on all ranks,
and every rank derives the same hot set from them. This module counts and says what a
state holds; the file is persistence.py's, the state's schema checks validation.py's.

Counts can decay (`decay_`, or the ``decay`` option, applied by every `update`) for hot sets
that follow drifting data. `HotSetCoverage` measures the share of a batch's lookups a given hot
set serves, per table.
"""

from __future__ import annotations

import logging
import os
import zlib
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_hybrid.stats.coverage import HotSetCoverage
from torchrec_hybrid.stats.persistence import read_stats_file, write_stats_file
from torchrec_hybrid.stats.sketch import CountMinTopK, check_decay, table_seed, top_by_count
from torchrec_hybrid.stats.validation import FORMAT_VERSION, check_state, check_tables_match, setting_problems

logger = logging.getLogger(__name__)

DEFAULT_EXACT_MAX_ROWS = 1 << 24  # 16.8M rows = 128 MiB of int64 counters


class FrequencyStats:
    """Lookup counts per row for a set of `EmbeddingBagConfig` tables.

    Args:
        tables: the tables; each config's ``feature_names`` map KJT keys to it (several
            features may share a table; KJT keys that belong to no table are ignored).
        exact_max_rows: tables with at most this many rows are counted exactly.
        sketch_capacity: candidate heavy hitters kept per sketched table.
        sketch_eps, sketch_delta: Count-Min accuracy (overestimate <= eps * lookups with
            probability >= 1 - delta); sets the sketch's width and depth.
        seed: seed of the sketch hashes (must match to merge statistics); each table's
            sketch hashes with seed + crc32(table name).
        device: where the counters live (cpu, or cuda for NCCL all-reduce).
        decay: if set (a factor in (0, 1]), every `update` first multiplies all counts by it,
            so a lookup ``a`` batches old weighs ``decay ** a`` (see `decay_`).

    Decay (:meth:`decay_`) is O(1): counters are stored divided by one running scale, folded in
    before they are read, merged or saved. Every counter is a view into one flat buffer, so
    `all_reduce_` merges all of them in one collective (plus an all-gather of sketch candidates).
    """

    _HEAD = 2  # flat buffer: [num_batches, num_samples, lookups (T), exact counts, sketch tables]

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        exact_max_rows: int = DEFAULT_EXACT_MAX_ROWS,
        sketch_capacity: int = 100_000,
        sketch_eps: float = 1e-5,
        sketch_delta: float = 0.05,
        seed: int = 0,
        device: Union[torch.device, str] = "cpu",
        decay: Optional[float] = None,
    ) -> None:
        if decay is not None:
            check_decay(decay)
        # the settings a saved file must hold (load checks them the same way): refused here, not on reading
        problems = setting_problems(dict(exact_max_rows=exact_max_rows, num_batches=0, num_samples=0,
                                         sketch_capacity=sketch_capacity, seed=seed, sketch_eps=sketch_eps,
                                         sketch_delta=sketch_delta), floats=False)
        if not list(tables):  # a saved file must name its tables (load refuses none)
            problems.append("no tables to count (give the EmbeddingBagConfigs of the tables)")
        if problems:
            raise ValueError("FrequencyStats: " + "; ".join(problems))
        self.tables: List[EmbeddingBagConfig] = list(tables)
        self.exact_max_rows = exact_max_rows
        self.sketch_capacity = sketch_capacity
        self.sketch_eps, self.sketch_delta, self.seed = sketch_eps, sketch_delta, seed
        self.decay = decay
        self.device = torch.device(device)
        self._index_tables()
        self._place_counters()
        size = (self._HEAD + len(self.tables) + self._num_exact
                + sum(sk.table.numel() for sk in self._sketches.values()))
        self._flat = torch.zeros(size, dtype=torch.int64, device=self.device)
        self._bind()
        self._scale = 1.0  # logical counters = stored * _scale (float mode only)
        self._merged: Optional[torch.Tensor] = None  # the flat buffer at the last all_reduce_

    def _index_tables(self) -> None:
        """Map table names and KJT feature keys to table indices, refusing duplicate tables or features
        (a feature counted into two tables would double its lookups)."""
        self._index: Dict[str, int] = {}
        self._feature_table: Dict[str, int] = {}
        for i, cfg in enumerate(self.tables):
            if cfg.name in self._index:
                raise ValueError(f"duplicate table name {cfg.name!r}")
            self._index[cfg.name] = i
            for f in cfg.feature_names:
                if f in self._feature_table:
                    raise ValueError(f"feature {f!r} belongs to two tables")
                self._feature_table[f] = i

    def _place_counters(self) -> None:
        """Choose exact counts or a sketch per table: exact tables share one flat vector (``_offset[name]`` is
        where a table starts, ``_num_exact`` its length), larger ones get a `CountMinTopK`."""
        self._offset: Dict[str, int] = {}
        self._sketches: Dict[str, CountMinTopK] = {}
        total = 0
        for cfg in self.tables:
            if cfg.num_embeddings <= self.exact_max_rows:
                self._offset[cfg.name] = total
                total += cfg.num_embeddings
            else:
                sk = CountMinTopK(
                    cfg.num_embeddings, self.sketch_capacity, self.sketch_eps, self.sketch_delta,
                    seed=table_seed(self.seed, cfg.name), device=self.device,
                )
                if sk.memory_bound_bytes() >= 8 * cfg.num_embeddings:
                    logger.warning("table %s: its sketch (%d B) is not smaller than exact "
                                   "counts (%d B); raise exact_max_rows", cfg.name,
                                   sk.memory_bound_bytes(), 8 * cfg.num_embeddings)
                self._sketches[cfg.name] = sk
        self._num_exact = total

    def _bind(self) -> None:
        """(Re)make the views into the flat buffer (after it is allocated or changes dtype)."""
        T, h = len(self.tables), self._HEAD
        self._lookups = self._flat[h : h + T]
        self._counts = self._flat[h + T : h + T + self._num_exact]
        at = h + T + self._num_exact
        for name in self.table_names:
            if name in self._sketches:
                sk = self._sketches[name]
                n = sk.table.numel()
                sk._bind_table(self._flat[at : at + n])
                at += n

    # -- counting ----------------------------------------------------------------------
    def update(self, kjt: KeyedJaggedTensor) -> None:
        """Count the lookups of one batch (weights, if any, are ignored).

        With the ``decay`` option the existing counts are decayed first, so this batch
        counts 1 per lookup and the previous one ``decay``.
        """
        values = kjt.values()
        bounds = kjt.offset_per_key()
        exact: List[torch.Tensor] = []
        sketched: Dict[str, List[torch.Tensor]] = {}
        lookups = [0] * len(self.tables)
        for k, key in enumerate(kjt.keys()):
            t = self._feature_table.get(key)
            if t is None or bounds[k] == bounds[k + 1]:
                continue
            cfg = self.tables[t]
            ids = values[bounds[k] : bounds[k + 1]].to(self.device, torch.int64)
            lo, hi = (int(v) for v in torch.aminmax(ids))
            if lo < 0 or hi >= cfg.num_embeddings:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"feature {key!r} of table {cfg.name!r}: id {bad} is out of range "
                    f"[0, {cfg.num_embeddings})"
                )
            lookups[t] += ids.numel()
            if cfg.name in self._offset:
                off = self._offset[cfg.name]
                exact.append(ids + off if off else ids)
            else:
                sketched.setdefault(cfg.name, []).append(ids)
        if self.decay is not None:
            self.decay_(self.decay)
        w = 1.0 / self._scale if self.is_float else 1  # lookups are stored divided by the scale
        if exact:
            self._count_exact(torch.cat(exact) if len(exact) > 1 else exact[0], w)
        for name, parts in sketched.items():
            self._sketches[name].update(torch.cat(parts) if len(parts) > 1 else parts[0], w)
        head = [1, kjt.stride() * w] + [n * w for n in lookups]  # batches are never decayed
        self._flat[: len(head)] += torch.tensor(head, dtype=self._flat.dtype, device=self.device)

    def _count_exact(self, flat_ids: torch.Tensor, weight: float = 1) -> None:
        # bincount writes a dense vector of minlength: cheap when the batch is large
        # relative to the counters, otherwise scatter only the touched rows.
        n = self._counts.numel()
        if flat_ids.numel() * 4 >= n:
            self._counts.add_(torch.bincount(flat_ids, minlength=n), alpha=weight)
        else:
            w = torch.full((1,), weight, dtype=self._counts.dtype, device=self.device)
            self._counts.scatter_add_(0, flat_ids, w.expand(flat_ids.numel()))

    # -- decay -------------------------------------------------------------------------
    @property
    def is_float(self) -> bool:
        """Counters are float64 (after a decay, or loaded so); int64 otherwise."""
        return self._flat.is_floating_point()

    def to_float_(self) -> "FrequencyStats":
        """Hold the counters as float64 (a no-op if they already are); views are remade."""
        if not self.is_float:
            self._flat = self._flat.to(torch.float64)
            if self._merged is not None:
                self._merged = self._merged.to(torch.float64)
            self._bind()
        return self

    def decay_(self, factor: float) -> "FrequencyStats":
        """Multiply every count, every table's lookups and ``num_samples`` by ``factor``.

        ``factor`` in (0, 1]; 1 changes nothing. O(1) after the first call (which turns the
        counters float64): the factor goes into a running scale that is folded into the
        counters before any read. Counts a ``decay_`` happened after are unaffected by it,
        so calling ``decay_(f)`` once per batch gives a lookup ``a`` batches old weight
        ``f ** a``. ``num_batches`` (batches seen) is not decayed.
        """
        check_decay(factor)
        if factor == 1:
            return self
        self.to_float_()
        self._scale *= factor
        if self._scale < 1e-150:  # keep stored counts (logical / scale) far from overflow
            self._fold()
        return self

    def _fold(self) -> None:
        """Multiply the running scale into the stored counters (then scale == 1)."""
        if self._scale == 1.0:
            return
        s, self._scale = self._scale, 1.0
        self._flat[1:].mul_(s)  # everything but num_batches
        if self._merged is not None:
            self._merged[1:].mul_(s)
        for sk in self._sketches.values():
            sk._scale_estimates_(s)

    # -- reading -----------------------------------------------------------------------
    @property
    def table_names(self) -> List[str]:
        return [c.name for c in self.tables]

    @property
    def num_batches(self) -> int:
        """Batches counted (summed over ranks by `all_reduce_`; never decayed)."""
        return int(self._flat[0])

    @num_batches.setter
    def num_batches(self, value: int) -> None:
        self._flat[0] = value

    @property
    def num_samples(self) -> float:
        """Samples counted, decayed like the counts (an int until the first decay)."""
        v = self._flat[1]
        return float(v) * self._scale if self.is_float else int(v)

    @num_samples.setter
    def num_samples(self, value: float) -> None:
        self._flat[1] = value / self._scale if self.is_float else value

    def config(self, table: str) -> EmbeddingBagConfig:
        return self.tables[self._table_index(table)]

    def _table_index(self, table: str) -> int:
        if table not in self._index:
            raise KeyError(f"unknown table {table!r}; known: {self.table_names}")
        return self._index[table]

    def is_exact(self, table: str) -> bool:
        self._table_index(table)
        return table in self._offset

    def counts(self, table: str) -> torch.Tensor:
        """Exact per-row counts (a view, length num_embeddings) of an exactly counted table.

        int64, or float64 once decayed. The view is valid until the next update or decay.
        """
        cfg = self.config(table)
        if table not in self._offset:
            raise ValueError(f"table {table!r} is sketched; use top_counts()")
        self._fold()
        off = self._offset[table]
        return self._counts[off : off + cfg.num_embeddings]

    def sketch(self, table: str) -> CountMinTopK:
        self._table_index(table)
        if table not in self._sketches:
            raise ValueError(f"table {table!r} is counted exactly; use counts()")
        self._fold()
        return self._sketches[table]

    def lookups(self, table: str) -> float:
        """Total lookups of a table (exact, also for sketched tables); an int until decayed."""
        i = self._table_index(table)
        if self.is_float:
            return float(self._lookups[i]) * self._scale
        return int(self._lookups[i])

    def top_counts(
        self, table: str, k: Optional[int] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(ids, counts) of rows with nonzero count, most frequent first, ties by id.

        For a sketched table these are its candidates and their Count-Min estimates.
        Counts are int64, or float64 once decayed.
        """
        self._fold()
        if table in self._sketches:
            return self._sketches[table].top(k)
        c = self.counts(table)
        ids = torch.nonzero(c).view(-1)
        return top_by_count(ids, c[ids], k)

    def hot_share(self, hot_ids: Mapping[str, torch.Tensor]) -> Dict[str, float]:
        """Share of each table's counted (decayed) lookups that rows ``hot_ids[table]`` take.

        Exact tables: sum of their counts / lookups; sketched tables: the same with
        Count-Min estimates (an upper bound). Tables absent from ``hot_ids`` have none (0.0);
        a table without lookups gives nan.
        """
        self._fold()
        out = {}
        for name in self.table_names:
            total = self.lookups(name)
            ids = hot_ids.get(name)
            if not total:
                out[name] = float("nan")
            elif ids is None or ids.numel() == 0:
                out[name] = 0.0
            else:
                ids = torch.unique(torch.as_tensor(ids).to(self.device, torch.int64))
                rows = self.config(name).num_embeddings
                if int(ids[0]) < 0 or int(ids[-1]) >= rows:  # sorted: the ends are the extremes
                    bad = int(ids[0]) if int(ids[0]) < 0 else int(ids[-1])
                    raise ValueError(f"hot_share: table {name!r}: hot id {bad} is outside [0, {rows})")
                if name in self._offset:
                    hit = self.counts(name)[ids].sum()
                else:
                    hit = self._sketches[name].estimate(ids).sum()
                out[name] = min(1.0, float(hit) / total)
        return out

    def coverage_meter(self, hot_ids: Mapping[str, torch.Tensor], validate: bool = True) -> HotSetCoverage:
        """A `HotSetCoverage` of these tables for ``hot_ids``: build once, call per batch."""
        return HotSetCoverage(self.tables, hot_ids, device=self.device, validate=validate)

    def batch_coverage(self, kjt: KeyedJaggedTensor, hot_ids: Mapping[str, torch.Tensor]) -> Dict[str, float]:
        """Per table, the share of this batch's lookups in ``hot_ids`` (one-off `coverage_meter`)."""
        return self.coverage_meter(hot_ids)(kjt)

    def memory_bytes(self) -> Dict[str, int]:
        """Bytes of counters held per table (8 per row exact, the sketch's otherwise).

        After `all_reduce_` the merged copy doubles the counters' bytes (not listed here).
        """
        out = {}
        for cfg in self.tables:
            if cfg.name in self._offset:
                out[cfg.name] = cfg.num_embeddings * self._counts.element_size()
            else:
                out[cfg.name] = self._sketches[cfg.name].memory_bytes()
        return out

    # -- combining ---------------------------------------------------------------------
    def check_compatible(self, tables: Sequence[EmbeddingBagConfig]) -> None:
        """Raise ValueError (naming the table) unless `tables` match ours in names and sizes."""
        check_tables_match(tables, self.tables, "these statistics")

    def _check_same_layout(self, other: "FrequencyStats") -> None:
        other.check_compatible(self.tables)
        ours, theirs = [c.name for c in self.tables], [c.name for c in other.tables]
        if ours != theirs:  # the counters are laid out table after table: they would add into other tables
            raise ValueError(f"statistics list the same tables in another order ({theirs} vs {ours}); "
                             "count with the tables in one order")
        if set(self._offset) != set(other._offset):
            raise ValueError("statistics differ in which tables are counted exactly")
        for name, sk in self._sketches.items():
            sk.check_same_shape(other._sketches[name])

    def merge_(self, other: "FrequencyStats") -> "FrequencyStats":
        """Add another statistics object of the same tables into this one.

        Decayed statistics add as they are (each already decayed to "now").
        """
        self._check_same_layout(other)
        other._fold()
        if other.is_float:
            self.to_float_()
        self._fold()
        self._flat += other._flat.to(self.device, self._flat.dtype)
        for name, sk in self._sketches.items():
            o = other._sketches[name]
            o._flush()
            sk._flush(o.cand_ids)
        return self

    @classmethod
    def merged(cls, a: "FrequencyStats", b: "FrequencyStats") -> "FrequencyStats":
        """A new object holding a + b (neither input is changed)."""
        out = cls.from_state(a.state_dict(), tables=a.tables, device=a.device)
        return out.merge_(b)

    def _signature(self) -> List[int]:
        # the tables' names and sizes in their order: ranks that list them in other orders would add
        # one table's counters into another's
        layout = zlib.crc32(";".join(f"{c.name}:{c.num_embeddings}" for c in self.tables).encode())
        return [len(self.tables), self._counts.numel(), len(self._sketches),
                sum(c.num_embeddings for c in self.tables), self.sketch_capacity,
                self._flat.numel(), int(self.is_float), int(self._merged is not None), layout]

    def all_reduce_(self, group=None, check: bool = True) -> "FrequencyStats":
        """Merge every rank's statistics; every rank ends identical (bit for bit).

        The first call sums all counters over the ranks of `group`. Later calls add what
        each rank counted since the previous call to the merged statistics, so merging on a
        schedule never counts a lookup twice; decay applied since then (the same on every
        rank) applies to merged and new counts alike. For this every rank keeps a copy of
        the merged counters (as many bytes as the counters); rank 0's copy is the one
        kept, so every rank receives the same sum.

        Collectives: one SUM all-reduce of the flat buffer (batches, samples, lookups, exact
        counts, every sketch table) plus, with sketched tables, one all-gather of all their
        candidates (unioned and re-estimated from the summed tables). With ``check`` (the
        default) one tiny all-reduce first compares the layouts, counter dtypes and merge
        history of the ranks, so mismatched statistics fail loudly instead of hanging or
        mixing tables.
        """
        self._fold()
        if check:
            self._check_same_on_ranks(group)
        for sk in self._sketches.values():
            sk._flush()
        if self._merged is not None and dist.get_rank(group) != 0:
            self._flat -= self._merged  # only what this rank counted since the last merge
        dist.all_reduce(self._flat, op=dist.ReduceOp.SUM, group=group)
        if self._sketches:
            self._union_sketch_candidates(group)
        if self._merged is None:
            self._merged = self._flat.clone()
        else:
            self._merged.copy_(self._flat)
        return self

    def _check_same_on_ranks(self, group) -> None:
        """One tiny MAX all-reduce of ``_signature()`` and its negation: raise unless every rank holds the same
        layout, counter dtype and merge history (else the SUM all-reduce would hang or mix tables)."""
        sig = torch.tensor(self._signature(), dtype=torch.int64, device=self.device)
        both = torch.cat([sig, -sig])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        if not torch.equal(both[: sig.numel()], -both[sig.numel():]):
            raise ValueError("ranks hold statistics of different tables/layouts, counter "
                             "dtypes (decayed on some ranks only?) or merge histories "
                             "(all_reduce_ or a load of merged statistics on some ranks only?)")

    def _union_sketch_candidates(self, group) -> None:
        """All-gather every sketch's candidates (one collective, padded to capacity with -1) and union each
        rank's into each sketch, re-estimated from the summed tables."""
        names = sorted(self._sketches)  # same order on every rank
        cap = self.sketch_capacity
        padded = torch.full((len(names) * cap,), -1, dtype=torch.int64, device=self.device)
        for i, name in enumerate(names):
            c = self._sketches[name].cand_ids
            padded[i * cap : i * cap + c.numel()] = c
        world = dist.get_world_size(group)
        gathered = torch.empty(world * padded.numel(), dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(gathered, padded, group=group)
        gathered = gathered.view(world, len(names), cap)
        for i, name in enumerate(names):
            ids = gathered[:, i].reshape(-1)
            self._sketches[name]._union_candidates(ids[ids >= 0])

    @property
    def is_merged(self) -> bool:
        """Nothing was counted or added since the last `all_reduce_` (or merged load); a decay, which
        scales the merged copy alike, keeps it so."""
        if self._merged is None:
            return False
        self._fold()
        return torch.equal(self._flat, self._merged)

    # -- persistence -------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """A plain dict (tensors on cpu) describing everything; what save() writes."""
        self._fold()
        return {
            "format_version": FORMAT_VERSION,
            "count_dtype": "float64" if self.is_float else "int64",
            "decay": self.decay,
            "merged": self.is_merged,
            "tables": [
                {"name": c.name, "num_embeddings": c.num_embeddings,
                 "embedding_dim": c.embedding_dim, "feature_names": list(c.feature_names)}
                for c in self.tables
            ],
            "exact_max_rows": self.exact_max_rows,
            "sketch_capacity": self.sketch_capacity,
            "sketch_eps": self.sketch_eps,
            "sketch_delta": self.sketch_delta,
            "seed": self.seed,
            "num_batches": self.num_batches,
            "num_samples": self.num_samples,
            "lookups": {c.name: self.lookups(c.name) for c in self.tables},
            "counts": {n: self.counts(n).cpu().clone() for n in self._offset},
            "sketches": {n: sk.state_dict() for n, sk in self._sketches.items()},
        }

    @classmethod
    def from_state(
        cls,
        state: Dict[str, Any],
        tables: Optional[Sequence[EmbeddingBagConfig]] = None,
        device: Union[torch.device, str] = "cpu",
    ) -> "FrequencyStats":
        """Rebuild statistics from `state_dict()`; raise ValueError saying what is wrong.

        The state is checked against its schema first (keys, types, tensor shapes and dtypes,
        which tables are exact or sketched, counts adding up to the lookups), so a damaged or
        foreign state fails with a message naming the field instead of deep inside.
        A state marked ``merged`` (saved right after `all_reduce_`, identical on every rank)
        loads as merged: a later `all_reduce_` on ranks that all loaded it adds only what
        they count after the load.
        """
        check_state(state)
        saved = [
            EmbeddingBagConfig(num_embeddings=t["num_embeddings"],
                               embedding_dim=t["embedding_dim"], name=t["name"],
                               feature_names=list(t["feature_names"]))
            for t in state["tables"]
        ]
        if tables is not None:
            check_tables_match(tables, saved, "the statistics file")
        out = cls(
            tables if tables is not None else saved,
            exact_max_rows=state["exact_max_rows"], sketch_capacity=state["sketch_capacity"],
            sketch_eps=state["sketch_eps"], sketch_delta=state["sketch_delta"],
            seed=state["seed"], device=device, decay=state.get("decay"),
        )
        if set(out._offset) != set(state["counts"]):
            raise ValueError("statistics file: exactly counted tables do not match its config")
        if state.get("count_dtype", "int64") == "float64":
            out.to_float_()
        for name, c in state["counts"].items():
            out.counts(name).copy_(c)
        for name, sk in state["sketches"].items():
            out._sketches[name].load_state_(sk)
        out._lookups.copy_(torch.tensor([state["lookups"][n] for n in out.table_names], dtype=out._flat.dtype))
        out.num_batches, out.num_samples = state["num_batches"], state["num_samples"]
        if state.get("merged", False):
            out._merged = out._flat.clone()
        return out

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the statistics to one file: torch.save of state_dict() plus a checksum.

        Written to a temporary file beside `path` and renamed into place, so `path` is
        either the old file or the complete new one, never a partial write.
        """
        write_stats_file(self.state_dict(), path)

    @classmethod
    def load(
        cls,
        path: Union[str, os.PathLike],
        tables: Optional[Sequence[EmbeddingBagConfig]] = None,
        device: Union[torch.device, str] = "cpu",
    ) -> "FrequencyStats":
        """Read a file written by save(); with `tables`, refuse one whose tables differ.

        Raises FileNotFoundError for a missing path and `StatsFileError` (a ValueError)
        naming the path for a file that is not a statistics file, is truncated or corrupt
        (checksum mismatch), or does not match the schema.
        """
        return read_stats_file(path, lambda state: cls.from_state(state, tables=tables, device=device))
