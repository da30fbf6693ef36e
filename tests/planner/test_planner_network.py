"""The planner measures the network: ``measure_network`` on real gloo groups, ``network=`` of the
planner (measured in ``collective_plan``, or a measurement passed in), ``comms: measure`` in the
YAML, and the measurement against a loopback shaped to a known rate (2 Gbit/s, tc tbf)."""

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torchrec
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.stats import NoopEmbeddingStats
from torchrec.distributed.planner.types import CollectiveType, Topology

from tests.multiprocess import run_ranks
from tests.planner.planner_testutils import exact_stats, plan_for, tables, zipf_probs
from torchrec_hybrid import HybridEmbeddingBagCollectionSharder, NetworkMeasurement, measure_network
from torchrec_hybrid.planner import (HybridEmbeddingShardingPlanner, MeasuredCommsBandwidth, PlannerConfigError,
                                     UniformCommsBandwidth, gloo_topology, load_planner_config)
from torchrec_hybrid.planner.network import MIN_SIZES, ONE_RANK_BANDWIDTH, fit_line

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
A2A, AR = CollectiveType.ALL_TO_ALL, CollectiveType.ALL_REDUCE
GIB = 1024 ** 3


def _workload():
    cfg = tables({"tiny": 20, "big": 100_000})
    return cfg, exact_stats(cfg, {"big": zipf_probs(100_000, 1.1)})


def _a2a_bw(topology: Topology) -> float:
    return topology.comms_bandwidths.get_bw(topology.local_world_size, topology.world_size, A2A)


def _collective_costs_match(candidate, bandwidth: float, collective_ms: float) -> bool:
    """Priced on bytes and collectives alone (compute_costs=None): cost = busiest bytes / bandwidth +
    collectives x collective_ms."""
    c = candidate.cost
    return (math.isclose(c["bytes_ms"], c["busiest_bytes"] / bandwidth, rel_tol=1e-9)
            and math.isclose(c["cost_ms"] - c["bytes_ms"], c["collectives"] * collective_ms, rel_tol=1e-6,
                             abs_tol=1e-9))


# -- measure_network on 4 gloo ranks, and collective_plan with network="measure" -------------------

def _measure_and_plan(rank, world):
    t0 = time.perf_counter()
    m = measure_network()
    wall = time.perf_counter() - t0
    singles = [dist.new_group([r]) for r in range(world)]  # every rank makes every group, in order
    alone = measure_network(singles[rank])
    cfg, st = _workload()
    topo = gloo_topology(world, bandwidth_gbps=123.0, local_world_size=2, ddr_cap=8 * GIB)
    planner = HybridEmbeddingShardingPlanner(topology=topo, batch_size=1024, frequency_stats=st, compute_costs=None,
                                             network="measure", stats=[NoopEmbeddingStats()])
    ebc = torchrec.EmbeddingBagCollection(tables=cfg, device=torch.device("meta"))
    plan = planner.collective_plan(ebc, [HybridEmbeddingBagCollectionSharder()])
    seen = [dict(name=c.name, a2a=_a2a_bw(c.stats_call["topology"]), local=c.stats_call["topology"].local_world_size,
                 ddr=c.stats_call["topology"].devices[0].storage.ddr,
                 costs=_collective_costs_match(c, planner.network.bandwidth, planner.network.collective_ms))
            for c in planner.candidates]  # rank 0 planned: the others have none
    types = {n: ps.sharding_type for n, ps in plan.plan[""].items()}
    return dict(m=m, wall=wall, alone=alone, network=planner.network, candidates=seen, types=types,
                given=_a2a_bw(topo))


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(_measure_and_plan, 4, timeout=240)


