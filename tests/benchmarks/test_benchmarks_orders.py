"""The timing order of the benchmarks balances positions and predecessors (Williams design)."""

from collections import Counter

import pytest

from benchmarks.measure import balanced_orders


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7])
def test_every_model_in_every_position_and_after_every_other_equally_often(n):
    rows = balanced_orders(n)
    assert all(sorted(r) == list(range(n)) for r in rows)
    positions = Counter((i, m) for r in rows for i, m in enumerate(r))
    assert len(positions) == n * n and len(set(positions.values())) == 1
    pairs = Counter((a, b) for r in rows for a, b in zip(r, r[1:]))
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1

