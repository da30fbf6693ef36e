"""The GPU check's harness (benchmarks/device_check.py) on CPU: its torch stand-ins for
FBGEMM's sparse ops equal FBGEMM's kernels, and the real dists run through them give what they
give through FBGEMM, on 2 gloo ranks (the all-to-alls included). So a figure the script
reports from a GPU machine is about our code, not about the stand-ins."""

import torch

from tests.multiprocess import run_ranks


def test_standins_equal_fbgemm_cpu_kernels():
    from benchmarks.device_check import STANDIN_OPS, check_standins

    for seed in range(3):
        assert check_standins(seed) == {op: True for op in STANDIN_OPS}


def _fbgemm_ops_called(fn):
    """``fn()``'s result and the FBGEMM ops it dispatched (a stand-in registered under an op's
    name still dispatches as that op)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.name()
            if name.startswith("fbgemm::"):
                self.names.add(name.split("::")[1].split(".")[0])
            return func(*args, **(kwargs or {}))

    with Ops() as mode:
        out = fn()
    return out, mode.names


def _through_both(rank, world, multi_hot):
    import torch.distributed as dist

    from benchmarks import device_check as dc

    w = dc.Workload("tiny", batch=32, multi_hot=multi_hot, max_rows=3000, hot_rows=40)
    sizes, names, hot, local = dc._batches(w, world, 3, rank)
    words = torch.zeros(4, dtype=torch.int32)
    fbgemm = dc.build_dists(w, dist.group.WORLD, torch.device("cpu"), hot, sizes, names)
    expected = [dc.run_step(fbgemm, kjt, words) for kjt in local]
    assert dc.register_standins("CPU", override=True) == list(dc.STANDIN_OPS)
    standins = dc.build_dists(w, dist.group.WORLD, torch.device("cpu"), hot, sizes, names)
    got, called = _fbgemm_ops_called(lambda: [dc.run_step(standins, kjt, words) for kjt in local])
    same = [(torch.equal(p, q), torch.equal(g, h)) for (p, g), (q, h) in zip(expected, got)]
    return same, sum(h.numel() for h in hot), float(expected[0][0].abs().sum()), called


def test_dists_through_standins_equal_dists_through_fbgemm():
    from benchmarks.device_check import STANDIN_OPS

    for multi_hot in (False, True):
        for same, hot_keys, mass, called in run_ranks(_through_both, 2, multi_hot=multi_hot):
            assert same == [(True, True)] * 3  # one batch per step asked for
            assert hot_keys > 0 and mass > 0  # a real hot set, a non-trivial output
            # every FBGEMM op our dists call has a stand-in: a GPU box without FBGEMM's CUDA build runs them all
            assert called and called <= set(STANDIN_OPS), sorted(called - set(STANDIN_OPS))
