"""Issue 58 item 1: the sharded module's inputs, fuzzed on 2-3 gloo ranks.

A hybrid module (two frequency_hybrid tables, one frequency_hybrid with table-wise cold rows, one
stock table_wise, default sharder options) and the same tables sharded table_wise by TorchRec's
sharder start from the same weights. Each case every rank draws its own batch
(:mod:`tests.fuzz_batches`: valid or damaged, batch sizes differing per rank, VBE) and the hybrid
module runs it. Two outcomes only are allowed:

- every rank's batch valid: it trains like table_wise - every output equal per key, then the same
  backward on both, weights compared every ``CHECK_EVERY`` cases and at the end;
- some rank's batch damaged: every rank raises the same :class:`InvalidInputError` naming every
  damaged rank, within ``SECONDS``, with its weights unchanged.

Anything else (another exception, a rank-local error, a damaged batch trained, a valid one refused,
outputs or weights that differ) is counted and described. Seeded: ``FUZZ_SEED`` / ``FUZZ_INPUT_CASES``
in the environment for a longer run (``FUZZ_INPUT_CASES=3000 pytest tests/test_fuzz_inputs.py``).
A planted bug (rank 1 hides its bad ids from the verdict) must be caught.
"""

import faulthandler
import os
import sys
import time
from collections import Counter
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
import torchrec
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

from tests.fuzz_batches import fuzz_batch
from tests.models import OPTIMIZERS, build, full_weight, hot_ids, tables
from tests.multiprocess import run_ranks
from torchrec_hybrid import HybridEmbeddingBagCollectionSharder, InvalidInputError

SEED = int(os.environ.get("FUZZ_SEED", "58"))
CASES = int(os.environ.get("FUZZ_INPUT_CASES", "200"))  # per profile (unweighted on 3 ranks, weighted on 2)
VERBOSE = bool(os.environ.get("FUZZ_VERBOSE"))  # each rank's batch of each case on stderr
P_BAD = 0.15  # per rank and case: the chance its batch is damaged
SECONDS = 20.0  # every rank must have raised within this (the process-group timeout is 60 s here)
TOL = 1e-4  # float tolerance of outputs and weights (rounding differs and builds up over the cases' SGD steps)
CHECK_EVERY = 50  # cases between weight comparisons
KINDS = {"t0": "hybrid", "t1": "hybrid_tw", "t2": "tw", "t3": "hybrid_uneven"}
STOCK = {t: "tw" for t in KINDS}
TRAINED, REFUSED = "trained like table_wise", "refused on every rank"


def _local(model) -> Dict[str, torch.Tensor]:
    """This rank's shards of every weight (copies): what a refused step must leave as it was."""
    out = {}
    for k, v in model.state_dict().items():
        shards = v.local_shards() if hasattr(v, "local_shards") else None
        out[k] = torch.cat([s.tensor.flatten() for s in shards]) if shards is not None and shards else \
            (v.detach().flatten() if shards is None else torch.empty(0))
        out[k] = out[k].clone()
    return out


def _outputs_differ(out: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor], keys: List[str]) -> str:
    """'' when the pooled outputs match per key, else which keys differ and by how much."""
    if not sorted(out) == sorted(ref) == sorted(keys):
        return f"output keys {sorted(out)}, table_wise's {sorted(ref)}"
    bad = {k: (tuple(out[k].shape), tuple(ref[k].shape)) if out[k].shape != ref[k].shape else
           float((out[k] - ref[k]).abs().max()) for k in keys
           if out[k].shape != ref[k].shape or not torch.allclose(out[k], ref[k], atol=TOL, rtol=TOL)}
    return f"outputs differ: {bad}" if bad else ""


def _weights_differ(hybrid, stock) -> List[str]:
    """Tables whose full weights differ between the two models (collective)."""
    sh, st = hybrid.state_dict(), stock.state_dict()
    return [k for k in st if not torch.allclose(full_weight(sh[k]), full_weight(st[k]), atol=TOL, rtol=TOL)]


def _plant_hidden_bad_ids(rank: int) -> None:
    """The planted bug: rank 1's input check clamps its bad ids but reports none."""
    from torchrec_hybrid import input_check

    if rank != 1:
        return
    original = input_check.InputCheck._check_values

    def hiding(self, features, check, negative=None):
        out = original(self, features, check, negative)
        check.report = check.report * (check.report[0] != input_check._BAD_ID)
        return out

    input_check.InputCheck._check_values = hiding


