"""``load_planner_config``: a YAML file -> keyword arguments of ``HybridEmbeddingShardingPlanner``.

Sections: ``topology`` (required), ``batch_size``, ``statistics`` (a FrequencyStats file,
relative to the YAML), ``hot_set`` and ``tables`` (per-table ParameterConstraints);
configs/planner.yaml is the documented example of every key.

Every problem raises :class:`PlannerConfigError` naming the offending key (a key that does not
apply, e.g. ``hbm_gb`` on cpu or ``bandwidth_gbps`` with ``comms: torchrec``, included); table
names are checked against the model when it is planned (a name that is no table raises then).

The ``hot_set`` and ``tables`` sections are shared with the DLRM example's config
(``sharding.hot_set`` / ``sharding.tables`` in configs/dlrm.yaml): :func:`parse_hot_set` and
:func:`parse_table_constraints` read them for both, so the same knob has the same name."""

from __future__ import annotations

import math
import os
from typing import AbstractSet, Any, Dict, List, Optional

import yaml
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.types import ParameterConstraints, Topology
from torchrec.distributed.types import ShardingType

from torchrec_hybrid.planner.compute_costs import finite_nonnegative, load_calibration
from torchrec_hybrid.planner.planner import HybridEmbeddingShardingPlanner
from torchrec_hybrid.planner.topology import GB, UniformCommsBandwidth, gbps_to_bytes_per_ms
from torchrec_hybrid.stats import FrequencyStats
from torchrec_hybrid.types import FREQUENCY_HYBRID

KNOWN_SHARDING_TYPES = {t.value for t in ShardingType} | {FREQUENCY_HYBRID}
KNOWN_COMPUTE_KERNELS = {k.value for k in EmbeddingComputeKernel}
_TOP_KEYS = {"topology", "batch_size", "statistics", "hot_set", "tables"}
_TOPOLOGY_KEYS = {"world_size", "compute_device", "local_world_size", "hbm_gb", "ddr_gb", "comms",
                  "bandwidth_gbps", "intra_host_bw_gbps", "inter_host_bw_gbps"}
HOT_SET_KEYS = frozenset({"budget_mb", "max_rows", "min_saving", "compute_costs", "tie_ms"})
TABLE_KEYS = frozenset({"sharding_types", "compute_kernels", "pooling_factors", "num_poolings", "batch_sizes",
               "min_partition"})


class PlannerConfigError(ValueError):
    """The planner YAML is missing something or holds a bad value."""


def _check_keys(section: Dict[str, Any], allowed: AbstractSet[str], where: str) -> None:
    unknown = sorted(set(section) - allowed)
    if unknown:
        raise PlannerConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def _mapping(value: Any, where: str) -> Dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise PlannerConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _positive(value: Any, where: str, kind=float) -> Any:
    if not finite_nonnegative(value) or value <= 0:
        raise PlannerConfigError(f"{where}: expected a positive finite number, got {value!r}")
    if value >= 2 ** 63:  # no count or size a planner takes (an int this large overflows where it is used)
        raise PlannerConfigError(f"{where}: {value!r} is too large")
    if kind is int and int(value) != value:
        raise PlannerConfigError(f"{where}: expected an integer, got {value!r}")
    return kind(value)


def _bytes(amount: float, where: str, given: Any) -> int:
    """A memory size in whole bytes (a positive size that rounds to none is refused: it would be 0; one
    too large for a float, too)."""
    if not math.isfinite(amount):
        raise PlannerConfigError(f"{where}: {given!r} is too large")
    if int(amount) < 1:
        raise PlannerConfigError(f"{where}: {given!r} is less than one byte")
    return int(amount)


_COMMS = ("uniform", "torchrec", "measure")


def _comms(sec: Dict[str, Any]) -> str:
    """``topology.comms``, checked: how the topology's bandwidths are given."""
    comms = sec.get("comms", "uniform")
    if not isinstance(comms, str) or comms not in _COMMS:
        raise PlannerConfigError(f"topology.comms: expected 'uniform', 'torchrec' or 'measure', got {comms!r}")
    return comms


MAX_WORLD_SIZE = 1 << 20