def test_the_measurement_is_the_same_on_every_rank_finite_and_quick(four_ranks):
    m = four_ranks[0]["m"]
    assert all(r["m"] == m for r in four_ranks)
    assert m.world_size == 4 and m.backend == "gloo"
    for v in (m.bandwidth, m.allreduce_bandwidth):
        assert math.isfinite(v) and 0 < v < ONE_RANK_BANDWIDTH
    assert math.isfinite(m.collective_ms) and m.collective_ms >= 0
    assert len(m.all_to_all_samples) >= MIN_SIZES and len(m.all_reduce_samples) >= MIN_SIZES
    assert all(t > 0 for _, t in m.all_to_all_samples + m.all_reduce_samples)
    # within the second it aims at on a network this fast (loopback), and so on every rank
    assert m.elapsed_s < 2.0 and max(r["wall"] for r in four_ranks) < 2.0
    assert "network (gloo, 4 ranks): all-to-all" in str(m) and "\n" not in str(m)


def test_a_one_rank_group_sends_nothing(four_ranks):
    for r in four_ranks:
        alone = r["alone"]
        assert alone.world_size == 1 and alone.bandwidth == alone.allreduce_bandwidth == ONE_RANK_BANDWIDTH
        assert alone.collective_ms == 0 and alone.all_to_all_samples == ()


def test_collective_plan_plans_for_the_network_it_measured(four_ranks):
    net = four_ranks[0]["network"]
    assert isinstance(net, NetworkMeasurement) and net.world_size == 4
    assert all(r["network"] == net for r in four_ranks)  # every rank keeps the same one
    assert all(r["types"] == four_ranks[0]["types"] for r in four_ranks)
    seen = four_ranks[0]["candidates"]
    names = {c["name"].split(":")[0] for c in seen}
    assert names == {"hybrid planner", "stock", "every eligible table frequency_hybrid"}
    for c in seen:  # each candidate's planner (TorchRec's too) planned for the measured bandwidth
        assert c["a2a"] == net.bandwidth != four_ranks[0]["given"], c
        assert c["local"] == 2 and c["ddr"] == 8 * GIB, c  # the rest of the user's topology kept
        assert c["costs"], c  # and the comparison priced bytes and collectives with the measurement


# -- a measurement passed in; refusals -----------------------------------------------------------

NET = NetworkMeasurement(world_size=4, bandwidth=5e5, allreduce_bandwidth=2e5, collective_ms=0.7, backend="gloo")


def test_a_measurement_passed_in_is_used_as_it_is():
    cfg, st = _workload()
    topo = gloo_topology(4, bandwidth_gbps=50.0, local_world_size=2, ddr_cap=8 * GIB)
    planner, _ = plan_for(cfg, st, topology=topo, compute_costs=None, network=NET)
    assert planner.network is NET and len(planner.candidates) == 3
    for c in planner.candidates:
        t = c.stats_call["topology"]
        assert _a2a_bw(t) == 5e5 and t.local_world_size == 2 and t.devices[0].storage.ddr == 8 * GIB
        assert _collective_costs_match(c, 5e5, 0.7), c.name
    assert _a2a_bw(topo) == 50.0 * GIB / 1000  # the user's topology itself is left as it was
    # a collective_ms given wins over the measured one
    planner, _ = plan_for(cfg, st, topology=topo, compute_costs=None, network=NET, collective_ms=0.25)
    assert all(_collective_costs_match(c, 5e5, 0.25) for c in planner.candidates)


def test_plan_without_a_group_cannot_measure():
    cfg, st = _workload()
    with pytest.raises(ValueError, match="network='measure'.*collective_plan.*NetworkMeasurement"):
        plan_for(cfg, st, compute_costs=None, network="measure")


@pytest.mark.parametrize("network, error, words", [
    ("measured", ValueError, "network must be None, 'measure' or a NetworkMeasurement, got 'measured'"),
    (2.5, TypeError, "network must be None, 'measure' or a NetworkMeasurement, got 2.5"),
])
def test_bad_network_arguments_are_named(network, error, words):
    with pytest.raises(error) as e:
        HybridEmbeddingShardingPlanner(topology=gloo_topology(4), network=network)
    assert words in str(e.value)


