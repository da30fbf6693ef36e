"""The schema of a frequency statistics state, and the checks that hold a state to it.

A state is the plain dict `FrequencyStats.state_dict()` returns and a statistics file holds. It is
checked field by field before anything is built from it (and `FrequencyStats` refuses settings a
state could not hold), so a damaged or foreign state fails with a message naming the field instead
of deep inside the counters. Kept apart from counting and from the file so each reads alone.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, TypeGuard

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from torchrec_hybrid.stats.sketch import sketch_shape, table_seed

FORMAT_VERSION = 2  # 2: counters may be float64 (decayed); "count_dtype", "decay", "merged" keys
READABLE_VERSIONS = (1, 2)
COUNT_DTYPES = {"int64": torch.int64, "float64": torch.float64}


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


def check_state(state: Any) -> None:
    """Raise ValueError saying everything wrong with a state (an unreadable version first)."""
    if isinstance(state, dict) and "format_version" in state \
            and not _is_version(state["format_version"]):
        raise ValueError(f"unsupported statistics format_version {state['format_version']!r} "
                         f"(this code reads versions {list(READABLE_VERSIONS)})")
    problems = state_problems(state)
    if problems:
        raise ValueError("not valid frequency statistics: " + "; ".join(problems))


def _is_int(x: Any) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _int_vector_problem(what: str, t: Any, length: Optional[int] = None,
                        dtype: torch.dtype = torch.int64) -> Optional[str]:
    """Problem of a 1-D vector of counts >= 0 of ``dtype`` (int64, or float64: also finite)."""
    want = str(dtype).replace("torch.", "")
    if not isinstance(t, torch.Tensor):
        return f"{what} is a {type(t).__name__}, expected an {want} tensor"
    if t.dtype != dtype or t.dim() != 1:
        return f"{what} is a {t.dtype} tensor of shape {tuple(t.shape)}, expected 1-D {want}"
    if length is not None and t.numel() != length:
        return f"{what} has {t.numel()} entries, expected {length}"
    if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
        return f"{what} holds a non-finite count"
    if t.numel() and t.min() < 0:
        return f"{what} holds a negative count {t.min().item()}"
    return None


def _is_count(x: Any, float_counts: bool) -> bool:
    """A count: an int >= 0, or with float counters also a finite float >= 0."""
    if float_counts:
        return _is_num(x) and math.isfinite(x) and x >= 0
    return _is_int(x) and x >= 0


def state_problems(state: Any) -> List[str]:
    """Everything wrong with a statistics state (empty list: it matches the schema)."""
    header = _header_problems(state)
    if header:
        return header
    dtype = COUNT_DTYPES[state.get("count_dtype", "int64")]
    floats = dtype.is_floating_point
    p = setting_problems(state, floats)
    tables = state["tables"]
    if not isinstance(tables, list) or not tables:
        return p + [f"tables is {type(tables).__name__} {tables!r:.80}, expected a non-empty list"]
    rows, table_problems = _table_problems(tables)
    p += table_problems
    for k in ("lookups", "counts", "sketches"):
        if not isinstance(state[k], dict):
            p.append(f"{k} is a {type(state[k]).__name__}, expected a dict by table name")
    if p:  # the checks below need sound tables and settings
        return p
    return _layout_problems(state, rows, floats) + _counter_problems(state, rows, dtype, floats)


def _is_version(v: Any) -> bool:
    """A format version this code reads: an int of READABLE_VERSIONS (``True == 1`` is no version)."""
    return _is_int(v) and v in READABLE_VERSIONS


def _header_problems(state: Any) -> List[str]:
    """The one problem that makes a state unreadable (not a dict, no version, missing keys, unknown counter
    dtype); empty if none: the other checks need these."""
    if not isinstance(state, dict):
        return [f"the state is a {type(state).__name__}, expected a dict"]
    if "format_version" not in state:
        return ["no 'format_version' key: not a frequency statistics state"]
    required = ["tables", "exact_max_rows", "sketch_capacity", "sketch_eps", "sketch_delta", "seed",
                "num_batches", "num_samples", "lookups", "counts", "sketches"]
    missing = [k for k in required if k not in state]
    if missing:
        return [f"missing key(s) {missing}"]
    v2 = ["count_dtype", "decay", "merged"]
    if state["format_version"] != 1 and any(k not in state for k in v2):
        return [f"missing key(s) {[k for k in v2 if k not in state]}"]
    count_dtype = state.get("count_dtype", "int64")
    if not isinstance(count_dtype, str) or count_dtype not in COUNT_DTYPES:
        return [f"count_dtype is {count_dtype!r}, expected one of {sorted(COUNT_DTYPES)}"]
    return []


def setting_problems(state: Dict[str, Any], floats: bool) -> List[str]:
    """Problems of the scalar settings and totals (decay, merged, sizes, sketch accuracy, seed)."""
    p: List[str] = []
    decay = state.get("decay")
    if decay is not None and (not _is_num(decay) or not 0 < decay <= 1):
        p.append(f"decay is {decay!r}, expected None or a number in (0, 1]")
    if not isinstance(state.get("merged", False), bool):
        p.append(f"merged is {state['merged']!r}, expected a bool")
    for k in ("exact_max_rows", "num_batches"):
        if not _is_int(state[k]) or state[k] < 0:
            p.append(f"{k} is {state[k]!r}, expected an int >= 0")
    if not _is_count(state["num_samples"], floats):
        p.append(f"num_samples is {state['num_samples']!r}, expected "
                 + ("a finite number >= 0" if floats else "an int >= 0"))
    if not _is_int(state["sketch_capacity"]) or state["sketch_capacity"] < 1:
        p.append(f"sketch_capacity is {state['sketch_capacity']!r}, expected an int >= 1")
    if not _is_int(state["seed"]):
        p.append(f"seed is {state['seed']!r}, expected an int")
    for k in ("sketch_eps", "sketch_delta"):
        if not _is_num(state[k]) or not 0 < state[k] < 1:
            p.append(f"{k} is {state[k]!r}, expected a number in (0, 1)")
    return p


def _table_problems(tables: List[Any]) -> Tuple[Dict[str, int], List[str]]:
    """Rows by table name of the sound table entries, and the problems of the others (name, size, dim,
    features)."""
    rows: Dict[str, int] = {}
    p: List[str] = []
    for i, t in enumerate(tables):
        if not isinstance(t, dict):
            p.append(f"tables[{i}] is a {type(t).__name__}, expected a dict")
            continue
        name = t.get("name")
        if not isinstance(name, str) or not name:
            p.append(f"tables[{i}] has name {name!r}, expected a non-empty str")
            continue
        if name in rows:
            p.append(f"table {name!r} appears twice")
        n, d, f = t.get("num_embeddings"), t.get("embedding_dim"), t.get("feature_names")
        if not _is_int(n) or n < 1:
            p.append(f"table {name!r}: num_embeddings is {n!r}, expected an int >= 1")
            continue
        if not _is_int(d) or d < 1:
            p.append(f"table {name!r}: embedding_dim is {d!r}, expected an int >= 1")
        if not isinstance(f, list) or not all(isinstance(x, str) for x in f):
            p.append(f"table {name!r}: feature_names is {f!r:.80}, expected a list of str")
        rows[name] = n
    return rows, p


def _layout_problems(state: Dict[str, Any], rows: Dict[str, int], floats: bool) -> List[str]:
    """Problems of which tables have lookups, exact counts and sketches (exact_max_rows decides), and of the
    lookup totals."""
    p: List[str] = []
    lookups, counts, sketches = state["lookups"], state["counts"], state["sketches"]
    if set(lookups) != set(rows):
        p.append(f"lookups name tables {sorted(lookups)}, expected {sorted(rows)}")
    bad = [f"{k}={v!r}" for k, v in lookups.items() if not _is_count(v, floats)]
    if bad:
        p.append(f"lookups must be {'finite numbers' if floats else 'ints'} >= 0: {', '.join(bad)[:200]}")
    exact = {n for n, r in rows.items() if r <= state["exact_max_rows"]}
    if set(counts) != exact:
        p.append(f"exact counts are for tables {sorted(counts)}; with exact_max_rows="
                 f"{state['exact_max_rows']} they should be for {sorted(exact)}")
    if set(sketches) != set(rows) - exact:
        p.append(f"sketches are for tables {sorted(sketches)}; expected {sorted(set(rows) - exact)}")
    return p


def _counter_problems(state: Dict[str, Any], rows: Dict[str, int], dtype: torch.dtype, floats: bool) -> List[str]:
    """Problems of the counters themselves: each exact count vector (and its sum against the table's lookups)
    and each sketch's state."""
    p: List[str] = []
    lookups = state["lookups"]
    for name, c in state["counts"].items():
        if name not in rows:
            continue
        msg = _int_vector_problem(f"counts of table {name!r}", c, rows[name], dtype)
        if msg:
            p.append(msg)
        elif name in lookups and _is_count(lookups[name], floats):
            total, want = c.sum().item(), lookups[name]
            # float counters: sums in another order differ by rounding only
            if (abs(total - want) > 1e-9 * max(1.0, abs(want))) if floats else total != want:
                p.append(f"counts of table {name!r} add up to {total}, but its lookups are {want}")
    for name, sk in state["sketches"].items():
        if name in rows:
            p += [f"sketch of table {name!r}: {m}" for m in
                  sketch_state_problems(sk, rows[name], state["sketch_capacity"],
                                        table_seed(state["seed"], name) if _is_int(state["seed"]) else None,
                                        dtype)]
    return p


def sketch_state_problems(sk: Any, num_embeddings: int, capacity: int, seed: Optional[int],
                          dtype: torch.dtype = torch.int64) -> List[str]:
    """Schema problems of one `CountMinTopK.state_dict()` for a table of `num_embeddings` rows."""
    if not isinstance(sk, dict):
        return [f"a {type(sk).__name__}, expected a dict"]
    keys = ["num_embeddings", "capacity", "eps", "delta", "seed", "table", "cand_ids", "cand_est"]
    missing = [k for k in keys if k not in sk]
    if missing:
        return [f"missing key(s) {missing}"]
    p: List[str] = []
    if sk["num_embeddings"] != num_embeddings:
        p.append(f"num_embeddings is {sk['num_embeddings']!r}, the table has {num_embeddings}")
    if sk["capacity"] != capacity:
        p.append(f"capacity is {sk['capacity']!r}, the statistics' sketch_capacity is {capacity}")
    if seed is not None and sk["seed"] != seed:
        p.append(f"seed is {sk['seed']!r}, expected {seed} (statistics seed + crc32 of the name)")
    for k in ("eps", "delta"):
        if not _is_num(sk[k]) or not 0 < sk[k] < 1:
            p.append(f"{k} is {sk[k]!r}, expected a number in (0, 1)")
    if p:
        return p
    depth, width = sketch_shape(sk["eps"], sk["delta"])
    for msg in (_int_vector_problem("table", sk["table"], depth * width, dtype),
                _int_vector_problem("cand_ids", sk["cand_ids"]),
                _int_vector_problem("cand_est", sk["cand_est"], None, dtype)):
        if msg:
            p.append(msg)
    if p:
        return p
    ids, est = sk["cand_ids"], sk["cand_est"]
    if ids.numel() != est.numel() or ids.numel() > capacity:
        p.append(f"{ids.numel()} candidate ids and {est.numel()} estimates (capacity {capacity})")
    elif ids.numel() and int(ids.max()) >= num_embeddings:
        p.append(f"candidate id {int(ids.max())} is outside [0, {num_embeddings})")
    return p