def _topology(sec: Dict[str, Any]) -> Topology:
    """The ``topology`` section; with ``comms: measure`` its bandwidths are TorchRec's defaults until
    ``collective_plan`` replaces them with the measured ones."""
    _check_keys(sec, _TOPOLOGY_KEYS, "topology")
    if "world_size" not in sec:
        raise PlannerConfigError("topology.world_size is required")
    world = _positive(sec["world_size"], "topology.world_size", int)
    if world > MAX_WORLD_SIZE:  # TorchRec's Topology builds per-rank lists: a typo here would exhaust memory
        raise PlannerConfigError(f"topology.world_size: {world} ranks is more than {MAX_WORLD_SIZE} (a typo?)")
    device = sec.get("compute_device", "cpu")
    if device not in ("cpu", "cuda", "mtia"):
        raise PlannerConfigError(f"topology.compute_device: expected cpu, cuda or mtia, got {device!r}")
    local = _positive(sec.get("local_world_size", world), "topology.local_world_size", int)
    if world % local:
        raise PlannerConfigError(f"topology.local_world_size ({local}) must divide world_size ({world})")
    kwargs: Dict[str, Any] = dict(world_size=world, compute_device=device, local_world_size=local)
    if device == "cpu" and "hbm_gb" in sec:
        raise PlannerConfigError("topology.hbm_gb: a cpu topology has no HBM (TorchRec plans it with 0); give its "
                                 "memory as ddr_gb")
    for key, arg in (("hbm_gb", "hbm_cap"), ("ddr_gb", "ddr_cap")):
        if key in sec:
            kwargs[arg] = _bytes(_positive(sec[key], f"topology.{key}") * GB, f"topology.{key}", sec[key])
    comms = _comms(sec)
    other = {"uniform": ("intra_host_bw_gbps", "inter_host_bw_gbps"), "torchrec": ("bandwidth_gbps",),
             "measure": ("bandwidth_gbps", "intra_host_bw_gbps", "inter_host_bw_gbps")}
    misplaced = [k for k in other[comms] if k in sec]
    if misplaced:
        raise PlannerConfigError(f"topology: {misplaced} do not apply with comms: {comms} (uniform takes "
                                 "bandwidth_gbps; torchrec takes intra_host_bw_gbps and inter_host_bw_gbps; "
                                 "measure takes none: it measures them)")
    if comms == "uniform":
        bw = _positive(sec.get("bandwidth_gbps", 1.0), "topology.bandwidth_gbps")
        kwargs["generalized_comms_bandwidths"] = UniformCommsBandwidth(gbps_to_bytes_per_ms(bw))
    elif comms == "torchrec":
        if "intra_host_bw_gbps" in sec:
            kwargs["intra_host_bw"] = gbps_to_bytes_per_ms(_positive(sec["intra_host_bw_gbps"],
                                                                     "topology.intra_host_bw_gbps"))
        if "inter_host_bw_gbps" in sec:
            kwargs["inter_host_bw"] = gbps_to_bytes_per_ms(_positive(sec["inter_host_bw_gbps"],
                                                                     "topology.inter_host_bw_gbps"))
    return Topology(**kwargs)


def _float_list(value: Any, where: str) -> List[float]:
    if not isinstance(value, list) or not value or not all(finite_nonnegative(v) for v in value):
        raise PlannerConfigError(f"{where}: expected a non-empty list of finite numbers >= 0, got {value!r}")
    return [float(v) for v in value]


def _known_names(value: Any, known: AbstractSet[str], where: str) -> List[str]:
    """A non-empty list of names out of ``known``, or PlannerConfigError naming ``where``."""
    if not isinstance(value, list) or not value:
        raise PlannerConfigError(f"{where}: expected a non-empty list, got {value!r}")
    bad = [v for v in value if v not in known]
    if bad:
        raise PlannerConfigError(f"{where}: unknown {bad}; known: {sorted(known)}")
    return list(value)


def parse_table_constraints(sec: Any, where: str = "tables") -> Dict[str, ParameterConstraints]:
    """``{table: {sharding_types: [...], ...}}`` -> ``{table: ParameterConstraints}``."""
    return _constraints(_mapping(sec, where), where)


def _constraints(sec: Dict[str, Any], prefix: str = "tables") -> Dict[str, ParameterConstraints]:
    out = {}
    for name, spec in sec.items():
        where = f"{prefix}.{name}"
        spec = _mapping(spec, where)
        _check_keys(spec, TABLE_KEYS, where)
        kw: Dict[str, Any] = {}
        for key, known in (("sharding_types", KNOWN_SHARDING_TYPES), ("compute_kernels", KNOWN_COMPUTE_KERNELS)):
            if key in spec:
                kw[key] = _known_names(spec[key], known, f"{where}.{key}")
        for key in ("pooling_factors", "num_poolings"):
            if key in spec:
                kw[key] = _float_list(spec[key], f"{where}.{key}")
        if "batch_sizes" in spec:
            sizes = spec["batch_sizes"]
            if not isinstance(sizes, list) or not sizes:
                raise PlannerConfigError(f"{where}.batch_sizes: expected a non-empty list of positive integers, "
                                         f"got {sizes!r}")
            kw["batch_sizes"] = [int(_positive(b, f"{where}.batch_sizes", int)) for b in sizes]
        if "min_partition" in spec:
            kw["min_partition"] = _positive(spec["min_partition"], f"{where}.min_partition", int)
        out[str(name)] = ParameterConstraints(**kw)
    return out


def _statistics(path: Any, base_dir: str) -> Any:
    if not isinstance(path, str) or not path:
        raise PlannerConfigError(f"statistics: expected a file path, got {path!r}")
    full = path if os.path.isabs(path) else os.path.join(base_dir, path)
    if not os.path.exists(full):
        raise PlannerConfigError(f"statistics: file {full!r} does not exist")
    try:
        return FrequencyStats.load(full)
    except Exception as e:  # noqa: BLE001 - re-raised with the key that named the file
        raise PlannerConfigError(f"statistics: cannot read {full!r}: {e}") from e


