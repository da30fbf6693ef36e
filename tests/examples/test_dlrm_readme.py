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
    assert set(results["runs"]) >= {"hybrid", "stock"}


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
