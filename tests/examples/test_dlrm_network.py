"""The DLRM example plans for the measured network and says which plan it trains and why
(``sharding.network``, ``plan_summary``); ``configs/dlrm_mlperf.yaml`` loads and runs.

Runs are torchrun subprocesses on 2 gloo ranks (configs/dlrm_tiny.yaml, whose own setting is
``sharding.network: topology``), as in test_dlrm_example.py.
"""

import os
import re

import pytest

from examples.dlrm.config import ConfigError, ShardingConfig, load_config
from examples.dlrm.data import table_sizes_from_config
from examples.dlrm.model import _sig3
from tests.examples.test_dlrm_example import REPO, TINY, run_train
from torchrec_hybrid.planner.topology import DEFAULT_GLOO_BW_GBPS, gbps_to_bytes_per_ms
from torchrec_hybrid.stats.synthetic import DLRMV2_MULTI_HOT_SIZES

MLPERF = os.path.join(REPO, "configs", "dlrm_mlperf.yaml")
CANDIDATES = {"hybrid planner: stock + hybrid options", "stock: TorchRec's EmbeddingShardingPlanner",
              "every eligible table frequency_hybrid"}


def _plan_line(err: str) -> str:
    """The one ``plan: ...`` line that says which plan is trained (not the plan table's lines)."""
    lines = [ln.split(" INFO dlrm: plan: ", 1)[1] for ln in err.splitlines() if " INFO dlrm: plan: " in ln]
    summary = [ln for ln in lines if not re.match(r"(table |t_cat_\d+ |rank \d+: )", ln)]
    assert len(summary) == 1, summary
    return summary[0]


@pytest.mark.parametrize("value, words", [
    ("fast", ["sharding.network", "'measure'", "'topology'", "'fast'"]),
    ("0", ["sharding.network", "GiB/s", "got 0"]),
    ("-2", ["sharding.network", "GiB/s", "got -2"]),
    (".inf", ["sharding.network", "got inf"]),
    ("true", ["sharding.network", "got True"]),
    ("[1, 2]", ["sharding.network", "got [1, 2]"]),
])
def test_bad_network_is_rejected_naming_key_and_value(value, words):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [f"sharding.network={value}"])
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("value, expected", [("measure", "measure"), ("topology", "topology"), ("2.5", 2.5),
                                             ("3", 3.0)])
def test_network_values_accepted(value, expected):
    assert load_config(TINY, [f"sharding.network={value}"]).sharding.network == expected


def test_network_defaults_to_measure():
    assert ShardingConfig().network == "measure"  # a config that leaves the key out
    assert load_config(os.path.join(REPO, "configs", "dlrm.yaml")).sharding.network == "measure"


@pytest.fixture(scope="module")
def hybrid_measured():
    return run_train("--steps", "2", "--set", "sharding.network=measure", "--set", "train.log_level=info",
                     "--set", "metrics.validation_batches=0")


def test_hybrid_planner_plans_for_the_measured_network(hybrid_measured):
    out, err = hybrid_measured
    net = out["network"]
    assert net["setting"] == "measure" and net["used"] and net["backend"] == "gloo"
    assert net["bandwidth"] > 0 and net["allreduce_bandwidth"] > 0 and net["collective_ms"] >= 0
    # the bandwidth the hybrid planner's topology holds (read back from the planner) is the measured one,
    # not gloo_topology's guess the config would give without the measurement
    assert out["planned_bandwidth"] == net["bandwidth"]
    assert out["planned_bandwidth"] != gbps_to_bytes_per_ms(DEFAULT_GLOO_BW_GBPS)
    measured = [ln for ln in err.splitlines() if "sharding.network measure: network (gloo, 2 ranks)" in ln]
    assert len(measured) == 1 and " INFO " in measured[0], measured