def parse_hot_set(sec: Any, where: str = "hot_set", base_dir: Optional[str] = None) -> Dict[str, Any]:
    """``{budget_mb, max_rows, min_saving, compute_costs, tie_ms}`` -> planner kwargs
    (``hot_budget_bytes``, ``max_hot_rows``, ``min_saving``, ``compute_costs``, ``tie_ms``); a
    missing or null value keeps the planner's default. ``compute_costs``: ``default`` (the fit for the
    topology's device), ``network`` (bytes and collectives only, as for a network-bound
    cluster) or the path of a ``benchmarks/calibrate.py`` results JSON (a relative one from
    ``base_dir``, the YAML's folder as for ``statistics``; None: the working directory)."""
    hot = _mapping(sec, where)
    _check_keys(hot, set(HOT_SET_KEYS), where)
    out: Dict[str, Any] = {}
    if hot.get("budget_mb") is not None:
        out["hot_budget_bytes"] = _bytes(_positive(hot["budget_mb"], f"{where}.budget_mb") * 1024 * 1024,
                                         f"{where}.budget_mb", hot["budget_mb"])
    if hot.get("max_rows") is not None:
        out["max_hot_rows"] = _positive(hot["max_rows"], f"{where}.max_rows", int)
    if hot.get("min_saving") is not None:
        ms = hot["min_saving"]
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 <= ms < 1:
            raise PlannerConfigError(f"{where}.min_saving: expected a number in [0, 1), got {ms!r}")
        out["min_saving"] = float(ms)
    tie = hot.get("tie_ms")
    if tie is not None:
        if tie not in ("fit_error", "auto") and not finite_nonnegative(tie):
            raise PlannerConfigError(f"{where}.tie_ms: expected a finite number of ms >= 0, 'fit_error' or 'auto', "
                                     f"got {tie!r}")
        out["tie_ms"] = tie if tie in ("fit_error", "auto") else float(tie)
    cc = hot.get("compute_costs")
    if cc is not None:
        if not isinstance(cc, str) or not cc:
            raise PlannerConfigError(f"{where}.compute_costs: expected 'default', 'network' or a calibration "
                                     f"JSON path, got {cc!r}")
        if cc == "network":
            out["compute_costs"] = None
        elif cc != "default":
            if base_dir is not None and not os.path.isabs(cc):
                cc = os.path.join(base_dir, cc)
            try:
                out["compute_costs"] = load_calibration(cc)
            except ValueError as e:
                raise PlannerConfigError(f"{where}.compute_costs: {e}") from e
    return out


def load_planner_config(path: str) -> Dict[str, Any]:
    """Read the YAML at ``path``; returns ``HybridEmbeddingShardingPlanner(**kwargs)`` kwargs.

    Keys: topology, batch_size, constraints, frequency_stats (if ``statistics`` is given),
    hot_budget_bytes / max_hot_rows / min_saving / compute_costs / tie_ms (if ``hot_set`` gives them),
    network="measure" (if ``topology.comms`` is ``measure``).
    """
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise PlannerConfigError(f"planner config {path!r} does not exist") from None
    except yaml.YAMLError as e:
        raise PlannerConfigError(f"{path}: not valid YAML: {e}") from e
    try:
        return _planner_kwargs(_mapping(raw, path), path)
    except PlannerConfigError as e:  # name the file every field error came from
        raise (e if str(e).startswith(path) else PlannerConfigError(f"{path}: {e}")) from None


def _planner_kwargs(cfg: Dict[str, Any], path: str) -> Dict[str, Any]:
    _check_keys(cfg, _TOP_KEYS, path)
    if "topology" not in cfg:
        raise PlannerConfigError(f"{path}: 'topology' section is required")
    topology = _mapping(cfg["topology"], "topology")
    out: Dict[str, Any] = {"topology": _topology(topology)}
    if _comms(topology) == "measure":
        out["network"] = "measure"
    if "batch_size" in cfg:
        out["batch_size"] = _positive(cfg["batch_size"], "batch_size", int)
    out["constraints"] = _constraints(_mapping(cfg.get("tables"), "tables")) or None
    base_dir = os.path.dirname(os.path.abspath(path))  # relative paths in the file are from its folder
    if cfg.get("statistics") is not None:
        out["frequency_stats"] = _statistics(cfg["statistics"], base_dir)
    out.update(parse_hot_set(cfg.get("hot_set"), "hot_set", base_dir))
    return out


def planner_from_config(path: str, **overrides: Any):
    """``HybridEmbeddingShardingPlanner`` built from the YAML (keyword overrides win)."""
    kwargs = load_planner_config(path)
    kwargs.update(overrides)
    return HybridEmbeddingShardingPlanner(**kwargs)


__all__ = ["HOT_SET_KEYS", "TABLE_KEYS", "PlannerConfigError", "load_planner_config", "parse_hot_set",
           "parse_table_constraints", "planner_from_config"]
