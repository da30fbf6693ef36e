"""The GPU check's harness (benchmarks/device_check.py) on CPU: its torch stand-ins for
FBGEMM's sparse ops equal FBGEMM's kernels, and the real dists run on the path CUDA tensors take
- the composed ops (sharding/composed.py) through the stand-ins, the hot pooling's dense TBE
through its stand-in - give what the CPU reference gives (the fused ops where the extension is
built, FBGEMM's real CPU kernels where it calls FBGEMM), and so do the composed ops on FBGEMM's
CPU kernels, on 2 gloo ranks, the all-to-alls included. So a figure the script reports from a
GPU machine is about our code, not about the stand-ins."""

import contextlib
import os

import torch

from tests.multiprocess import run_ranks

FUSED_OPS = {"split_pack", "exchange_summary", "unpack_cold", "receive_plan"}


@contextlib.contextmanager
def composed_ops():
    """The hot path's composed ops (sharding/composed.py, what CUDA tensors take) on CPU tensors too:
    ``TORCHREC_HYBRID_FUSED_OPS=0`` for the duration (fused.py reads it when it next decides)."""
    from torchrec_hybrid.sharding import fused

    saved = os.environ.get("TORCHREC_HYBRID_FUSED_OPS")
    os.environ["TORCHREC_HYBRID_FUSED_OPS"] = "0"
    fused._state.clear()
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TORCHREC_HYBRID_FUSED_OPS"]
        else:
            os.environ["TORCHREC_HYBRID_FUSED_OPS"] = saved
        fused._state.clear()


def test_standins_equal_fbgemm_cpu_kernels():
    from benchmarks.device_check import STANDIN_OPS, check_standins

    for seed in range(3):
        assert check_standins(seed) == {op: True for op in STANDIN_OPS}


def _ops_called(fn):
    """``fn()``'s result and the FBGEMM and torchrec_hybrid ops it dispatched, by namespace (a stand-in
    registered under an op's name still dispatches as that op)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = {"fbgemm": set(), "torchrec_hybrid": set()}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            space, _, name = func.name().partition("::")
            if space in self.names:
                self.names[space].add(name.split(".")[0])
            return func(*args, **(kwargs or {}))

    with Ops() as mode:
        out = fn()
    return out, mode.names


def _through_both(rank, world, multi_hot):
    import torch.distributed as dist

    from benchmarks import device_check as dc
    from torchrec_hybrid.sharding import fused

    w = dc.Workload("tiny", batch=32, multi_hot=multi_hot, max_rows=3000, hot_rows=40)
    sizes, names, hot, local = dc._batches(w, world, 3, rank)
    words = torch.zeros(4, dtype=torch.int32)
    pg, cpu = dist.group.WORLD, torch.device("cpu")

    def steps(dists):
        return _ops_called(lambda: [dc.run_step(dists, kjt, words) for kjt in local])

    # the reference: the fused ops where built, FBGEMM's CPU kernels where it calls FBGEMM
    expected, ref_called = steps(dc.build_dists(w, pg, cpu, hot, sizes, names))
    # the composed ops on FBGEMM's CPU kernels (not the stand-ins yet), the hot pooling through its stand-in
    with composed_ops():
        composed, _ = steps(dc.build_dists(w, pg, cpu, hot, sizes, names, standin_tbe=True))
    # what a GPU runs: the composed ops through the stand-ins
    assert dc.register_standins("CPU", override=True) == list(dc.STANDIN_OPS)
    with composed_ops():
        got, called = steps(dc.build_dists(w, pg, cpu, hot, sizes, names, standin_tbe=True))

    def same(a, b):
        return [(torch.equal(p, q), torch.equal(g, h)) for (p, g), (q, h) in zip(a, b)]

    return dict(same=same(expected, got), composed_same=same(expected, composed), hot_keys=sum(h.numel() for h in hot),
                mass=float(expected[0][0].abs().sum()), called=called, ref_called=ref_called,
                fused=fused.available())


def test_dists_through_standins_equal_dists_through_fbgemm():
    from benchmarks.device_check import STANDIN_OPS

    for multi_hot in (False, True):
        for r in run_ranks(_through_both, 2, multi_hot=multi_hot):
            assert r["same"] == [(True, True)] * 3  # one batch per step asked for
            assert r["composed_same"] == [(True, True)] * 3
            assert r["hot_keys"] > 0 and r["mass"] > 0  # a real hot set, a non-trivial output
            # the device side took the composed path, and dispatched to FBGEMM exactly the ops with a stand-in:
            # a GPU box without FBGEMM's CUDA build runs them all, and every stand-in was run here
            assert not r["called"]["torchrec_hybrid"], r["called"]
            assert r["called"]["fbgemm"] == set(STANDIN_OPS), r["called"]
            # the reference took the fused ops where built: two implementations compared, not one twice
            assert FUSED_OPS <= r["ref_called"]["torchrec_hybrid"] or not r["fused"], r["ref_called"]
