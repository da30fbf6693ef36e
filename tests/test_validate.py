"""validate.py's single-process parts on a scaled-down Criteo-like workload."""

import pytest

from torchrec_hybrid.planner import cost_model as cm
from torchrec_hybrid import validate as v


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


@pytest.mark.parametrize("argv, words", [
    (["--world", "0"], "argument --world: expected an integer >= 1, got 0"),
    (["--steps", "0"], "argument --steps: expected an integer >= 1, got 0"),
    (["--batch", "0"], "argument --batch: expected an integer >= 1, got 0"),
    (["--controls", "bogus_type"], "argument --controls: invalid choice: 'bogus_type'"),
    (["--controls", "planner"], "argument --controls: invalid choice: 'planner'"),
])
def test_the_cli_refuses_bad_arguments_before_any_work(argv, words, capsys):
    """Counts below 1 and controls that are no stock type are argparse errors naming the flag (--world 0
    raised IndexError in the enumerator, --steps 0 ZeroDivisionError in the ranks after the statistics,
    --batch 0 "validated" an empty workload, --controls bogus_type failed in TorchRec after the
    planner's plan had been measured)."""
    with pytest.raises(SystemExit) as e:
        v._parse(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err
