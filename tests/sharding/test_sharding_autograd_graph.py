"""The hybrid forward must build a lean autograd graph (a performance contract).

The output dist adds the received cold partials into the hot sums in place. If the hot
sums were a view, autograd would wrap that in-place op in ``CopySlices``, which clones and
zero-fills the whole ``[B, sum(dims)]`` gradient every step (measured: ~15% of a headline
step). Equivalence tests cannot see this: the numbers stay right, only slower.
"""

from tests.models import build, hot_ids, skewed_batch, tables
from tests.multiprocess import run_ranks
from torchrec_hybrid import HybridEmbeddingBagCollectionSharder


def _graph_node_names(root) -> set:
    seen, todo, names = set(), [root], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(n for n, _ in node.next_functions)
    return names


def graph_of_hybrid_output(rank, world):
    configs = tables()
    hot = hot_ids()
    model = build(configs, world, {c.name: "hybrid" for c in configs}, HybridEmbeddingBagCollectionSharder(hot))
    keys = [f for c in configs for f in c.feature_names]
    out = model(skewed_batch(configs, keys, batch=6, seed=rank, hot=hot)).wait()
    return sorted(_graph_node_names(out.values().grad_fn))


def test_no_copy_slices_in_hybrid_graph():
    from torchrec_hybrid.sharding import fused

    # the graph walk reaches the output dist's pooling and adds (fused, or the composed in-place add)
    pooling = "_HotPoolAddBackward" if fused.available() else "AddPartialsBackward"
    for names in run_ranks(graph_of_hybrid_output, 2):
        assert pooling in names, names
        assert "CopySlices" not in names, names


def live_tensors_over_steps(rank, world, steps=(5, 25)):
    """Tensors still alive (after a full gc) once each step's graph is gone, at two points."""
    import gc

    import torch

    configs = tables()
    hot = hot_ids()
    model = build(configs, world, {c.name: "hybrid" for c in configs}, HybridEmbeddingBagCollectionSharder(hot))
    keys = [f for c in configs for f in c.feature_names]
    counts = []
    for step in range(max(steps) + 1):
        out = model(skewed_batch(configs, keys, batch=6, seed=step * 10 + rank, hot=hot)).wait()
        out.values().sum().backward()
        del out
        if step in steps:
            gc.collect()
            counts.append(sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor)))
    return counts


def test_no_tensor_outlives_its_step():
    """Nothing a step creates may stay reachable from its own graph (a reference cycle through
    an autograd context leaks a step's receive buffers: ~9 MB per step on the product run)."""
    for early, late in run_ranks(live_tensors_over_steps, 2):
        assert late <= early, (early, late)
