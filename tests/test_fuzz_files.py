"""Issue 58 item 2: what is read from disk, fuzzed. Valid files (a statistics file, a calibration file,
the planner YAML, the DLRM example's configs) are mutated at random - a key dropped, renamed or added,
a value replaced by one of another type or out of range, the text truncated or a byte flipped - and
loaded. Each load either succeeds or raises a ``ValueError`` (the loaders' own error types derive from
it) whose message names the file; anything else (a ``TypeError`` / ``KeyError`` from deep inside, a
message without the file) is a failure. Seeded: ``FUZZ_SEED`` / ``FUZZ_CASES`` in the environment
for a longer run (``FUZZ_CASES=5000 pytest tests/test_fuzz_files.py``).
"""

import copy
import json
import os
import random
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torchrec
import yaml

from examples.dlrm.config import load_config
from torchrec_hybrid.planner.compute_costs import load_calibration
from torchrec_hybrid.planner.config import load_planner_config
from torchrec_hybrid.stats import FrequencyStats
from torchrec_hybrid.stats.persistence import state_checksum

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = int(os.environ.get("FUZZ_SEED", "58"))
CASES = int(os.environ.get("FUZZ_CASES", "150"))  # per file kind

ODD_VALUES: List[Any] = [None, -1, 0, 1, 2.5, -3.0, float("nan"), float("inf"), 10 ** 30, "x", "", True, [], {},
                         [1, "a"], {"k": 1}]


def _paths(obj: Any, prefix: Tuple = ()) -> List[Tuple]:
    """Every path to a value in a nest of dicts and lists."""
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,))
    return out


def _mutate(obj: Any, rng: random.Random) -> Any:
    """One to three random structural mutations of a JSON / YAML-like nest (a deep copy)."""
    obj = copy.deepcopy(obj)
    for _ in range(rng.randint(1, 3)):
        paths = _paths(obj)
        if not paths:
            return rng.choice(ODD_VALUES)
        path = rng.choice(paths)
        parent = obj
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        op = rng.choice(["drop", "replace", "replace", "add", "rename", "scale"])
        if op == "drop":
            del parent[key]
        elif op == "replace":
            parent[key] = copy.deepcopy(rng.choice(ODD_VALUES))
        elif op == "add" and isinstance(parent, dict):
            parent[f"unknown_{rng.randint(0, 99)}"] = rng.choice(ODD_VALUES)
        elif op == "rename" and isinstance(parent, dict):
            parent[f"{key}_x"] = parent.pop(key)
        elif op == "scale" and isinstance(parent[key], (int, float)) and not isinstance(parent[key], bool):
            parent[key] = parent[key] * rng.choice([-1, 0, 1e9, 0.5])
    return obj


def _text_mutations(text: str, rng: random.Random) -> str:
    if rng.random() < 0.5:
        return text[: rng.randint(0, len(text))]
    i = rng.randrange(len(text))
    return text[:i] + rng.choice(["\x00", ":", "{", "[", "- ", "\n", "é", "'"]) + text[i + 1:]


def _outcome(load: Callable[[str], Any], path: str) -> Tuple[str, str]:
    try:
        load(path)
    except ValueError as e:
        msg = str(e)
        return ("refused", msg) if os.path.basename(path) in msg else ("unnamed", msg)
    except Exception as e:  # noqa: BLE001 - what the fuzz looks for
        return ("crashed", f"{type(e).__name__}: {e}")
    return ("loaded", "")


def _run(kind: str, write: Callable[[Any, str], None], load: Callable[[str], Any], valid: Any, tmp_path,
         text_of: Callable[[Any], str]) -> Dict[str, int]:
    rng = random.Random(f"{SEED}-{kind}")
    counts: Dict[str, int] = {"loaded": 0, "refused": 0}
    bad: List[str] = []
    for i in range(CASES):
        path = str(tmp_path / f"{kind}_{i}{os.path.splitext(kind)[1] or ''}")
        if rng.random() < 0.8:
            write(_mutate(valid, rng), path)
        else:
            with open(path, "w") as f:
                f.write(_text_mutations(text_of(valid), rng))
        verdict, msg = _outcome(load, path)
        counts[verdict] = counts.get(verdict, 0) + 1
        if verdict not in ("loaded", "refused"):
            bad.append(f"case {i} {verdict}: {msg[:300]}")
    assert not bad, f"{kind} (seed {SEED}): {counts}\n" + "\n".join(bad[:15])
    assert counts["refused"] > 0  # the mutations do reach the checks
    return counts


def _write_yaml(obj: Any, path: str) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(obj, f)


def _write_json(obj: Any, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


@pytest.mark.parametrize("name", ["configs/planner.yaml"])
def test_fuzzed_planner_yaml_loads_or_names_the_file(name, tmp_path):
    with open(os.path.join(REPO, name)) as f:
        valid = yaml.safe_load(f)
    _run("planner.yaml", _write_yaml, load_planner_config, valid, tmp_path, yaml.safe_dump)


@pytest.mark.parametrize("name", ["configs/dlrm.yaml", "configs/dlrm_mlperf.yaml", "configs/dlrm_tiny.yaml"])
def test_fuzzed_dlrm_config_loads_or_names_the_file(name, tmp_path):
    with open(os.path.join(REPO, name)) as f:
        valid = yaml.safe_load(f)
    _run(os.path.basename(name), _write_yaml, load_config, valid, tmp_path, yaml.safe_dump)


def test_fuzzed_calibration_file_loads_or_names_the_file(tmp_path):
    with open(os.path.join(REPO, "benchmarks/results/calibration.json")) as f:
        valid = {"fit": json.load(f)["fit"]}
    _run("calibration.json", _write_json, load_calibration, valid, tmp_path, json.dumps)


def test_fuzzed_statistics_file_loads_or_names_the_file(tmp_path):
    tables = [torchrec.EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=50 + i,
                                          feature_names=[f"f{i}"]) for i in range(2)]
    stats = FrequencyStats(tables)
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]),
                                                       torch.tensor([1, 1, 2, 0, 1, 1, 2, 0]))
    stats.update(kjt)
    valid = stats.state_dict()

    def write(state: Any, path: str) -> None:  # with a checksum that matches: the schema checks must catch it
        torch.save(dict(state, checksum=state_checksum(state)) if isinstance(state, dict) else state, path)

    def load(path: str) -> Any:
        return FrequencyStats.load(path)

    _run("stats.pt", write, load, valid, tmp_path, lambda s: "not a torch file")
