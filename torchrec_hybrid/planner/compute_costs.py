"""Default compute prices for the planner's cost model, per compute device.

The planner prices a plan as bytes / bandwidth + compute work (``cost_model.ComputeCosts``)
+ collectives. The prices depend on the machine, so they are measured, not guessed:
``python -m benchmarks.calibrate`` trains several plans on the user's own ranks and fits
them (``docs/architecture.md``, "cost model"). The CPU defaults below are that fit on the
development machine (4 gloo ranks on 2 cores, the product benchmark's sizes and the sweep's
smaller ones, ``benchmarks/results/calibration.json``; a test keeps them equal). No GPU fit
exists yet: on CUDA the default prices are zero (bytes and collectives only, as before
compute was priced) until a user passes their own fit. The fit's relative error (``rms_rel``)
is the planner's default ``stock_margin``: a plan must beat TorchRec's by more than it to
replace it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Dict, Optional

from torchrec_hybrid.planner.cost_model import ComputeCosts

CPU_GLOO = ComputeCosts(
    lookup=0.685,
    vector_stock=4.851,
    vector_hybrid=4.867,
    ids_stock=0.0,
    ids_hybrid=21.56,
    group_stock_ms=4.252,
    group_hybrid_ms=4.076,
    ns_per_byte=0.3085,
    collective_ms=0.4979,
    busiest_share=0.0,
    rms_ms=1.777,
    rms_rel=0.08678,
    source="benchmarks/results/calibration.json",
)


def finite_nonnegative(value: Any) -> bool:
    """A number of ms or similar: an int or float (not a bool) in ``[0, inf)``."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 <= value < math.inf


# terms a calibration may lack (fits made before they existed): their ComputeCosts defaults
OPTIONAL_TERMS = {"collective_ms", "busiest_share"}


def load_calibration(path: str) -> ComputeCosts:
    """The prices fitted by ``python -m benchmarks.calibrate --out PREFIX`` (``PREFIX.json``),
    to pass as ``HybridEmbeddingShardingPlanner(compute_costs=...)`` on the machine measured."""
    try:
        with open(path) as f:
            fit: Dict[str, Any] = json.load(f)["fit"]
        costs: Dict[str, Any] = fit["costs"]
        if not isinstance(costs, dict):
            raise TypeError(f"fit.costs is a {type(costs).__name__}, not a mapping of terms to prices")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a calibration file of benchmarks/calibrate.py ({e!r})") from e
    errors = {k: fit.get(k) for k in ("rms_ms", "rms_rel")}
    for k, v in errors.items():
        if v is not None and not finite_nonnegative(v):
            raise ValueError(f"{path}: the fit's {k} must be a finite number >= 0, got {v!r}")
    known = {f.name for f in dataclasses.fields(ComputeCosts)} - {"source", "rms_ms", "rms_rel"}
    unknown, missing = set(costs) - known, known - set(costs) - OPTIONAL_TERMS
    if unknown or missing:
        raise ValueError(f"{path}: calibration terms differ from ComputeCosts: unknown {sorted(unknown)}, "
                         f"missing {sorted(missing)}")
    bad = {k: v for k, v in costs.items() if not finite_nonnegative(v)}  # not inf (0 x inf = NaN), not true
    if bad:
        raise ValueError(f"{path}: prices must be finite numbers >= 0, got {bad}")
    if costs.get("busiest_share", 0.0) > 1.0:
        raise ValueError(f"{path}: busiest_share is a share of a step, 0..1, got {costs['busiest_share']}")
    rms, rel = (None if v is None else float(v) for v in (errors["rms_ms"], errors["rms_rel"]))
    return ComputeCosts(**{k: float(v) for k, v in costs.items()}, rms_ms=rms, rms_rel=rel, source=path)


def default_compute_costs(compute_device: str) -> Optional[ComputeCosts]:
    """The prices the planner uses when the user passes none."""
    return CPU_GLOO if compute_device == "cpu" else None
