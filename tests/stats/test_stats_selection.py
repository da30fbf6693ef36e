"""Hot-set selection rules on tiny tables, checked against the rules' definitions."""

import numpy as np
import pytest
import torch
from stats_testutils import one_feature_kjts, table

from torchrec_hybrid.stats import (
    FrequencyStats,
    HotSetRule,
    coverage_curve,
    default_bytes_per_row,
    resolve_hot_ids,
    select_hot_ids,
)


def stats_from_counts(counts_per_table, dims=None):
    """FrequencyStats whose table t has exactly counts_per_table[t] lookups per row."""
    dims = dims or {}
    tables = [table(n, len(c), [f"f_{n}"], dim=dims.get(n, 8)) for n, c in counts_per_table.items()]
    stats = FrequencyStats(tables)
    for n, c in counts_per_table.items():
        ids = torch.repeat_interleave(torch.arange(len(c)), torch.tensor(c))
        ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(0))]
        if ids.numel():
            stats.update(one_feature_kjts(ids, f"f_{n}", 1000)[0])
    return stats


def ranked(counts):
    """Row ids by the selection order: count descending, ties by smaller id; zeros dropped."""
    return sorted((i for i, c in enumerate(counts) if c > 0), key=lambda i: (-counts[i], i))


COUNTS = {"a": [5, 0, 3, 3, 9], "b": [1, 7, 0, 7, 2, 2, 0, 4]}


def check_format(hot, stats):
    assert set(hot) == set(stats.table_names)
    for ids in hot.values():
        assert ids.dtype == torch.int64
        assert ids.tolist() == sorted(set(ids.tolist()))


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 10])
def test_rows_per_table(rows):
    stats = stats_from_counts(COUNTS)
    hot = select_hot_ids(stats, rows_per_table=rows)
    check_format(hot, stats)
    for name, counts in COUNTS.items():
        assert hot[name].tolist() == sorted(ranked(counts)[:rows])


def test_rows_per_table_example_from_issue():
    stats = stats_from_counts({"t": [5, 0, 3, 3, 9]})
    assert select_hot_ids(stats, rows_per_table=2)["t"].tolist() == [0, 4]
    assert select_hot_ids(stats, rows_per_table=3)["t"].tolist() == [0, 2, 4]  # tie 2 vs 3 -> 2


def test_rows_per_table_dict_missing_tables_get_none():
    stats = stats_from_counts(COUNTS)
    hot = select_hot_ids(stats, rows_per_table={"b": 3})
    assert hot["a"].numel() == 0
    assert hot["b"].tolist() == sorted(ranked(COUNTS["b"])[:3])


@pytest.mark.parametrize("target", [0.0, 0.1, 0.45, 0.5, 0.8, 0.9, 1.0])
def test_coverage(target):
    stats = stats_from_counts(COUNTS)
    hot = select_hot_ids(stats, coverage=target)
    check_format(hot, stats)
    for name, counts in COUNTS.items():
        order, total = ranked(counts), sum(counts)
        # smallest k whose top-k covers >= target of the lookups
        k = next(k for k in range(len(order) + 1)
                 if sum(counts[i] for i in order[:k]) >= target * total)
        assert hot[name].tolist() == sorted(order[:k])


def greedy_reference(counts_per_table, bpr, budget):
    """Sequential greedy over rows by count/bytes (desc), table order, id; skip misfits."""
    items = [(-c[i] / bpr[n], t, i, n) for t, (n, c) in enumerate(counts_per_table.items())
             for i in range(len(c)) if c[i] > 0]
    chosen = {n: [] for n in counts_per_table}
    for _, _, i, n in sorted(items):
        if bpr[n] <= budget:
            budget -= bpr[n]
            chosen[n].append(i)
    return {n: sorted(v) for n, v in chosen.items()}


@pytest.mark.parametrize("budget", [0, 31, 32, 64, 100, 160, 200, 333, 10_000])
def test_memory_budget_matches_greedy_definition(budget):
    dims = {"a": 8, "b": 4}  # a row of a costs 32 B, of b 16 B
    stats = stats_from_counts(COUNTS, dims)
    hot = select_hot_ids(stats, memory_budget_bytes=budget)
    check_format(hot, stats)
    bpr = {n: dims[n] * 4 for n in COUNTS}
    expected = greedy_reference(COUNTS, bpr, budget)
    assert {n: v.tolist() for n, v in hot.items()} == expected
    assert sum(bpr[n] * v.numel() for n, v in hot.items()) <= budget


def test_memory_budget_hand_example():
    # Rows of a cost 32 B, of b 16 B. Lookups saved per byte: b1 = b3 = 7/16 (tie -> id),
    # a4 = 9/32, b7 = 4/16, a0 = 5/32, b4 = b5 = 2/16, ...
    # 80 B: b1 + b3 + a4 + b7 = 16 + 16 + 32 + 16 = 80.
    # 100 B: then a0 (32 B) does not fit in 20, b4 (16 B) does; nothing else fits in 4.
    stats = stats_from_counts(COUNTS, {"a": 8, "b": 4})
    hot = select_hot_ids(stats, memory_budget_bytes=80)
    assert hot["a"].tolist() == [4] and hot["b"].tolist() == [1, 3, 7]
    hot = select_hot_ids(stats, memory_budget_bytes=100)
    assert hot["a"].tolist() == [4] and hot["b"].tolist() == [1, 3, 4, 7]


