"""validate.py's single-process parts on a scaled-down Criteo-like workload."""

from torchrec_hybrid.planner import cost_model as cm
from torchrec_hybrid.planner import validate as v


def test_h_check_and_estimate_on_small_workload():
    configs = v._tables(max_rows=2000, dim=16)
    stats = v.collect_stats(configs, v._samplers(configs, 1.1), batch=128, batches=8)
    planner, plan = v.make_plan(configs, stats, world=4, batch=128, bandwidth_gbps=1.0)
    rows = v.h_check(planner, configs, stats, alpha=1.1, world=4, batch=128)
    assert rows and all(r["h_chosen"] == r["h_brute_force"] for r in rows)
    est = v.estimated_bytes(planner, 4)
    assert est["_module_overhead"] > 0 and len(est) == len(configs) + 1
    types = {so.sharding_type for so in planner.planned_options()}
    assert cm.FREQUENCY_HYBRID in types
