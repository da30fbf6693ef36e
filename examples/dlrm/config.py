"""Config for the DLRM example: one YAML file plus command-line overrides.

The YAML file is a nested mapping (see configs/dlrm.yaml for every key). Overrides:

- ``--set a.b=value`` (repeatable); the value is parsed as YAML (``--set train.steps=50``,
  ``--set model.dense_arch=[64,16]``, ``--set checkpoint.dir=null``);
- shortcuts for the common ones: ``--steps``, ``--batch-size``, ``--planner``,
  ``--checkpoint-dir``, ``--resume``, ``--seed``.

An override of a key the file does not have is an error (it is almost always a typo).
"""

from __future__ import annotations

import argparse
import copy
from typing import Any, Dict, List, Optional, Sequence

import yaml

SHORTCUTS = {  # --flag -> config key
    "steps": "train.steps",
    "batch_size": "data.batch_size",
    "planner": "sharding.planner",
    "checkpoint_dir": "checkpoint.dir",
    "seed": "seed",
}


class Config(dict):
    """A nested dict whose keys also read as attributes (``cfg.train.steps``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as e:
            raise AttributeError(name) from e

    @staticmethod
    def wrap(value: Any) -> Any:
        if isinstance(value, dict):
            return Config({k: Config.wrap(v) for k, v in value.items()})
        if isinstance(value, list):
            return [Config.wrap(v) for v in value]
        return value


def set_key(cfg: Dict[str, Any], dotted: str, value: Any) -> None:
    """``cfg[a][b] = value`` for ``dotted == "a.b"``; the key must already exist."""
    node = cfg
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(f"unknown config key {'.'.join(parts[: i + 1])!r} in override {dotted!r}")
        if i == len(parts) - 1:
            node[part] = value
        else:
            node = node[part]


def parse_override(text: str) -> tuple:
    if "=" not in text:
        raise ValueError(f"override {text!r} is not key=value")
    key, raw = text.split("=", 1)
    return key.strip(), yaml.safe_load(raw) if raw.strip() else None


def load_config(path: str, overrides: Sequence[str] = (), values: Optional[Dict[str, Any]] = None) -> Config:
    """The YAML file, then ``key=value`` overrides (parsed as YAML), then typed ``values``."""
    with open(path) as f:
        cfg = copy.deepcopy(yaml.safe_load(f) or {})
    for text in overrides:
        set_key(cfg, *parse_override(text))
    for key, value in (values or {}).items():
        set_key(cfg, key, value)
    return Config.wrap(cfg)


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train DLRM with frequency-hybrid embedding sharding.")
    p.add_argument("--config", default="configs/dlrm.yaml", help="YAML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.steps=50 (repeatable)")
    p.add_argument("--steps", type=int, help="= --set train.steps=N")
    p.add_argument("--batch-size", type=int, help="= --set data.batch_size=N (per rank)")
    p.add_argument("--planner", choices=["hybrid", "stock", "manual"], help="= --set sharding.planner=...")
    p.add_argument("--checkpoint-dir", help="= --set checkpoint.dir=PATH")
    p.add_argument("--resume", action="store_true", help="= --set checkpoint.resume=true")
    p.add_argument("--seed", type=int, help="= --set seed=N")
    return p


def config_from_args(argv: Optional[List[str]] = None) -> Config:
    args = build_arg_parser().parse_args(argv)
    values = {key: getattr(args, flag) for flag, key in SHORTCUTS.items() if getattr(args, flag) is not None}
    if args.resume:
        values["checkpoint.resume"] = True
    return load_config(args.config, args.overrides, values)
