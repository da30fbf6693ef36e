"""The DLRM README's figures are the results file's (examples/dlrm/results.py regenerates both)."""

import json
import os
import re

from examples.dlrm.results import DEFAULT_OUT, END, README, START, readme_table


def test_readme_table_is_the_results_file():
    with open(DEFAULT_OUT) as f:
        results = json.load(f)
    with open(README) as f:
        text = f.read()
    table = text.split(START, 1)[1].split(END, 1)[0].strip()
    assert table == readme_table(results), "README table drifted: run python -m examples.dlrm.results --readme"
    assert set(results["runs"]) >= {"hybrid", "hybrid-network", "stock"}


def test_readme_has_no_stale_figures():
    with open(README) as f:
        text = f.read()
    for stale in ("108 to 132", "1,769", "694", "0.4102", "0.8476"):
        assert stale not in text, stale
    # every "N s" wall time quoted outside the table must be in the results file
    with open(DEFAULT_OUT) as f:
        walls = {f"{run['wall_s']:.0f}" for run in json.load(f)["runs"].values()}
    outside = text.replace(text.split(START, 1)[1].split(END, 1)[0], "")
    for m in re.finditer(r"(\d+) s wall", outside):
        assert m.group(1) in walls, m.group(0)
    assert os.path.exists(DEFAULT_OUT)


def test_results_rows_run_the_planner_they_name():
    from examples.dlrm.results import command

    def sets(cmd):
        return [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]

    hybrid = command("hybrid", "configs/dlrm.yaml", 2, ["train.steps=5"])
    network = command("hybrid-network", "configs/dlrm.yaml", 2, ["train.steps=5"])
    stock = command("stock", "configs/dlrm.yaml", 2, [])
    assert hybrid[hybrid.index("--planner") + 1] == network[network.index("--planner") + 1] == "hybrid"
    assert stock[stock.index("--planner") + 1] == "stock"
    assert "sharding.hot_set.compute_costs=network" not in sets(hybrid)
    # the row's own override first, so a user's --set of the same key still wins
    assert sets(network) == ["train.progress_bar=false", "sharding.hot_set.compute_costs=network", "train.steps=5"]