def test_a_measurement_of_another_world_size_is_refused():
    with pytest.raises(ValueError, match="measured on 4 ranks, the topology has world_size 2"):
        HybridEmbeddingShardingPlanner(topology=gloo_topology(2), network=NET)


def test_apply_to_gives_torchrecs_planner_the_same_network():
    topo = Topology(world_size=4, compute_device="cuda", local_world_size=2, hbm_cap=3 * GIB, pod_size=2)
    nccl = dataclasses.replace(NET, backend="nccl")
    got = nccl.apply_to(topo)
    assert got is not topo and isinstance(got.comms_bandwidths, MeasuredCommsBandwidth)
    assert got.comms_bandwidths.get_bw(2, 4, A2A) == 5e5 and got.comms_bandwidths.get_bw(2, 4, AR) == 2e5
    assert got.comms_bandwidths.get_bw(2, 4, CollectiveType.REDUCE_SCATTER) == 5e5
    assert (got.local_world_size, got.intra_group_size, got.devices[0].storage.hbm) == (2, 4, 3 * GIB)
    assert not isinstance(topo.comms_bandwidths, MeasuredCommsBandwidth)  # a copy: the original is kept
    EmbeddingShardingPlanner(topology=got, batch_size=64)  # what a benchmark gives TorchRec's own
    # gloo: every collective through the same sockets, one bandwidth (as gloo_topology)
    uniform = NET.topology(local_world_size=2).comms_bandwidths
    assert isinstance(uniform, UniformCommsBandwidth) and uniform.get_bw(2, 4, AR) == 5e5
    assert uniform == gloo_topology(4, NET.bandwidth_gbps).comms_bandwidths


@pytest.mark.parametrize("field, value", [("bandwidth", 0.0), ("bandwidth", math.inf), ("allreduce_bandwidth", -1.0),
                                          ("collective_ms", math.nan), ("world_size", 0)])
def test_a_measurement_refuses_values_no_planner_can_use(field, value):
    with pytest.raises(ValueError, match=f"{field} must be .*got {value!r}"):
        dataclasses.replace(NET, **{field: value})


def test_measure_network_names_bad_arguments():
    with pytest.raises(ValueError, match=r"sizes must be .*got \[4096, 1024\]"):
        measure_network(sizes=[4096, 1024])
    with pytest.raises(ValueError, match="repeats must be an int >= 1, got 0"):
        measure_network(repeats=0)
    with pytest.raises(ValueError, match="time_budget_s must be .*got -1"):
        measure_network(time_budget_s=-1)
    with pytest.raises(RuntimeError, match="initialised default process group"):
        measure_network()  # this process has none


def test_fit_line():
    line = [(x, 0.5e-3 + x / 2e8) for x in (1e3, 1e5, 1e6, 4e6)]  # 0.5 ms + 200 MB/s
    ms, bw = fit_line(line)
    assert math.isclose(ms, 0.5, rel_tol=1e-6) and math.isclose(bw, 2e5, rel_tol=1e-6)
    # a burst the network lets through for free: a negative intercept, clamped; the slope is kept
    ms, bw = fit_line([(x, x / 2e8 - 1e-3) for x in (1e6, 2e6, 4e6)])
    assert ms == 0 and math.isclose(bw, 2e5, rel_tol=1e-6)
    # times that do not grow with the bytes: the largest sample's rate
    assert fit_line([(1e3, 2e-3), (1e6, 1e-3)]) == (0.0, 1e6 / 1.0)


# -- the YAML ----------------------------------------------------------------------------------

