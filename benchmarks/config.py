"""What one benchmark run measures: a `Workload` per configuration, grouped by run mode.

A workload fixes everything that makes two sharding types comparable: world size, tables,
batch, id distribution, model and hot-set rule. Every sharding type of a workload is built
in the same process group and timed interleaved on the same batches (see measure.py).
"""

from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Tuple

SHARDING_TYPES: Tuple[str, ...] = (
    "frequency_hybrid", "table_wise", "column_wise", "row_wise", "data_parallel", "planner",
)
STOCK_TYPES: Tuple[str, ...] = SHARDING_TYPES[1:]
# The hybrid planner's plans (models.py), by their pricing of compute: the default calibration for
# the device (what a user of the machine gets) and none (bytes and collectives: a network-bound cluster).
PLANNER_COMPUTE_COSTS: Dict[str, object] = {"hybrid_planner": "default", "hybrid_planner_bytes": None}
PLANNER_TYPES: Tuple[str, ...] = tuple(PLANNER_COMPUTE_COSTS)


@dataclass(frozen=True)
class Workload:
    """One configuration. ``alpha=0`` means uniform ids (Zipf exponent 0)."""

    world: int = 4
    model: str = "ebc"            # "ebc" (EBC + loss on pooled output) or "dlrm"
    multi_hot: bool = False       # False: one id per feature; True: MLPerf DLRMv2 sizes
    alpha: float = 1.1
    rows_cap: int = 100_000       # Criteo-Kaggle cardinalities capped at this
    dim: int = 64
    batch_per_rank: int = 1024
    hot_rows: int = 2000          # most popular rows across all tables, replicated
    stats_batches: int = 4        # global batches counted by FrequencyStats for the hot set
    warmup: int = 3               # untimed steps per model before timing
    steps: int = 20               # timed steps per model (interleaved, balanced orders)
    types: Tuple[str, ...] = SHARDING_TYPES
    device: str = "cpu"
    seed: int = 0

    @property
    def name(self) -> str:
        dist = "uniform" if self.alpha == 0 else f"zipf{self.alpha:g}"
        hot = "multihot" if self.multi_hot else "onehot"
        return f"W{self.world}-{self.device}-{self.model}-{hot}-{dist}-H{self.hot_rows}"

    def as_dict(self) -> Dict:
        d = asdict(self)
        d["name"] = self.name
        d["types"] = list(self.types)
        return d


HEADLINE = Workload(world=4, model="ebc", multi_hot=False, alpha=1.1, rows_cap=100_000, dim=64,
                    batch_per_rank=1024, hot_rows=2000, warmup=5, steps=40,  # 5 cycles of the 8 orders
                    types=SHARDING_TYPES + PLANNER_TYPES)

ALPHAS = (1.05, 1.1, 1.2, 0.0)
# sizes of the sweeps (quick and full): 26 tables capped at 10k rows, B=256 per rank
SWEEP = dict(rows_cap=10_000, dim=64, batch_per_rank=256, hot_rows=500, warmup=1, steps=6)
# the full run's sweep: 40 interleaved timed steps per configuration (5 cycles of the 8 models' orders), as the
# step-time comparisons ask; at 6 the same plan measured up to 1.3x itself
FULL_SWEEP = dict(SWEEP, warmup=2, steps=40)


def _grid(worlds, models, hots, alphas, **kw) -> List[Workload]:
    return [Workload(world=w, model=m, multi_hot=h, alpha=a, **kw)
            for w in worlds for m in models for h in hots for a in alphas]


def mode_workloads(mode: str, cuda: bool = False) -> List[Workload]:
    """The configurations of a run mode ('tiny', 'quick', 'full', 'headline')."""
    if mode == "headline":
        out = [HEADLINE]
    elif mode == "tiny":
        # seconds: small tables and batch, every model/hotness kind, two id laws
        tiny = dict(rows_cap=2_000, dim=16, batch_per_rank=64, hot_rows=200, stats_batches=2, warmup=1, steps=3)
        out = [Workload(world=2, model="ebc", multi_hot=False, alpha=1.1, **tiny),
               Workload(world=2, model="ebc", multi_hot=False, alpha=0.0, **tiny),
               Workload(world=2, model="dlrm", multi_hot=True, alpha=1.1, types=SHARDING_TYPES + PLANNER_TYPES,
                        **tiny)]
    elif mode == "quick":
        # a subset at a smaller table cap and batch (data_parallel all-reduces whole tables:
        # at the headline's 100k cap one of its steps alone takes seconds here)
        out = _grid([2], ["ebc"], [False], ALPHAS, **SWEEP)
        out += _grid([4], ["ebc"], [False], [1.1, 0.0], **SWEEP)
        out += [Workload(world=4, model="dlrm", multi_hot=False, alpha=1.1, **SWEEP),
                Workload(world=4, model="ebc", multi_hot=True, alpha=1.1, **SWEEP)]
    elif mode == "full":  # the sweep also measures the hybrid planner's plans at every configuration
        out = [HEADLINE] + _grid([2, 4], ["ebc", "dlrm"], [False, True], ALPHAS, types=SHARDING_TYPES + PLANNER_TYPES,
                                 **FULL_SWEEP)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    if cuda:
        out += [replace(w, world=1, device="cuda") for w in out if w.world == 2]
    return out


