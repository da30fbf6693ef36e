"""The figures of README.md, docs/results.md and benchmarks/README.md are the committed results files'.

benchmarks/docs_figures.py renders the docs' tables from benchmarks/results/*.json and fills the
sentences that quote a figure; these tests fail when a doc drifts from a results file (fix: rerun
``python -m benchmarks.docs_figures --write`` for the tables, reword the named sentence by hand).
Pure file parsing: nothing is trained or measured here.
"""

import copy
import re

import pytest

from benchmarks import docs_figures as df


def _text(doc):
    with open(df.DOCS[doc]) as f:
        return f.read()


@pytest.mark.parametrize("table", sorted(df.TABLES))
def test_doc_table_is_the_results_file(table):
    doc, render = df.TABLES[table]
    got = df.marked(_text(doc), table).strip()
    assert got == render(), f"{doc}: table {table} drifted: run python -m benchmarks.docs_figures --write"


def test_prose_figures_are_the_results_files():
    facts = df.facts()
    missing = [(doc, df.fold(t.format(**facts))) for doc, t in df.SNIPPETS
               if df.fold(t.format(**facts)) not in df.fold(_text(doc))]
    assert not missing, "sentences whose figures drifted from benchmarks/results (reword them):\n" + "\n".join(
        f"{doc}: {s}" for doc, s in missing)


@pytest.mark.parametrize("doc", sorted(df.DOCS))
def test_every_figure_is_bound_to_a_results_file(doc):
    # every ratio, MB / kB / ms / s / minute figure and percentage stands in a rendered table or a checked sentence
    assert df.unbound_figures(doc, _text(doc), df.facts()) == []


def test_no_stale_figures():
    """Figures the docs used to quote that no committed results file holds (or holds differently)."""
    text = {doc: df.fold(_text(doc)) for doc in df.DOCS}
    stale = {
        "README.md": ["five runs", "0.98-1.03x", "0.95-0.99x", "about 2 minutes", "+-0.2", "about 4x",
                      "9-11 host syncs against", "~0.37x", "which already saves a third"],
        "docs/results.md": ["by up to 5x", "~0.4", "on every workload at every W", "within 0.07",
                            "within 1% for every plan", "15-45 ms", "four times", "about twice",
                            "table-wise cold for most multi-hot", "all workloads alike"],
        "benchmarks/README.md": ["~3 min here)", "--steps 20", "244 ms", "840k", "0.99 MB/step", "1.45x", "400 steps",
                                 "~11 MB", "up to ~10%", "11% slower", "W=128-256", "~0.36-0.37x"],
    }
    for doc, figures in stale.items():
        for s in figures:
            assert s not in text[doc], f"{doc}: stale figure {s!r}"


def test_figure_pattern_finds_figures():
    found = [m.group(0) for m in df.FIGURE.finditer(
        "0.66x / 0.30x, 0.86-1.13x, 5x, 6.7 MB, 17 kB, 46 ms, 6%, 1.3%, (165 s; about 4 minutes, ~1 min here)")]
    assert found == ["0.66x", "0.30x", "0.86-1.13x", "5x", "6.7 MB", "17 kB", "46 ms", "6%", "1.3%", "165 s",
                     "4 minutes", "1 min"]
    assert df.FIGURE.findall("W=1024, dim 64, B=512, 2,000 hot rows, row_wise, 3x3 matrix, checks") == []


def test_check_names_a_drifted_figure(monkeypatch):
    """A changed results file makes the check fail, naming the table and the sentence that quote it."""
    assert df.check() == []
    real = df.load

    def load(name):
        d = real(name)
        if name == "product_w4":
            d = copy.deepcopy(d)
            r = next(r for r in d["results"] if r["workload"] == "onehot")
            r["ratios"]["hybrid_planner_bytes"]["busiest"] = 0.25
        return d

    monkeypatch.setattr(df, "load", load)
    problems = df.check()
    assert any("table readme_product drifted" in p for p in problems), problems
    assert any("table results_product_bytes drifted" in p for p in problems), problems
    assert any(re.search(r"frequency_hybrid for 26 tables: 0\.25x the bytes", p) for p in problems), problems


def test_stray_figure_is_caught():
    text = _text("README.md") + "\nA new claim: the hybrid is 0.42x faster.\n"
    assert df.unbound_figures("README.md", text, df.facts()) == ["0.42x"]