def test_plan_line_names_the_plan_trained_and_why(hybrid_measured):
    out, err = hybrid_measured
    line = _plan_line(err)
    assert line == out["plan_summary"]
    cands = out["plan_candidates"]
    assert {c["name"] for c in cands} == CANDIDATES
    chosen = [c for c in cands if c["chosen"]]
    assert len(chosen) == 1 and chosen[0]["why_not"] is None
    assert all(c["why_not"] for c in cands if not c["chosen"])
    stock = next(c for c in cands if c["name"].startswith("stock"))
    # the line opens with the trained plan (the chosen candidate's types) and quotes TorchRec's plan's estimates
    if chosen[0] is stock:
        head = line.split("):", 1)[0]
        assert line.startswith("TorchRec's own (") and "do not pay here" in line
        assert f"est. {_sig3(stock['cost_ms'])} ms per step, {_sig3(stock['busiest_bytes'] / 1e6)} MB" in line
    else:
        head = line.split(", chosen over TorchRec's plan (", 1)[0]
        assert head != line and f"{out['hot_rows']:,} hot rows" in head and out["hot_rows"] > 0
        assert (f"vs {_sig3(stock['cost_ms'])} ms per step" in line
                and f"vs {_sig3(stock['busiest_bytes'] / 1e6)} MB on the busiest rank" in line)
    assert all(f"{n} {t}" in head for t, n in chosen[0]["types"].items()), (line, chosen[0])
    assert f"[network measured: {out['network']['bandwidth'] / 1e3:,.0f} MB/s per rank]" in line


@pytest.mark.parametrize("network", ["measure", "0.5"])
def test_stock_planner_plans_for_the_same_network(network):
    """``--planner stock``: TorchRec's planner holds the measured (or given) bandwidth too."""
    out, err = run_train("--steps", "1", "--planner", "stock", "--set", f"sharding.network={network}",
                         "--set", "train.log_level=info", "--set", "metrics.validation_batches=0")
    if network == "measure":
        assert out["network"]["setting"] == "measure" and out["planned_bandwidth"] == out["network"]["bandwidth"]
        assert out["planned_bandwidth"] != gbps_to_bytes_per_ms(DEFAULT_GLOO_BW_GBPS)
    else:
        assert out["network"] == {"setting": 0.5, "used": True}
        assert out["planned_bandwidth"] == pytest.approx(gbps_to_bytes_per_ms(0.5))
    line = _plan_line(err)
    assert line.startswith("TorchRec's own (") and "--planner stock" in line and out["plan_candidates"] == []


def test_manual_planner_ignores_the_network_and_says_so():
    out, err = run_train("--steps", "1", "--planner", "manual", "--set", "sharding.network=measure",
                         "--set", "train.log_level=info", "--set", "metrics.validation_batches=0")
    assert "not used by the manual planner" in err and "network (gloo" not in err  # nothing measured
    assert out["network"] == {"setting": "measure", "used": False} and out["planned_bandwidth"] is None
    line = _plan_line(err)
    assert line.startswith("26 frequency_hybrid with ") and "--planner manual" in line
    assert f"{out['hot_rows']:,} hot rows" in line


def test_mlperf_config_loads_with_mlperf_like_sizes():
    cfg = load_config(MLPERF)
    assert cfg.data.multi_hot is True and cfg.model.embedding_dim == 128 and cfg.model.dense_arch[-1] == 128
    assert cfg.data.cardinalities == "terabyte" and cfg.sharding.network == "measure"
    sizes = table_sizes_from_config(cfg.data)
    assert len(sizes) == 26 and max(sizes) == cfg.data.max_rows
    weights = sum(sizes) * cfg.model.embedding_dim * 4
    assert weights < 1.5 * 2 ** 30, weights  # all ranks' tables together: well under this box's memory
    assert sum(DLRMV2_MULTI_HOT_SIZES) == 214  # the bags the synthetic source draws (data.multi_hot: true)


def test_mlperf_config_runs_two_steps():
    out, err = run_train("--config", MLPERF, "--steps", "2",  # the last --config wins over run_train's tiny one
                         "--set", "train.progress_bar=false",
                         "--set", "metrics.validation_batches=1", "--set", "sharding.stats.batches=4", timeout=150)
    assert out["step"] == 2 and out["status"] == "completed" and out["loss"] is not None
    assert out["network"]["setting"] == "measure" and out["planned_bandwidth"] == out["network"]["bandwidth"]
    assert {c["name"] for c in out["plan_candidates"]} == CANDIDATES and _plan_line(err) == out["plan_summary"]
    per_rank = [float(m) for m in re.findall(r"plan: rank \d+: ([\d.]+) MiB embedding weights", err)]
    assert len(per_rank) == 2 and max(per_rank) < 1024, per_rank
