"""The docs' tables are what their results files render, and every figure in the docs is in a results file.

benchmarks/docs_figures.py renders the marked tables of README.md, docs/*.md and benchmarks/README.md from
benchmarks/results/*.json and checks every figure of their prose against the results files their sections
name (fix a drifted table with ``python -m benchmarks.docs_figures --write``; reword a figure by hand).
Pure file parsing: nothing is trained or measured here.
"""

import copy
import json
import re

import pytest

from benchmarks import docs_figures as df


def test_the_docs_are_their_results_files():
    assert df.check() == []


def test_a_changed_results_file_drifts_the_readme_table(monkeypatch):
    """The real README against a product_w4.json whose one-hot byte ratio changed."""
    real = df.load

    def load(name):
        d = real(name)
        if name == "product_w4":
            d = copy.deepcopy(d)
            next(r for r in d["results"] if r["workload"] == "onehot")["ratios"]["hybrid_planner"]["busiest"] = 0.25
        return d

    monkeypatch.setattr(df, "load", load)
    problems = df.check()
    assert any("README.md: table readme_product drifted" in p for p in problems), problems


@pytest.fixture
def demo(tmp_path, monkeypatch):
    """A results file of our own, ``demo.json``, beside the real ones, and a table rendered from it."""
    path = tmp_path / "demo.json"
    path.write_text(json.dumps({
        "plans": {"hybrid": {"busiest_bytes": 3230000.0, "median_step_s": 0.0729, "share": 0.48},
                  "stock": {"busiest_bytes": 6460000.0, "median_step_s": 0.1000, "share": 0.25}},
        "network": {"bandwidth": 261250.0},  # bytes/ms per rank: 2.09 Gbit/s
        "per_step_s": [0.01 * i for i in range(200)],  # samples: no figure comes from them
    }))
    real = df.result_files()
    monkeypatch.setattr(df, "result_files", lambda: dict(real, demo=str(path)))
    monkeypatch.setattr(df, "_NUMBERS", {})
    monkeypatch.setitem(df.TABLES, "demo", (lambda: f"| x |\n|---|\n| {df.load('demo')['plans']['hybrid']['share']} |",
                                            ("demo",)))
    return path


def _doc(body):
    return {"docs/demo.md": "# Demo\n\n## A section\n\nFrom `demo.json`.\n\n" + body + "\n"}


def test_a_drifted_table_fails(demo):
    marked = df.START.format("demo") + "\n\n{}\n\n" + df.END
    assert df.check(_doc(marked.format("| x |\n|---|\n| 0.48 |"))) == []
    problems = df.check(_doc(marked.format("| x |\n|---|\n| 0.47 |")))
    assert len(problems) == 1 and "table demo drifted" in problems[0], problems
    assert "no such table" in df.check(_doc(df.START.format("nonesuch") + "\n" + df.END))[0]


def test_a_made_up_figure_fails(demo):
    real = ("The hybrid sends 0.50x the bytes (3.23 MB against 6.46 MB), steps in 72.9 ms, 0.73x [0.73, 0.73] "
            "of the stock step (0.48-0.50x), its collectives 48% of a step, at 2.09 Gbit/s.")
    assert df.check(_doc(real)) == []
    for made_up in ("0.42x", "3.24 MB", "72.8 ms", "47%", "2.10 Gbit/s", "0.73x [0.70, 0.73]", "0.50-0.61x",
                    "1.00 s"):  # 1.00 s: only a per-step sample holds it
        problems = df.check(_doc(f"{real} Also {made_up}."))
        assert len(problems) == 1 and made_up in problems[0] and "not in demo" in problems[0], (made_up, problems)


def test_a_figure_needs_a_results_file_its_section_names(demo):
    problems = df.check({"docs/demo.md": "# Demo\n\n## Unsourced\n\nIt steps in 72.9 ms.\n\n"
                                         "## Sourced\n\n`demo.json`: 72.9 ms.\n\n### Below it\n\nStill 72.9 ms.\n"})
    assert len(problems) == 1 and problems[0].count("72.9 ms") == 1 and "names no results file" in problems[0]


def test_what_is_not_prose_is_not_checked(demo):
    text = ("```bash\npython -m x --budget 0.42x   # 9.99 ms\n```\n\n`--rate 7.77 MB` and a comment "
            "<!-- 6.66 ms --> and [a link](x/0.42x.md). W=1024, dim 64, B=512, t_cat_20, x4, fp16, 2,000 hot rows.")
    assert df.check(_doc(text)) == []


def test_allowed_figures_need_their_context(demo):
    assert df.check(_doc("The op budget: at most 1.5x table_wise's ops.")) == []
    problems = df.check(_doc("The hybrid is 1.5x faster."))
    assert len(problems) == 1 and "1.5x" in problems[0]
    for fig, context, why in df.ALLOWED:
        assert why and re.compile(context)


def test_figure_pattern():
    found = [m.group(0) for m in df.FIGURE.finditer(
        "0.66x / 0.30x, 0.86-1.13x, 0.54x [0.53, 0.55], 5x, 6.7 MB, 17 kB, 46 ms, 6%, 1.3%, 1,024 MB, "
        "2.09 Gbit/s, 510 MB/s, 55 s; about 4 minutes")]
    assert found == ["0.66x", "0.30x", "0.86-1.13x", "0.54x [0.53, 0.55]", "5x", "6.7 MB", "17 kB", "46 ms", "6%",
                     "1.3%", "1,024 MB", "2.09 Gbit/s", "510 MB/s", "55 s", "4 minutes"]
    assert df.FIGURE.findall("W=1024, dim 64, B=512, 2,000 hot rows, t_cat_20, 3x3 matrix, x4, int32, fp16") == []