def test_comms_measure_in_the_yaml(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("topology: {world_size: 4, local_world_size: 2, ddr_gb: 8, comms: measure}\nbatch_size: 64\n")
    kw = load_planner_config(str(p))
    assert kw["network"] == "measure" and kw["topology"].local_world_size == 2
    planner = HybridEmbeddingShardingPlanner(**kw)
    cfg, st = _workload()
    with pytest.raises(ValueError, match="collective_plan"):
        planner.plan(torchrec.EmbeddingBagCollection(tables=cfg, device=torch.device("meta")),
                     [HybridEmbeddingBagCollectionSharder()])
    p.write_text("topology: {world_size: 4}\n")
    assert "network" not in load_planner_config(str(p))  # the default: the topology's bandwidths


@pytest.mark.parametrize("text, words", [
    ("topology: {world_size: 4, comms: measured}\n",
     "topology.comms: expected 'uniform', 'torchrec' or 'measure', got 'measured'"),
    ("topology: {world_size: 4, comms: measure, bandwidth_gbps: 1}\n",
     "['bandwidth_gbps'] do not apply with comms: measure"),
    ("topology: {world_size: 4, comms: measure, inter_host_bw_gbps: 10}\n",
     "['inter_host_bw_gbps'] do not apply with comms: measure"),
])
def test_bad_measure_configs_name_the_key(tmp_path, text, words):
    p = tmp_path / "p.yaml"
    p.write_text(text)
    with pytest.raises(PlannerConfigError) as e:
        load_planner_config(str(p))
    assert words in str(e.value)


# -- against a known network: loopback shaped to 2 Gbit/s ----------------------------------------

RATE_BYTES_S = 250e6  # 2 Gbit/s, what every rank's bytes share
SHAPE = "ip link set lo up && tc qdisc add dev lo root tbf rate 2gbit burst 512kb latency 100ms"


def _measure_rank(rank, world):
    return measure_network()


def _shaped_main():
    """Inside the shaped namespace: 4 ranks measure; the measurement as one JSON line."""
    m = run_ranks(_measure_rank, 4, timeout=120)[0]
    print("MEASURED " + json.dumps(dataclasses.asdict(m)))


def test_the_measurement_finds_a_shaped_loopbacks_rate():
    """A user + network namespace whose loopback a token bucket holds to 2 Gbit/s in all (as
    ../shared/netem/shaped does; written out here, a clean clone has no ../shared): 4 ranks sending at
    once share it, so each gets a quarter, and the aggregate all-to-all rate must be within 20% of it."""
    if not (shutil.which("unshare") and shutil.which("tc") and shutil.which("ip")):
        pytest.skip("needs unshare (util-linux) and tc / ip (iproute2) to shape a loopback")
    probe = subprocess.run(["unshare", "-Urn", "bash", "-c", SHAPE], capture_output=True, text=True, timeout=30)
    if probe.returncode:
        pytest.skip(f"cannot make a network namespace with a shaped loopback here: {probe.stderr.strip()}")
    code = "from tests.planner.test_planner_network import _shaped_main; _shaped_main()"
    run = subprocess.run(["unshare", "-Urn", "bash", "-c", f'{SHAPE} && exec "$0" -c "$1"', sys.executable, code],
                         capture_output=True, text=True, timeout=240, cwd=ROOT,
                         env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("MEASURED ")]
    assert run.returncode == 0 and lines, run.stdout[-2000:] + run.stderr[-4000:]
    m = json.loads(lines[0][len("MEASURED "):])
    aggregate = m["bandwidth"] * 1e3 * m["world_size"]  # bytes/ms per rank -> bytes/s, all ranks
    print(f"shaped 2gbit: {m['bandwidth'] / 1e3:.1f} MB/s per rank, {aggregate / 1e6:.0f} MB/s aggregate, "
          f"{m['collective_ms']:.2f} ms per collective, measured in {m['elapsed_s']:.2f} s; all-to-all samples "
          f"(bytes, s) {m['all_to_all_samples']}")
    assert abs(aggregate - RATE_BYTES_S) <= 0.2 * RATE_BYTES_S, (aggregate, m["all_to_all_samples"])