def test_bytes_per_row_function_dict_and_optimizer():
    stats = stats_from_counts(COUNTS, {"a": 8, "b": 4})
    as_dict = select_hot_ids(stats, memory_budget_bytes=100, bytes_per_row={"a": 10, "b": 50})
    assert {n: v.tolist() for n, v in as_dict.items()} == greedy_reference(COUNTS, {"a": 10, "b": 50}, 100)
    as_fn = select_hot_ids(stats, memory_budget_bytes=100, bytes_per_row=lambda c: 10 if c.name == "a" else 50)
    assert all(torch.equal(as_fn[n], as_dict[n]) for n in COUNTS)
    cfg = stats.config("a")
    assert default_bytes_per_row(cfg) == 8 * 4
    assert default_bytes_per_row(cfg, "adagrad") == 2 * 8 * 4
    assert default_bytes_per_row(cfg, "rowwise_adagrad") == 8 * 4 + 4
    with_opt = select_hot_ids(stats, memory_budget_bytes=150, optimizer="adam")
    bpr = {n: default_bytes_per_row(stats.config(n), "adam") for n in COUNTS}
    assert {n: v.tolist() for n, v in with_opt.items()} == greedy_reference(COUNTS, bpr, 150)


def test_coverage_curve():
    stats = stats_from_counts(COUNTS)
    sizes = [0, 1, 2, 3, 4, 100]
    for name, counts in COUNTS.items():
        order, total = ranked(counts), sum(counts)
        expected = [sum(counts[i] for i in order[:s]) / total for s in sizes]
        np.testing.assert_allclose(coverage_curve(stats, name, sizes).numpy(), expected)


def test_zero_count_rows_never_selected():
    stats = stats_from_counts({"z": [0, 0, 4, 0]})
    for hot in (select_hot_ids(stats, rows_per_table=4), select_hot_ids(stats, coverage=1.0),
                select_hot_ids(stats, memory_budget_bytes=10**6)):
        assert hot["z"].tolist() == [2]


@pytest.mark.parametrize("kwargs", [
    dict(rows_per_table=2), dict(coverage=0.7), dict(memory_budget_bytes=100)])
def test_rule_and_resolve_match_select(kwargs):
    stats = stats_from_counts(COUNTS)
    rule = HotSetRule(**kwargs)
    for hot in (rule.select(stats), resolve_hot_ids(stats, rule)):
        expected = select_hot_ids(stats, **kwargs)
        assert all(torch.equal(hot[n], expected[n]) for n in COUNTS)


@pytest.mark.parametrize("kwargs", [
    dict(), dict(rows_per_table=1, coverage=0.5), dict(memory_budget_bytes=1, rows_per_table=1)])
def test_exactly_one_rule(kwargs):
    with pytest.raises(ValueError, match="exactly one"):
        HotSetRule(**kwargs)
    with pytest.raises(ValueError, match="exactly one"):
        select_hot_ids(stats_from_counts(COUNTS), **kwargs)


def test_selection_does_not_depend_on_data_order():
    """Same counts in a different order -> same hot ids (what every rank relies on)."""
    counts = {"t": [3, 3, 3, 1, 1, 2, 2, 0, 3]}
    results = []
    for seed in range(3):
        s = FrequencyStats([table("t", 9, ["f_t"])])
        ids = torch.repeat_interleave(torch.arange(9), torch.tensor(counts["t"]))
        ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed))]
        for kjt in one_feature_kjts(ids, "f_t", 3):
            s.update(kjt)
        results.append([select_hot_ids(s, rows_per_table=k)["t"].tolist() for k in range(9)])
    assert results[0] == results[1] == results[2]
    assert results[0][2] == [0, 1]  # four rows tie at 3: ids 0, 1 win


@pytest.mark.parametrize("kw, says", [
    (dict(rows_per_table={"A": 2}), r"rows_per_table names table\(s\) \['A'\]"),
    (dict(coverage={"A": 0.5}), r"coverage names table\(s\) \['A'\]"),
    (dict(rows_per_table=2.9), "rows_per_table for 'a' must be an int, got 2.9"),
])
def test_misspelt_tables_and_fractional_counts_are_refused(kw, says):
    """A per-table setting naming no table used to select nothing for the real one, silently; a
    fractional row count was cut short."""
    stats = stats_from_counts({"a": [5, 3, 1]})
    with pytest.raises(ValueError, match=says):
        select_hot_ids(stats, **kw)
    assert select_hot_ids(stats, rows_per_table=2.0)["a"].tolist() == [0, 1]