def fuzz_job(rank: int, world: int, weighted: bool, seed: int, cases: int, plant: bool = False) -> Dict[str, Any]:
    """Runs the cases; every rank returns the same tally: outcome counts, the other outcomes' descriptions,
    the slowest refusal's seconds and the damages seen."""
    torch.set_num_threads(1)
    faulthandler.enable()
    configs = tables(mean=not weighted)
    hot = hot_ids()
    torch.manual_seed(0)
    init = torchrec.EmbeddingBagCollection(tables=configs, is_weighted=weighted).state_dict()
    hybrid = build(configs, world, KINDS,
                   HybridEmbeddingBagCollectionSharder(hot, fused_params=OPTIMIZERS["sgd"]), weighted=weighted)
    stock = build(configs, world, STOCK, EmbeddingBagCollectionSharder(fused_params=OPTIMIZERS["sgd"]),
                  weighted=weighted)
    hybrid.load_state_dict(init)
    stock.load_state_dict(init)
    keys = [f for c in configs for f in c.feature_names]
    if plant:
        _plant_hidden_bad_ids(rank)
    tally: Counter = Counter()
    damages: Counter = Counter()
    others: List[str] = []
    slowest = 0.0
    for case in range(cases):
        fb = fuzz_batch(configs, hot, weighted, seed, case, rank, P_BAD)
        if VERBOSE:
            print(f"case {case} rank {rank}: {fb.damage} keys {fb.kjt.keys()} ids {fb.kjt.values().dtype} "
                  f"lengths {fb.kjt.lengths().dtype} vbe {fb.kjt.variable_stride_per_key()}", file=sys.stderr,
                  flush=True)
        before = _local(hybrid)
        t0 = time.perf_counter()
        try:
            out: Optional[Dict[str, torch.Tensor]] = hybrid(fb.kjt).wait().to_dict()
            verdict = "trained"
        except InvalidInputError as e:
            out, verdict = None, f"refused: {e}"
        except Exception as e:  # noqa: BLE001 - what the fuzzing looks for: counted, described
            out, verdict = None, f"{type(e).__name__}: {e}"
        seconds = time.perf_counter() - t0
        everyone: List[Any] = [None] * world
        dist.all_gather_object(everyone, (verdict, fb.damage))
        damaged = [r for r, (_, d) in enumerate(everyone) if d]
        for _, d in everyone:
            damages.update(d)
        problem = None
        if all(v == "trained" for v, _ in everyone):
            if damaged:
                problem = f"damaged batch trained (ranks {damaged}: {[everyone[r][1] for r in damaged]})"
            else:
                assert out is not None and fb.reference is not None
                ref = stock(fb.reference).wait().to_dict()
                mine = _outputs_differ(out, ref, keys)
                coef = torch.randn(ref[keys[0]].shape[0], sum(ref[k].shape[1] for k in keys),
                                   generator=torch.Generator().manual_seed(seed + case + rank))
                (torch.cat([out[k] for k in keys], dim=1) * coef).sum().backward()
                (torch.cat([ref[k] for k in keys], dim=1) * coef).sum().backward()
                verdicts: List[Any] = [None] * world
                dist.all_gather_object(verdicts, mine)
                problem = next((f"rank {r}: {v}" for r, v in enumerate(verdicts) if v), None)
        elif all(v.startswith("refused: ") for v, _ in everyone):
            messages = {v for v, _ in everyone}
            unchanged = all(torch.equal(v, before[k]) for k, v in _local(hybrid).items())
            flags: List[Any] = [None] * world
            dist.all_gather_object(flags, (unchanged, seconds))
            slowest = max(slowest, max(s for _, s in flags))
            msg = everyone[0][0]
            if not damaged:
                problem = f"valid batches refused: {msg}"
            elif len(messages) > 1:
                problem = f"different messages: {sorted(messages)}"
            elif not all(f"rank {r}:" in msg for r in damaged):
                problem = f"damaged ranks {damaged} not all named: {msg}"
            elif "rejected on every rank before any lookup or update" not in msg:
                problem = f"message lacks the verdict: {msg}"
            elif not all(u for u, _ in flags):
                problem = f"weights changed on ranks {[r for r, (u, _) in enumerate(flags) if not u]}"
            elif max(s for _, s in flags) > SECONDS:
                problem = f"slow refusal: {max(s for _, s in flags):.1f} s"
        else:
            problem = f"ranks disagree: {[v[:200] for v, _ in everyone]}"
        if problem is None:
            tally[TRAINED if not damaged else REFUSED] += 1
        else:
            tally["anything else"] += 1
            others.append(f"case {case} (seed {seed}, damages {[d for _, d in everyone]}): {problem}"[:600])
            if not all(v.startswith("refused: ") for v, _ in everyone):
                break  # the two models may no longer be in step: stop here
        if (case + 1) % CHECK_EVERY == 0 or case == cases - 1:
            differ = _weights_differ(hybrid, stock)
            if differ:
                tally["anything else"] += 1
                others.append(f"after case {case} (seed {seed}): weights differ from table_wise: {differ}")
                break
    return {"tally": dict(tally), "others": others, "slowest_refusal_s": slowest, "damages": dict(damages),
            "cases": sum(tally.values())}


@pytest.mark.parametrize("weighted,world", [(False, 3), (True, 2)], ids=["unweighted-3-ranks", "weighted-2-ranks"])
def test_fuzzed_batches_train_like_stock_or_fail_on_every_rank(weighted, world):
    results = run_ranks(fuzz_job, world, timeout=60 + 2.0 * CASES, weighted=weighted, seed=SEED, cases=CASES)
    got = results[0]
    assert all(r["tally"] == got["tally"] for r in results), [r["tally"] for r in results]
    print(f"input fuzzing, {'weighted' if weighted else 'unweighted'}, {world} ranks, seed {SEED}: {got['tally']}, "
          f"slowest refusal {got['slowest_refusal_s']:.2f} s, damages {got['damages']}")
    assert not got["others"], "\n".join(got["others"])
    assert got["tally"].get(TRAINED, 0) > 0.4 * CASES and got["tally"].get(REFUSED, 0) > 0.2 * CASES, got["tally"]
    assert got["cases"] == CASES


def test_fuzzing_catches_a_planted_bug():
    """Rank 1's check clamps its bad ids but does not report them: the fuzzing must flag it."""
    results = run_ranks(fuzz_job, 3, timeout=300, weighted=False, seed=SEED, cases=CASES, plant=True)
    others = results[0]["others"]
    assert others and "damaged batch trained" in others[0] and "ranks [1]" in others[0], others