def hot_row_sweep(mode: str) -> List[Workload]:
    """Bytes vs hot rows: the hybrid alone at several hot-set sizes (same data)."""
    if mode == "tiny":
        base = replace(mode_workloads("tiny")[0], types=("frequency_hybrid",))
        return [replace(base, hot_rows=h) for h in (0, 800)]
    if mode in ("quick", "full"):
        base = Workload(world=4, model="ebc", multi_hot=False, alpha=1.1, types=("frequency_hybrid",), **SWEEP)
        return [replace(base, hot_rows=h) for h in (0, 100, 2000, 8000)]
    return []


# Fields a command-line flag may set for every configuration of a run (see apply_overrides).
OVERRIDABLE: Tuple[str, ...] = ("world", "model", "multi_hot", "alpha", "rows_cap", "dim", "batch_per_rank",
                                "hot_rows", "warmup", "steps")


def check_override(field: str, value) -> None:
    """Raise ValueError naming the field and the value unless a run can use it."""
    ok = {
        "world": lambda v: isinstance(v, int) and v >= 2,
        "model": lambda v: v in ("ebc", "dlrm"),
        "multi_hot": lambda v: isinstance(v, bool),
        "alpha": lambda v: isinstance(v, (int, float)) and 0 <= v < float("inf"),
        "rows_cap": lambda v: isinstance(v, int) and v >= 1,
        # column_wise splits the dim into 2 shards; FBGEMM wants shard dims in multiples of 4
        "dim": lambda v: isinstance(v, int) and v >= 8 and v % 8 == 0,
        "batch_per_rank": lambda v: isinstance(v, int) and v >= 1,
        "hot_rows": lambda v: isinstance(v, int) and v >= 0,
        "warmup": lambda v: isinstance(v, int) and v >= 0,
        "steps": lambda v: isinstance(v, int) and v >= 1,
    }
    need = {"world": "an int >= 2 (the comparison needs 2 ranks)", "model": "'ebc' or 'dlrm'",
            "multi_hot": "True or False", "alpha": "a finite number >= 0 (0: uniform ids)",
            "rows_cap": "an int >= 1", "dim": "a multiple of 8 (column_wise makes 2 shards)",
            "batch_per_rank": "an int >= 1", "hot_rows": "an int >= 0", "warmup": "an int >= 0",
            "steps": "an int >= 1"}
    if field not in ok:
        raise ValueError(f"{field!r} cannot be overridden; fields: {list(OVERRIDABLE)}")
    if not ok[field](value):
        raise ValueError(f"{field} must be {need[field]}, got {value!r}")


def apply_overrides(workloads: List[Workload], overrides: Dict[str, object]) -> List[Workload]:
    """Every workload with each given field set: a list value gives one workload per value
    (so ``{"world": [2, 4]}`` runs every configuration at W=2 and W=4). Configurations that
    become identical are measured once; order is kept. ``world`` leaves the CUDA configurations
    alone: they run on one GPU (W=1; each rank would take ``cuda:<rank>``)."""
    out: List[Workload] = []
    for w in workloads:
        variants = [w]
        for field, value in overrides.items():
            values = list(value) if isinstance(value, (list, tuple)) else [value]
            for v in values:
                check_override(field, v)
            if field == "world" and w.device == "cuda":
                continue
            variants = [replace(x, **{field: v}) for x in variants for v in values]
        out += [x for x in variants if x not in out]
    return out


def sweep_overrides(overrides: Dict[str, object]) -> Dict[str, object]:
    """The overrides for the hot-row sweep: one value per field (the first of a list), and
    not the hot-set size, which the sweep varies."""
    return {k: (v[0] if isinstance(v, (list, tuple)) else v) for k, v in overrides.items() if k != "hot_rows"}
