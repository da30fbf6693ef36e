"""Config for the DLRM example: a validated schema, one YAML file and command-line overrides.

The schema is the dataclasses below (configs/dlrm.yaml documents every key). Loading checks
every key and value: an unknown key, a value of the wrong type or out of range raises
:class:`ConfigError` naming the key (``data.batch_size``) and the allowed keys or values.
A key the file leaves out takes the default shown here.

``sharding.hot_set`` and ``sharding.tables`` are the hybrid planner's own sections, with the
same names and keys as in configs/planner.yaml, and are checked by the same functions
(``torchrec_hybrid.planner.config.parse_hot_set`` / ``parse_table_constraints``).

Overrides:

- ``--set a.b=value`` (repeatable); the value is parsed as YAML (``--set train.steps=50``,
  ``--set model.dense_arch=[64,16]``, ``--set checkpoint.dir=null``);
- shortcuts for the common ones: ``--steps``, ``--batch-size``, ``--planner``,
  ``--checkpoint-dir``, ``--resume``, ``--seed``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from typing import Any, Dict, List, Literal, Optional, Sequence, Union

import yaml

from torchrec_hybrid.planner.config import parse_hot_set, parse_table_constraints

SHORTCUTS = {  # --flag -> config key
    "steps": "train.steps",
    "batch_size": "data.batch_size",
    "planner": "sharding.planner",
    "checkpoint_dir": "checkpoint.dir",
    "seed": "seed",
}


class ConfigError(ValueError):
    """A config key or value is not allowed; the message names the key."""


def _check(fn, text: str) -> Dict[str, Any]:
    """Field metadata: ``fn(value)`` must hold, else ``text`` describes what is allowed."""
    return {"check": fn, "allowed": text}


def _positive(text: str = "a finite number > 0") -> Dict[str, Any]:
    return _check(lambda v: math.isfinite(v) and v > 0, text)  # inf: no timeout or rate the run can use


def _non_negative(text: str = "a finite number >= 0") -> Dict[str, Any]:
    return _check(lambda v: math.isfinite(v) and v >= 0, text)


@dataclasses.dataclass
class DistConfig:
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_s: float = dataclasses.field(default=300.0, metadata=_positive())
    # progress watchdog: a training step (between two step boundaries; checkpoint writes and
    # validation excepted) taking longer than this ends every waiting rank with an error naming
    # the stuck rank (0: off, only the process-group timeout above)
    step_timeout_s: float = dataclasses.field(default=120.0, metadata=_non_negative())


@dataclasses.dataclass
class LabelConfig:
    base_ctr: float = dataclasses.field(default=0.25, metadata=_check(lambda v: 0 < v < 1, "a number in (0, 1)"))
    dense_weight_std: float = dataclasses.field(default=1.0, metadata=_non_negative())
    effect_features: List[str] = dataclasses.field(default_factory=list)
    effect_std: float = dataclasses.field(default=0.7, metadata=_non_negative())


@dataclasses.dataclass
class DataConfig:
    source: Literal["synthetic", "criteo_tsv", "criteo_npy"] = "synthetic"
    paths: List[str] = dataclasses.field(default_factory=list)
    dir: Optional[str] = None
    validation_paths: List[str] = dataclasses.field(default_factory=list)  # criteo_tsv held-out files
    validation_dir: Optional[str] = None  # criteo_npy held-out days
    batch_size: int = dataclasses.field(default=2048, metadata=_positive("an integer > 0"))
    cardinalities: Union[Literal["kaggle", "terabyte"], List[int]] = "kaggle"
    scale: float = dataclasses.field(default=0.05, metadata=_positive())
    max_rows: Optional[int] = dataclasses.field(default=None, metadata=_positive("null or an integer > 0"))
    multi_hot: Union[bool, List[int]] = False
    alpha: float = dataclasses.field(default=1.1, metadata=_non_negative())
    # synthetic: popularity drift (SyntheticCriteo's drift / drift_rows / drift_mode): before
    # global batch i each table's rank -> id map is rotated by floor(i * rate) ranks
    drift: float = dataclasses.field(default=0.0, metadata=_check(lambda v: 0 <= v <= 1, "a number in [0, 1]"))
    drift_rows: float = dataclasses.field(default=0.0, metadata=_non_negative())
    drift_mode: Literal["rise", "burst"] = "rise"
    label: LabelConfig = dataclasses.field(default_factory=LabelConfig)


@dataclasses.dataclass
class ModelConfig:
    embedding_dim: int = dataclasses.field(default=16, metadata=_positive("an integer > 0"))
    pooling: Literal["sum", "mean"] = "sum"
    dense_arch: List[int] = dataclasses.field(default_factory=lambda: [64, 16])
    over_arch: List[int] = dataclasses.field(default_factory=lambda: [64, 32, 1])


@dataclasses.dataclass
class EmbeddingOptimConfig:
    optimizer: Literal["sgd", "adagrad", "rowwise_adagrad"] = "rowwise_adagrad"
    lr: float = dataclasses.field(default=0.05, metadata=_positive())
    eps: float = dataclasses.field(default=1e-8, metadata=_non_negative())


@dataclasses.dataclass
class DenseOptimConfig:
    optimizer: Literal["sgd", "adagrad", "adam"] = "adagrad"
    lr: float = dataclasses.field(default=0.05, metadata=_positive())
    eps: float = dataclasses.field(default=1e-8, metadata=_non_negative())


@dataclasses.dataclass
class OptimConfig:
    embedding: EmbeddingOptimConfig = dataclasses.field(default_factory=EmbeddingOptimConfig)
    dense: DenseOptimConfig = dataclasses.field(default_factory=DenseOptimConfig)


@dataclasses.dataclass
class StatsConfig:
    batches: int = dataclasses.field(default=20, metadata=_non_negative("an integer >= 0"))
    file: Optional[str] = None
    save: Optional[str] = None


@dataclasses.dataclass
class ManualHotSetConfig:
    """``HotSetRule`` of the manual planner: exactly one of the three."""

    coverage: Optional[float] = dataclasses.field(
        default=None, metadata=_check(lambda v: 0 < v <= 1, "null or a number in (0, 1]"))
    rows_per_table: Optional[int] = dataclasses.field(default=None, metadata=_non_negative("null or an integer >= 0"))
    memory_budget_bytes: Optional[int] = dataclasses.field(default=None,
                                                           metadata=_non_negative("null or an integer >= 0"))


@dataclasses.dataclass
class RefreshConfig:
    """Hot sets that follow the data (examples/dlrm/refresh.py); off when every=0 and
    min_coverage is null."""

    every: int = dataclasses.field(default=0, metadata=_non_negative("an integer >= 0"))
    min_coverage: Optional[float] = dataclasses.field(
        default=None, metadata=_check(lambda v: 0 < v <= 1, "null or a number in (0, 1]"))
    decay: float = dataclasses.field(default=0.99, metadata=_check(lambda v: 0 < v <= 1, "a number in (0, 1]"))
    window: int = dataclasses.field(default=10, metadata=_positive("an integer > 0"))


def _network_ok(value: Any) -> bool:
    """``sharding.network``: one of its words, or a finite bandwidth > 0 (GiB/s per rank)."""
    return isinstance(value, str) or (math.isfinite(value) and value > 0)


@dataclasses.dataclass
class ShardingConfig:
    planner: Literal["hybrid", "manual", "stock"] = "hybrid"
    # the network the hybrid and stock planners price bytes on: "measure" (every rank times the
    # process group's collectives before planning, about a second), "topology" (the topology's own
    # bandwidths: gloo_topology's 1 GiB/s on CPU, TorchRec's NVLink + NIC defaults on CUDA) or a
    # number, GiB/s per rank for every collective; the manual planner prices nothing
    network: Union[Literal["measure", "topology"], float] = dataclasses.field(
        default="measure", metadata=_check(_network_ok, "'measure', 'topology' or a number of GiB/s per rank > 0"))
    stats: StatsConfig = dataclasses.field(default_factory=StatsConfig)
    # hybrid planner: the same keys as configs/planner.yaml's hot_set / tables
    hot_set: Dict[str, Any] = dataclasses.field(default_factory=dict)
    tables: Dict[str, Any] = dataclasses.field(default_factory=dict)
    manual_hot_set: ManualHotSetConfig = dataclasses.field(default_factory=lambda: ManualHotSetConfig(coverage=0.8))
    refresh: RefreshConfig = dataclasses.field(default_factory=RefreshConfig)


@dataclasses.dataclass
class TrainConfig:
    steps: int = dataclasses.field(default=1000, metadata=_non_negative("an integer >= 0"))
    threads: int = dataclasses.field(default=1, metadata=_positive("an integer > 0"))
    log_every: int = dataclasses.field(default=100, metadata=_non_negative("an integer >= 0"))
    progress_bar: bool = True
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # torch.profiler chrome traces (one per rank) of `profile_steps` steps after the first
    # `profile_after`, written to `profile_dir` (null: no profiling)
    profile_dir: Optional[str] = None
    profile_after: int = dataclasses.field(default=5, metadata=_non_negative("an integer >= 0"))
    profile_steps: int = dataclasses.field(default=3, metadata=_positive("an integer > 0"))


@dataclasses.dataclass
class MetricsConfig:
    window: int = dataclasses.field(default=100, metadata=_positive("an integer > 0"))
    warmup_steps: int = dataclasses.field(default=10, metadata=_non_negative("an integer >= 0"))
    validation_every: int = dataclasses.field(default=0, metadata=_non_negative("an integer >= 0"))
    validation_batches: int = dataclasses.field(default=0, metadata=_non_negative("an integer >= 0"))
    jsonl: Optional[str] = None


@dataclasses.dataclass
class CheckpointConfig:
    dir: Optional[str] = None
    every: int = dataclasses.field(default=0, metadata=_non_negative("an integer >= 0"))
    keep_last: int = dataclasses.field(default=0, metadata=_non_negative("an integer >= 0"))
    # true: continue from the newest checkpoint in dir (an error if there is none);
    # "auto": continue if there is one, else start fresh (elastic restarts)
    resume: Union[bool, Literal["auto"]] = False
    load_optimizer: bool = True
    on_signal: bool = True
    stats: bool = False  # also store the refresh statistics (sharding.refresh) in each checkpoint


@dataclasses.dataclass
class Config:
    seed: int = 0
    dist: DistConfig = dataclasses.field(default_factory=DistConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    sharding: ShardingConfig = dataclasses.field(default_factory=ShardingConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------- validation

def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is Union:
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin in (list, List):
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin in (dict, Dict):
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(tp, str(tp))


def _convert(value: Any, tp: Any, where: str) -> Any:
    """``value`` as type ``tp``, or ConfigError naming ``where`` and what is allowed."""
    origin = typing.get_origin(tp)
    fail = ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if origin is Union:
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise fail
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(value, arg, where)
            except ConfigError:
                continue
        raise fail
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise fail
    if origin in (list, List):
        if not isinstance(value, list):
            raise fail
        (item,) = typing.get_args(tp)
        return [_convert(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin in (dict, Dict):
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise fail
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise fail
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise fail
        return float(value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise fail
    if tp is Any:
        return value
    raise TypeError(f"{where}: unsupported schema type {tp!r}")


def _build(cls: Any, raw: Any, where: str = "") -> Any:
    label = where or "config"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{label}: expected a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        key = f"{where}.{unknown[0]}" if where else str(unknown[0])
        raise ConfigError(f"unknown config key {key!r}; allowed keys{' in ' + where if where else ''}: "
                          f"{sorted(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in raw.items():
        key = f"{where}.{name}" if where else name
        converted = _convert(value, hints[name], key)
        check = fields[name].metadata.get("check")
        if check is not None and converted is not None and not check(converted):
            raise ConfigError(f"{key}: expected {fields[name].metadata['allowed']}, got {value!r}")
        kwargs[name] = converted
    return cls(**kwargs)


def _validate(cfg: Config) -> None:
    """Checks that span keys, and the planner sections (same parser as configs/planner.yaml)."""
    m = cfg.model
    if m.dense_arch and m.dense_arch[-1] != m.embedding_dim:
        raise ConfigError(f"model.dense_arch: the last size must equal model.embedding_dim "
                          f"({m.embedding_dim}), got {m.dense_arch}")
    if not m.over_arch or m.over_arch[-1] != 1:
        raise ConfigError(f"model.over_arch: the last size must be 1 (one logit), got {m.over_arch}")
    if any(v <= 0 for v in m.dense_arch + m.over_arch):
        raise ConfigError(f"model.dense_arch/over_arch: sizes must be > 0, got {m.dense_arch} / {m.over_arch}")
    rule = {k: v for k, v in dataclasses.asdict(cfg.sharding.manual_hot_set).items() if v is not None}
    if len(rule) != 1:
        raise ConfigError(f"sharding.manual_hot_set: give exactly one of ['coverage', 'memory_budget_bytes', "
                          f"'rows_per_table'], got {rule}")
    parse_hot_set(cfg.sharding.hot_set, "sharding.hot_set")  # PlannerConfigError (a ValueError) names the key
    parse_table_constraints(cfg.sharding.tables, "sharding.tables")
    d = cfg.data
    if d.drift and d.drift_rows:
        raise ConfigError(f"data.drift / data.drift_rows: give one of them, got {d.drift} and {d.drift_rows}")
    if (d.drift or d.drift_rows) and d.source != "synthetic":
        raise ConfigError(f"data.drift / data.drift_rows: only for data.source 'synthetic', got {d.source!r}")
    if cfg.dist.step_timeout_s and cfg.dist.step_timeout_s >= cfg.dist.timeout_s:
        raise ConfigError(f"dist.step_timeout_s: must be shorter than dist.timeout_s ({cfg.dist.timeout_s}) "
                          f"or 0 (off), got {cfg.dist.step_timeout_s}")
    if cfg.checkpoint.resume and not cfg.checkpoint.dir:
        raise ConfigError(f"checkpoint.resume: {cfg.checkpoint.resume!r} needs checkpoint.dir (--checkpoint-dir)")
    if cfg.data.source == "criteo_tsv" and not cfg.data.paths:
        raise ConfigError("data.paths: data.source 'criteo_tsv' needs at least one file")
    if cfg.data.source == "criteo_npy" and not cfg.data.dir:
        raise ConfigError("data.dir: data.source 'criteo_npy' needs a directory")
    _validate_more(cfg)


SPARSE_FEATURES = 26  # Criteo's categorical features: one table each


def _validate_more(cfg: Config) -> None:
    """Values the types allow but the run cannot honour, and settings that would be ignored."""
    if not 0 <= cfg.seed < 2 ** 63:
        raise ConfigError(f"seed: expected an integer in [0, 2**63), got {cfg.seed!r}")
    d = cfg.data
    for key, sizes in (("multi_hot", d.multi_hot), ("cardinalities", d.cardinalities)):
        if isinstance(sizes, list) and (len(sizes) != SPARSE_FEATURES or min(sizes) < 1):
            raise ConfigError(f"data.{key}: expected {SPARSE_FEATURES} integers >= 1 (one per Criteo feature), got "
                              f"{sizes!r}")
    if d.source != "synthetic":
        default = DataConfig()
        # (data.label, the synthetic labels' model, is left alone: the shipped configs set it for their default
        # synthetic source, and a run on real data reads the files' labels whatever it says)
        ignored = [f"data.{k}" for k in ("multi_hot", "alpha") if getattr(d, k) != getattr(default, k)]
        if ignored:
            raise ConfigError(f"{', '.join(ignored)}: only for data.source 'synthetic' (real data brings its own "
                              f"ids), got data.source {d.source!r}")
    for source, keys in (("criteo_tsv", ("paths", "validation_paths")), ("criteo_npy", ("dir", "validation_dir"))):
        unused = [f"data.{k}" for k in keys if getattr(d, k) and d.source != source]
        if unused:
            raise ConfigError(f"{', '.join(unused)}: only read by data.source '{source}', got data.source "
                              f"{d.source!r}")
    cats = [f"cat_{i}" for i in range(SPARSE_FEATURES)]
    unknown = [f for f in d.label.effect_features if f not in cats]
    if unknown:
        raise ConfigError(f"data.label.effect_features: unknown sparse features {unknown}; they are cat_0 .. "
                          f"cat_{SPARSE_FEATURES - 1}")
    if cfg.model.embedding_dim % 4:
        raise ConfigError(f"model.embedding_dim: FBGEMM's embedding kernels need a multiple of 4, got "
                          f"{cfg.model.embedding_dim}")
    for section, o, default_eps in (("embedding", cfg.optim.embedding, EmbeddingOptimConfig().eps),
                                    ("dense", cfg.optim.dense, DenseOptimConfig().eps)):
        if o.optimizer == "sgd" and o.eps != default_eps:
            raise ConfigError(f"optim.{section}.eps: SGD has no eps, got {o.eps!r} (with optim.{section}.optimizer "
                              "'sgd')")
    tables = [f"t_cat_{i}" for i in range(SPARSE_FEATURES)]  # data.build_data's table names
    unknown = sorted(set(cfg.sharding.tables) - set(tables))
    if unknown:  # for every planner: TorchRec's would constrain nothing and say nothing
        raise ConfigError(f"sharding.tables: no table named {unknown}; the tables are t_cat_0 .. "
                          f"t_cat_{SPARSE_FEATURES - 1}")
    sc = cfg.sharding.stats
    if cfg.sharding.planner == "stock" and (sc.file or sc.save):
        keys = [f"sharding.stats.{k}" for k in ("file", "save") if getattr(sc, k)]
        raise ConfigError(f"{', '.join(keys)}: sharding.planner 'stock' uses no statistics (TorchRec's planner "
                          "prices without them); drop the key(s) for this run")
    m = cfg.metrics
    if m.validation_every and not m.validation_batches:
        raise ConfigError(f"metrics.validation_every: {m.validation_every} needs metrics.validation_batches > 0 "
                          "(the batches each validation pass scores), got 0")
    c = cfg.checkpoint
    if not c.dir and (c.every or c.stats):
        keys = [k for k in ("every", "stats") if getattr(c, k)]
        raise ConfigError(f"checkpoint.{'/'.join(keys)}: set without checkpoint.dir (--checkpoint-dir), so nothing "
                          "would be saved")


def config_from_dict(raw: Dict[str, Any]) -> Config:
    """The validated :class:`Config` of a nested mapping (raises :class:`ConfigError`)."""
    cfg = _build(Config, raw)
    _validate(cfg)
    return cfg


def set_key(cfg: Dict[str, Any], dotted: str, value: Any) -> None:
    """``cfg[a][b] = value`` for ``dotted == "a.b"``; the key must be in the schema."""
    node, cls = cfg, Config
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)} if cls is not None else None
        where = ".".join(parts[: i + 1])
        if fields is not None and part not in fields:
            raise ConfigError(f"unknown config key {where!r} in override {dotted!r}; allowed: {sorted(fields)}")
        if i == len(parts) - 1:
            node[part] = value
            return
        tp = typing.get_type_hints(cls)[part] if cls is not None else None
        cls = tp if tp is not None and dataclasses.is_dataclass(tp) else None
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {where} is not a mapping")
        node = child


def parse_override(text: str) -> tuple:
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not key=value")
    key, raw = text.split("=", 1)
    return key.strip(), yaml.safe_load(raw) if raw.strip() else None


def load_config(path: str, overrides: Sequence[str] = (), values: Optional[Dict[str, Any]] = None) -> Config:
    """The YAML file, then ``key=value`` overrides (parsed as YAML), then typed ``values``."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top, got {type(raw).__name__}")
    try:
        for text in overrides:
            set_key(raw, *parse_override(text))
        for key, value in (values or {}).items():
            set_key(raw, key, value)
        return config_from_dict(raw)
    except ValueError as e:  # ConfigError, or the planner's for sharding.hot_set: name the file (and overrides)
        given = f" with --set {list(overrides)}" if overrides else ""
        raise ConfigError(f"{path}{given}: {e}") from None


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train DLRM with frequency-hybrid embedding sharding.")
    p.add_argument("--config", default="configs/dlrm.yaml", help="YAML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.steps=50 (repeatable)")
    p.add_argument("--steps", type=int, help="= --set train.steps=N")
    p.add_argument("--batch-size", type=int, help="= --set data.batch_size=N (per rank)")
    p.add_argument("--planner", choices=["hybrid", "stock", "manual"], help="= --set sharding.planner=...")
    p.add_argument("--checkpoint-dir", help="= --set checkpoint.dir=PATH")
    p.add_argument("--resume", nargs="?", const="true", choices=["true", "auto"],
                   help="= --set checkpoint.resume=true (an error if checkpoint.dir holds no checkpoint); "
                        "--resume=auto: resume if there is one, else start fresh")
    p.add_argument("--seed", type=int, help="= --set seed=N")
    return p


def config_from_args(argv: Optional[List[str]] = None) -> Config:
    args = build_arg_parser().parse_args(argv)
    values = {key: getattr(args, flag) for flag, key in SHORTCUTS.items() if getattr(args, flag) is not None}
    if args.resume:
        values["checkpoint.resume"] = True if args.resume == "true" else "auto"
    return load_config(args.config, args.overrides, values)
