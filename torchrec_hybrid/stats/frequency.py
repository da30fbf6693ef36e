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
and every rank derives the same hot set from them.
"""

from __future__ import annotations

import logging
import os
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_hybrid.stats.sketch import CountMinTopK, top_by_count

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
DEFAULT_EXACT_MAX_ROWS = 1 << 24  # 16.8M rows = 128 MiB of int64 counters


def _table_key(cfg: EmbeddingBagConfig) -> Tuple[str, int]:
    return cfg.name, cfg.num_embeddings


def check_tables_match(
    expected: Sequence[EmbeddingBagConfig], found: Sequence[EmbeddingBagConfig], what: str
) -> None:
    """Raise ValueError naming every table whose name or size differs."""
    exp = dict(map(_table_key, expected))
    got = dict(map(_table_key, found))
    problems = [f"table {n!r} is missing from {what}" for n in exp if n not in got]
    problems += [f"table {n!r} has {got[n]} rows in {what}, expected {r}"
                 for n, r in exp.items() if n in got and got[n] != r]
    problems += [f"table {n!r} in {what} is not an expected table" for n in got if n not in exp]
    if problems:
        raise ValueError("; ".join(problems))


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
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        exact_max_rows: int = DEFAULT_EXACT_MAX_ROWS,
        sketch_capacity: int = 100_000,
        sketch_eps: float = 1e-5,
        sketch_delta: float = 0.05,
        seed: int = 0,
        device: Union[torch.device, str] = "cpu",
    ) -> None:
        self.tables: List[EmbeddingBagConfig] = list(tables)
        self.exact_max_rows = exact_max_rows
        self.sketch_capacity = sketch_capacity
        self.sketch_eps, self.sketch_delta, self.seed = sketch_eps, sketch_delta, seed
        self.device = torch.device(device)
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
        # Exact tables share one flat vector; _offset[name] is where a table starts.
        self._offset: Dict[str, int] = {}
        self._sketches: Dict[str, CountMinTopK] = {}
        total = 0
        for cfg in self.tables:
            if cfg.num_embeddings <= exact_max_rows:
                self._offset[cfg.name] = total
                total += cfg.num_embeddings
            else:
                sk = CountMinTopK(
                    cfg.num_embeddings, sketch_capacity, sketch_eps, sketch_delta,
                    seed=seed + zlib.crc32(cfg.name.encode()), device=self.device,
                )
                if sk.memory_bound_bytes() >= 8 * cfg.num_embeddings:
                    logger.warning("table %s: its sketch (%d B) is not smaller than exact "
                                   "counts (%d B); raise exact_max_rows", cfg.name,
                                   sk.memory_bound_bytes(), 8 * cfg.num_embeddings)
                self._sketches[cfg.name] = sk
        self._counts = torch.zeros(total, dtype=torch.int64, device=self.device)
        self._lookups = torch.zeros(len(self.tables), dtype=torch.int64, device=self.device)
        self.num_batches = 0
        self.num_samples = 0

    # -- counting ----------------------------------------------------------------------
    def update(self, kjt: KeyedJaggedTensor) -> None:
        """Count the lookups of one batch (weights, if any, are ignored)."""
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
        if exact:
            self._count_exact(torch.cat(exact) if len(exact) > 1 else exact[0])
        for name, parts in sketched.items():
            self._sketches[name].update(torch.cat(parts) if len(parts) > 1 else parts[0])
        self._lookups += torch.tensor(lookups, dtype=torch.int64, device=self.device)
        self.num_batches += 1
        self.num_samples += kjt.stride()

    def _count_exact(self, flat_ids: torch.Tensor) -> None:
        # bincount writes a dense vector of minlength: cheap when the batch is large
        # relative to the counters, otherwise scatter only the touched rows.
        n = self._counts.numel()
        if flat_ids.numel() * 4 >= n:
            self._counts += torch.bincount(flat_ids, minlength=n)
        else:
            one = torch.ones(1, dtype=torch.int64, device=self.device)
            self._counts.scatter_add_(0, flat_ids, one.expand(flat_ids.numel()))

    # -- reading -----------------------------------------------------------------------
    @property
    def table_names(self) -> List[str]:
        return [c.name for c in self.tables]

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
        """Exact per-row counts (a view, length num_embeddings) of an exactly counted table."""
        cfg = self.config(table)
        if table not in self._offset:
            raise ValueError(f"table {table!r} is sketched; use top_counts()")
        off = self._offset[table]
        return self._counts[off : off + cfg.num_embeddings]

    def sketch(self, table: str) -> CountMinTopK:
        self._table_index(table)
        if table not in self._sketches:
            raise ValueError(f"table {table!r} is counted exactly; use counts()")
        return self._sketches[table]

    def lookups(self, table: str) -> int:
        """Total lookups of a table (exact, also for sketched tables)."""
        return int(self._lookups[self._table_index(table)])

    def top_counts(
        self, table: str, k: Optional[int] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(ids, counts) of rows with nonzero count, most frequent first, ties by id.

        For a sketched table these are its candidates and their Count-Min estimates.
        """
        if table in self._sketches:
            return self._sketches[table].top(k)
        c = self.counts(table)
        ids = torch.nonzero(c).view(-1)
        return top_by_count(ids, c[ids], k)

    def memory_bytes(self) -> Dict[str, int]:
        """Bytes of counters held per table (8 per row exact, the sketch's otherwise)."""
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
        if set(self._offset) != set(other._offset):
            raise ValueError("statistics differ in which tables are counted exactly")

    def merge_(self, other: "FrequencyStats") -> "FrequencyStats":
        """Add another statistics object of the same tables into this one."""
        self._check_same_layout(other)
        self._counts += other._counts.to(self.device)
        self._lookups += other._lookups.to(self.device)
        for name, sk in self._sketches.items():
            sk.merge_(other._sketches[name])
        self.num_batches += other.num_batches
        self.num_samples += other.num_samples
        return self

    @classmethod
    def merged(cls, a: "FrequencyStats", b: "FrequencyStats") -> "FrequencyStats":
        """A new object holding a + b (neither input is changed)."""
        out = cls.from_state(a.state_dict(), tables=a.tables, device=a.device)
        return out.merge_(b)

    def all_reduce_(self, group=None) -> "FrequencyStats":
        """Sum statistics over the ranks of `group`; every rank ends identical.

        Exact counts, lookups and sample counters are all-reduced with SUM; each sketch
        sums its Count-Min tables and unions its candidates (sketch.all_reduce_). A
        layout signature is checked first so mismatched tables fail loudly instead of
        hanging or mixing tables.
        """
        import torch.distributed as dist

        sig = torch.tensor(
            [len(self.tables), self._counts.numel(), len(self._sketches),
             sum(c.num_embeddings for c in self.tables), self.sketch_capacity],
            dtype=torch.int64, device=self.device,
        )
        lo, hi = sig.clone(), sig.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
        if not torch.equal(lo, hi):
            raise ValueError("ranks hold statistics of different tables/layouts")
        dist.all_reduce(self._counts, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(self._lookups, op=dist.ReduceOp.SUM, group=group)
        seen = torch.tensor([self.num_batches, self.num_samples], device=self.device)
        dist.all_reduce(seen, op=dist.ReduceOp.SUM, group=group)
        self.num_batches, self.num_samples = (int(v) for v in seen)
        for name in sorted(self._sketches):  # same order on every rank
            self._sketches[name].all_reduce_(group)
        return self

    # -- persistence -------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """A plain dict (tensors on cpu) describing everything; what save() writes."""
        return {
            "format_version": FORMAT_VERSION,
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
        version = state.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"unsupported statistics format_version {version!r}")
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
            seed=state["seed"], device=device,
        )
        if set(out._offset) != set(state["counts"]):
            raise ValueError("statistics file: exactly counted tables do not match its config")
        for name, c in state["counts"].items():
            out.counts(name).copy_(c)
        for name, sk in state["sketches"].items():
            out._sketches[name] = CountMinTopK.from_state_dict(sk, device=out.device)
        out._lookups.copy_(torch.tensor([state["lookups"][n] for n in out.table_names]))
        out.num_batches, out.num_samples = state["num_batches"], state["num_samples"]
        return out

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the statistics to one file (torch.save of state_dict())."""
        torch.save(self.state_dict(), path)

    @classmethod
    def load(
        cls,
        path: Union[str, os.PathLike],
        tables: Optional[Sequence[EmbeddingBagConfig]] = None,
        device: Union[torch.device, str] = "cpu",
    ) -> "FrequencyStats":
        """Read a file written by save(); with `tables`, refuse one whose tables differ."""
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or "format_version" not in state:
            raise ValueError(f"{path}: not a frequency statistics file")
        return cls.from_state(state, tables=tables, device=device)
