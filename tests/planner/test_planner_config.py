"""load_planner_config: the shipped default loads; bad configs fail naming the key."""

import os

import pytest
from torchrec.distributed.planner.types import CollectiveType

from torchrec_hybrid.planner import (HybridEmbeddingShardingPlanner, PlannerConfigError, UniformCommsBandwidth,
                                     load_planner_config)
from tests.planner.planner_testutils import exact_stats, tables, zipf_probs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write(tmp_path, text, name="p.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_default_config_loads_and_builds_a_planner():
    kw = load_planner_config(os.path.join(ROOT, "configs", "planner.yaml"))
    topo = kw["topology"]
    assert topo.world_size == 4 and topo.compute_device == "cpu" and kw["batch_size"] == 1024
    assert isinstance(topo.comms_bandwidths, UniformCommsBandwidth)
    assert topo.comms_bandwidths.get_bw(4, 4, CollectiveType.ALL_REDUCE) == 1024 ** 3 / 1000
    assert kw["hot_budget_bytes"] == 256 * 1024 * 1024
    HybridEmbeddingShardingPlanner(**kw)


def test_full_config_with_statistics_and_tables(tmp_path):
    cfg = tables({"t": 1000})
    exact_stats(cfg, {"t": zipf_probs(1000, 1.1)}, samples=4096).save(tmp_path / "s.pt")
    path = write(tmp_path, """
topology: {world_size: 2, compute_device: cpu, comms: torchrec, inter_host_bw_gbps: 10, ddr_gb: 8}
batch_size: 64
statistics: s.pt
hot_set: {budget_mb: 1, max_rows: 100, min_saving: 0.1, tie_ms: 2.5}
tables:
  t: {sharding_types: [frequency_hybrid, table_wise], pooling_factors: [1.0]}
""")
    kw = load_planner_config(path)
    assert kw["frequency_stats"].lookups("t") == 4096
    assert kw["constraints"]["t"].sharding_types == ["frequency_hybrid", "table_wise"]
    assert kw["topology"].devices[0].storage.ddr == 8 * 1024 ** 3
    assert kw["max_hot_rows"] == 100 and kw["min_saving"] == 0.1 and kw["tie_ms"] == 2.5


@pytest.mark.parametrize("text, words", [
    ("batch_size: 4\n", "'topology' section is required"),
    ("topology: {compute_device: cpu}\n", "topology.world_size is required"),
    ("topology: {world_size: 0}\n", "topology.world_size"),
    ("topology: {world_size: 4, local_world_size: 3}\n", "must divide"),
    ("topology: {world_size: 4, compute_device: tpu}\n", "topology.compute_device"),
    ("topology: {world_size: 4, comms: fast}\n", "topology.comms"),
    ("topology: {world_size: 4, bandwith_gbps: 1}\n", "unknown key(s) ['bandwith_gbps']"),
    ("topology: {world_size: 4}\ntables: {t: {sharding_types: [hybrid]}}\n", "tables.t.sharding_types"),
    ("topology: {world_size: 4}\ntables: {t: {pooling_factors: [-1]}}\n", "tables.t.pooling_factors"),
    ("topology: {world_size: 4}\nhot_set: {min_saving: 1.5}\n", "hot_set.min_saving"),
    ("topology: {world_size: 4}\nhot_set: {tie_ms: -1}\n",
     "hot_set.tie_ms: expected a finite number of ms >= 0, 'fit_error' or 'auto', got -1"),
    ("topology: {world_size: 4}\nhot_set: {tie_ms: rms}\n", "hot_set.tie_ms: expected a finite number"),
    ("topology: {world_size: 4}\nstatistics: nowhere.pt\n", "does not exist"),
    ("topology: {world_size: 4, hbm_gb: 16}\n", "topology.hbm_gb: a cpu topology has no HBM"),
    ("topology: {world_size: 4, intra_host_bw_gbps: 600}\n", "['intra_host_bw_gbps'] do not apply with comms: uniform"),
    ("topology: {world_size: 4, comms: torchrec, bandwidth_gbps: 2}\n",
     "['bandwidth_gbps'] do not apply with comms: torchrec"),
    ("topology: {world_size: 4}\ntables: {t: {batch_sizes: 5}}\n", "tables.t.batch_sizes: expected a non-empty list"),
    ("topology: {world_size: 4}\ntables: {t: {compute_kernels: [bogus]}}\n",
     "tables.t.compute_kernels: unknown ['bogus']"),
    ("topology: [1, 2\n", "not valid YAML"),
    ("- 1\n", "expected a mapping"),
    # non-finite and sub-byte numbers, a comms that is no name: each named (they raised bare OverflowError,
    # ValueError or TypeError, or were taken: bandwidth NaN failed deep in TorchRec, ddr_gb 1e-12 became 0)
    ("topology: {world_size: .nan}\n", "topology.world_size: expected a positive finite number, got nan"),
    ("topology: {world_size: 4, ddr_gb: .inf}\n", "topology.ddr_gb: expected a positive finite number, got inf"),
    ("topology: {world_size: 4, bandwidth_gbps: .nan}\n", "topology.bandwidth_gbps: expected a positive finite"),
    ("topology: {world_size: 4, ddr_gb: 1.0e-12}\n", "topology.ddr_gb: 1e-12 is less than one byte"),
    ("topology: {world_size: 4, comms: [a]}\n",
     "topology.comms: expected 'uniform', 'torchrec' or 'measure', got ['a']"),
    ("topology: {world_size: 4}\nhot_set: {budget_mb: .inf}\n", "hot_set.budget_mb: expected a positive finite"),
    ("topology: {world_size: 4}\nhot_set: {max_rows: .inf}\n", "hot_set.max_rows: expected a positive finite"),
    ("topology: {world_size: 4}\ntables: {t: {pooling_factors: [.inf]}}\n", "tables.t.pooling_factors: expected"),
    ("topology: {world_size: 4, ddr_gb: 1.0e+300}\n", "topology.ddr_gb: 1e+300 is too large"),
    ("topology: {world_size: 4}\nhot_set: {max_rows: " + "9" * 400 + "}\n", "hot_set.max_rows: 999"),
])
def test_bad_configs_name_the_problem(tmp_path, text, words):
    with pytest.raises(PlannerConfigError) as e:
        load_planner_config(write(tmp_path, text))
    assert words in str(e.value)


def test_missing_file():
    with pytest.raises(PlannerConfigError, match="does not exist"):
        load_planner_config("/nonexistent/planner.yaml")


def test_shared_sections_name_their_prefix_and_take_nulls():
    # the DLRM example reads the same sections under sharding.*: errors carry that prefix
    from torchrec_hybrid.planner.config import HOT_SET_KEYS, parse_hot_set, parse_table_constraints

    assert parse_hot_set({"budget_mb": None, "max_rows": None, "min_saving": None}) == {}
    assert parse_hot_set({"budget_mb": 2, "max_rows": 10}, "sharding.hot_set") == {
        "hot_budget_bytes": 2 * 1024 * 1024, "max_hot_rows": 10}
    with pytest.raises(PlannerConfigError, match=r"sharding\.hot_set: unknown key\(s\) \['budget'\]"):
        parse_hot_set({"budget": 1}, "sharding.hot_set")
    with pytest.raises(PlannerConfigError, match=r"sharding\.hot_set\.max_rows"):
        parse_hot_set({"max_rows": 0}, "sharding.hot_set")
    assert parse_hot_set({"tie_ms": "fit_error"}) == {"tie_ms": "fit_error"}
    assert parse_hot_set({"tie_ms": "auto"}) == {"tie_ms": "auto"}
    assert set(HOT_SET_KEYS) == {"budget_mb", "max_rows", "min_saving", "compute_costs", "tie_ms"}
    c = parse_table_constraints({"t": {"sharding_types": ["table_wise"]}}, "sharding.tables")
    assert c["t"].sharding_types == ["table_wise"]
    with pytest.raises(PlannerConfigError, match=r"sharding\.tables\.t\.sharding_types"):
        parse_table_constraints({"t": {"sharding_types": ["hybrid"]}}, "sharding.tables")


def test_compute_costs_choices(tmp_path):
    import json as _json

    from torchrec_hybrid.planner.config import PlannerConfigError, parse_hot_set
    from torchrec_hybrid.planner.cost_model import ComputeCosts

    assert "compute_costs" not in parse_hot_set({"compute_costs": "default"})
    assert parse_hot_set({"compute_costs": "network"})["compute_costs"] is None
    fit = {f: 1.0 for f in ("lookup", "vector_stock", "vector_hybrid", "ids_stock", "ids_hybrid",
                            "group_stock_ms", "group_hybrid_ms", "ns_per_byte")}
    path = tmp_path / "cal.json"
    path.write_text(_json.dumps({"fit": {"costs": fit}}))
    got = parse_hot_set({"compute_costs": str(path)})["compute_costs"]
    assert isinstance(got, ComputeCosts) and got.lookup == 1.0 and got.source == str(path)
    with pytest.raises(PlannerConfigError, match="hot_set.compute_costs.*nowhere.json"):
        parse_hot_set({"compute_costs": str(tmp_path / "nowhere.json")})
    with pytest.raises(PlannerConfigError, match="hot_set.compute_costs"):
        parse_hot_set({"compute_costs": 3})


def test_a_relative_calibration_path_is_read_from_the_configs_folder(tmp_path, monkeypatch):
    """``hot_set.compute_costs: cal.json`` in a YAML is found beside the YAML, as ``statistics`` is,
    wherever the program runs from."""
    import json as _json

    fit = {f: 2.0 for f in ("lookup", "vector_stock", "vector_hybrid", "ids_stock", "ids_hybrid",
                            "group_stock_ms", "group_hybrid_ms", "ns_per_byte")}
    (tmp_path / "cal.json").write_text(_json.dumps({"fit": {"costs": fit}}))
    cfg = write(tmp_path, "topology: {world_size: 2, compute_device: cpu}\nhot_set: {compute_costs: cal.json}\n")
    monkeypatch.chdir("/")
    got = load_planner_config(cfg)["compute_costs"]
    assert got.lookup == 2.0 and got.source == str(tmp_path / "cal.json")
