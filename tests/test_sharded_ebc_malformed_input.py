"""Malformed batches, empty batches and non-finite weights (issue 20, items 2-4).

A KJT malformed on one rank only (a feature missing, keys reordered, an unknown key, a key
twice, sizes that do not add up, a negative bag length, ids not 1-D int32 / int64, weights where the
module takes none, NaN / inf weights)
raises the same clear error on every rank within seconds, before any lookup or update; the
next good batch trains. Empty batches (0 samples on one rank or on all) train exactly like
stock table_wise. Several cases share one spawned job to keep the suite short.
"""

import time
from typing import Callable, Dict, List, Optional

import pytest
import torch
import torchrec
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from tests.models import OPTIMIZERS, build, full_weight, hot_ids, skewed_batch, tables, variable_batch
from tests.multiprocess import run_ranks
from torchrec_hybrid import (
    HybridEmbeddingBagCollectionSharder,
    InvalidIdError,
    InvalidWeightError,
    MalformedBatchError,
)

KINDS = {"t0": "hybrid", "t1": "hybrid_tw", "t2": "tw", "t3": "hybrid_uneven"}
STOCK = {"t0": "tw", "t1": "tw", "t2": "tw", "t3": "tw"}
SECONDS = 20  # every rank must have raised within this (the process-group timeout is 60 s here)


def _keys(configs) -> List[str]:
    return [f for c in configs for f in c.feature_names]


def _step(model, kjt, keys):
    d = model(kjt).wait().to_dict()
    torch.cat([d[k] for k in keys], dim=1).sum().backward()


def _rebuild(kjt: KeyedJaggedTensor, order: List[str], extra: Optional[Dict[str, JaggedTensor]] = None,
             drop_weights: bool = False) -> KeyedJaggedTensor:
    """``kjt`` with the keys ``order`` (any may repeat; ``extra`` adds keys of its own)."""
    jts = dict(kjt.to_dict(), **(extra or {}))
    weighted = kjt.weights_or_none() is not None and not drop_weights
    return KeyedJaggedTensor(
        keys=order, values=torch.cat([jts[k].values() for k in order]),
        lengths=torch.cat([jts[k].lengths() for k in order]),
        weights=torch.cat([jts[k].weights() for k in order]) if weighted else None, stride=kjt.stride())


def _missing(kjt, keys):
    return _rebuild(kjt, [k for k in keys if k != "f1"])


def _reordered(kjt, keys):
    return _rebuild(kjt, keys[::-1])


def _unknown_key_bad_id(kjt, keys):
    b = kjt.stride()
    zz = JaggedTensor(values=torch.tensor([10**6]), lengths=torch.tensor([1] + [0] * (b - 1)))
    return _rebuild(kjt, keys[:2] + ["user_history_ids"] + keys[2:], {"user_history_ids": zz})


def _duplicate(kjt, keys):
    return _rebuild(kjt, keys + ["f2"])


def _values_size(kjt, keys):
    return KeyedJaggedTensor(keys=keys, values=torch.cat([kjt.values(), torch.tensor([1, 2])]),
                             lengths=kjt.lengths(), stride=kjt.stride())


def _negative_length(kjt, keys):
    """A bag of length -1 in 'f1', the next one longer by as much: the lengths still add up to the values."""
    lengths, b = kjt.lengths().clone(), kjt.stride()
    i = keys.index("f1") * b
    lengths[i + 1] += lengths[i] + 1
    lengths[i] = -1
    return KeyedJaggedTensor(keys=keys, values=kjt.values(), lengths=lengths, stride=b)


def _negative_key_sum(kjt, keys):
    """A bag of 'f1' so negative that 'f1''s lengths add up to less than 0, 'f2''s first bag longer by as
    much: the lengths still add up to the values (a segfault in TorchRec's permute once)."""
    lengths, b = kjt.lengths().clone(), kjt.stride()
    i, j = keys.index("f1") * b, keys.index("f2") * b
    shift = int(lengths[i:i + b].sum()) + 5
    lengths[i] -= shift
    lengths[j] += shift
    return KeyedJaggedTensor(keys=keys, values=kjt.values(), lengths=lengths, stride=b)


def _weights_unexpected(kjt, keys):
    return KeyedJaggedTensor(keys=keys, values=kjt.values(), lengths=kjt.lengths(),
                             weights=torch.ones(kjt.values().numel()), stride=kjt.stride())


def _ids_as(kjt, keys, values):
    return KeyedJaggedTensor(keys=keys, values=values, lengths=kjt.lengths(), stride=kjt.stride())


def _vbe_no_inverse(kjt, keys):
    vbe = variable_batch(kjt, seed=5)
    return KeyedJaggedTensor(keys=keys, values=vbe.values(), lengths=vbe.lengths(),
                             stride_per_key_per_rank=vbe.stride_per_key_per_rank())


def _vbe_inverse_range(kjt, keys):
    vbe = variable_batch(kjt, seed=5)
    inverse = vbe.inverse_indices()[1].clone()
    inverse[2, -1] = 99
    return KeyedJaggedTensor(keys=keys, values=vbe.values(), lengths=vbe.lengths(),
                             stride_per_key_per_rank=vbe.stride_per_key_per_rank(), inverse_indices=(keys, inverse))


def _vbe_extra_length(kjt, keys):
    """A variable batch with one length more than its per-key batch sizes add up to."""
    vbe = variable_batch(kjt, seed=5)
    lengths = torch.cat([vbe.lengths(), torch.zeros(1, dtype=vbe.lengths().dtype)])
    return KeyedJaggedTensor(keys=keys, values=vbe.values(), lengths=lengths,
                             stride_per_key_per_rank=vbe.stride_per_key_per_rank(),
                             inverse_indices=vbe.inverse_indices())


def _vbe_values_size(kjt, keys):
    """A variable batch with two ids more than its lengths add up to (its expansion would drop them)."""
    vbe = variable_batch(kjt, seed=5)
    return KeyedJaggedTensor(keys=keys, values=torch.cat([vbe.values(), torch.tensor([1, 2])]), lengths=vbe.lengths(),
                             stride_per_key_per_rank=vbe.stride_per_key_per_rank(),
                             inverse_indices=vbe.inverse_indices())


def _vbe_negative_length(kjt, keys):
    """A variable batch whose first bag of 'f1' has length -1, the next bag of any feature longer by as much."""
    vbe = variable_batch(kjt, seed=5)
    lengths = vbe.lengths().clone()
    i = sum(vbe.stride_per_key()[:keys.index("f1")])
    lengths[i + 1] += lengths[i] + 1
    lengths[i] = -1
    return KeyedJaggedTensor(keys=keys, values=vbe.values(), lengths=lengths,
                             stride_per_key_per_rank=vbe.stride_per_key_per_rank(),
                             inverse_indices=vbe.inverse_indices())


# a variable batch per feature that cannot be expanded to one batch (hybrid modules only: stock
# shardings take VBE batches as they are)
VARIABLE_BATCH_CASES: Dict[str, tuple] = {
    "vbe-no-inverse": (_vbe_no_inverse, MalformedBatchError, ["no inverse_indices"]),
    "vbe-extra-length": (_vbe_extra_length, MalformedBatchError, ["lengths, not the", "bags its per-key batch sizes"]),
    "vbe-inverse-range": (_vbe_inverse_range, MalformedBatchError, ["'f1'", "inverse index 99"]),
    "vbe-values-size": (_vbe_values_size, MalformedBatchError, ["values"]),
    "vbe-negative-length": (_vbe_negative_length, MalformedBatchError, ["'f1'", "negative length -1"]),
}

# case -> (how the last rank's batch is damaged, error class, words every message holds)
STRUCTURE_CASES: Dict[str, tuple] = {
    "missing-key": (_missing, MalformedBatchError, ["'f1'", "missing"]),
    "reordered": (_reordered, MalformedBatchError, ["different order", "'f3'", "'f0'"]),
    "unknown-key-bad-id": (_unknown_key_bad_id, MalformedBatchError, ["'user_hi...'", "no feature"]),
    "duplicate-key": (_duplicate, MalformedBatchError, ["'f2'", "more than once"]),
    "values-size": (_values_size, MalformedBatchError, ["values"]),
    "negative-length": (_negative_length, MalformedBatchError, ["'f1'", "negative length -1"]),
    "negative-key-sum": (_negative_key_sum, MalformedBatchError, ["'f1'", "negative length"]),
    "weights-unexpected": (_weights_unexpected, MalformedBatchError, ["not weighted"]),
    # ids no dist or kernel reads (the check itself raised on that rank alone, and the others waited)
    "float-ids": (lambda kjt, keys: _ids_as(kjt, keys, kjt.values().float()), MalformedBatchError,
                  ["ids are float32, not int32 or int64"]),
    "int16-ids": (lambda kjt, keys: _ids_as(kjt, keys, kjt.values().to(torch.int16)), MalformedBatchError,
                  ["ids are int16"]),
    "2d-ids": (lambda kjt, keys: _ids_as(kjt, keys, kjt.values().view(-1, 1)), MalformedBatchError,
               ["ids are a 2-D tensor, not 1-D"]),
}


def _rejected_everywhere(model, configs, keys, world, damage: Callable, error, words, seed, bad_ranks=None,
                         weighted=False) -> tuple:
    """One rejected step (``damage`` applied on ``bad_ranks``, default the last rank): the error,
    its message, weights unchanged, this rank's seconds."""
    bad_ranks = [world - 1] if bad_ranks is None else bad_ranks
    rank = torch.distributed.get_rank()
    before = {k: full_weight(v) for k, v in model.state_dict().items()}
    kjt = skewed_batch(configs, keys, batch=4, seed=seed + rank, hot=hot_ids(), weighted=weighted)
    if rank in bad_ranks:
        kjt = damage(kjt, keys)
    t0 = time.perf_counter()
    with pytest.raises(error) as err:
        _step(model, kjt, keys)
    seconds = time.perf_counter() - t0
    msg = str(err.value)
    for r in bad_ranks:
        assert f"rank {r}:" in msg, msg
    assert all(w in msg for w in words), (words, msg)
    assert "rejected on every rank before any lookup or update" in msg, msg
    for k, v in model.state_dict().items():
        assert torch.equal(full_weight(v), before[k]), f"{k} changed on a rejected batch"
    return type(err.value).__name__, msg, seconds


def _trains(model, configs, keys, seed, weighted=False):
    """A good step after the rejected ones changes weights."""
    rank = torch.distributed.get_rank()
    before = {k: full_weight(v) for k, v in model.state_dict().items()}
    _step(model, skewed_batch(configs, keys, batch=4, seed=seed + rank, hot=hot_ids(), weighted=weighted), keys)
    after = {k: full_weight(v) for k, v in model.state_dict().items()}
    assert any(not torch.equal(after[k], before[k]) for k in after)


def structure_cases(rank, world, kinds):
    configs = tables()
    keys = _keys(configs)
    model = build(configs, world, kinds,
                  HybridEmbeddingBagCollectionSharder(hot_ids(), fused_params=OPTIMIZERS["sgd"], validate_ids=True))
    # the first batch (sets the key order) already malformed on the last rank
    out = {"first-batch-missing-key": _rejected_everywhere(model, configs, keys, world, _missing,
                                                           MalformedBatchError, ["'f1'", "missing"], seed=0)}
    _trains(model, configs, keys, seed=10)
    cases = dict(STRUCTURE_CASES, **(VARIABLE_BATCH_CASES if "hybrid" in kinds.values() else {}))
    for i, (case, (damage, error, words)) in enumerate(cases.items()):
        out[case] = _rejected_everywhere(model, configs, keys, world, damage, error, words, seed=100 * (i + 2))
    # several ranks, several problems: every rank names them all; the structural error wins
    bad_id = lambda kjt, keys: KeyedJaggedTensor(  # noqa: E731
        keys=keys, values=torch.cat([torch.tensor([-7]), kjt.values()[1:]]), lengths=kjt.lengths(),
        stride=kjt.stride()) if torch.distributed.get_rank() == 0 else _missing(kjt, keys)
    out["bad-id-and-missing-key"] = _rejected_everywhere(
        model, configs, keys, world, bad_id, MalformedBatchError, ["-7", "'f1'"], seed=900,
        bad_ranks=[0, world - 1])
    # both found on the error path, each by the rank that reported it: which id, which length
    bad_id_or_negative = lambda kjt, keys: KeyedJaggedTensor(  # noqa: E731
        keys=keys, values=torch.cat([torch.tensor([-7]), kjt.values()[1:]]), lengths=kjt.lengths(),
        stride=kjt.stride()) if torch.distributed.get_rank() == 0 else _negative_length(kjt, keys)
    out["bad-id-and-negative-length"] = _rejected_everywhere(
        model, configs, keys, world, bad_id_or_negative, MalformedBatchError, ["id -7", "negative length -1"],
        seed=950, bad_ranks=[0, world - 1])
    _trains(model, configs, keys, seed=1000)
    return out


@pytest.mark.parametrize("kinds,world", [(KINDS, 3), (STOCK, 2)], ids=["hybrid", "stock-only"])
def test_malformed_batch_on_one_rank_fails_on_every_rank(kinds, world):
    """With hybrid tables the verdicts ride the cold metadata; with stock types only, the
    stock input dist's split sizes: either way every rank raises the same error within seconds."""
    results = run_ranks(structure_cases, world, timeout=300, kinds=kinds)
    for case in results[0]:
        msgs = {r[case][1] for r in results}
        assert len(msgs) == 1, (case, msgs)  # the same message on every rank
        for r in results:
            assert r[case][2] < SECONDS, (case, r[case])


def weight_cases(rank, world, validate_weights):
    configs = tables()
    keys = _keys(configs)
    sharder = HybridEmbeddingBagCollectionSharder(hot_ids(), fused_params=OPTIMIZERS["sgd"],
                                                  validate_weights=validate_weights)
    model = build(configs, world, KINDS, sharder, weighted=True)
    _trains(model, configs, keys, seed=0, weighted=True)
    out = {}
    for i, (case, value) in enumerate({"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}.items()):
        def damage(kjt, keys, value=value):
            w = kjt.weights().clone()
            start = int(sum(kjt.length_per_key()[: keys.index("f3")]))
            w[start] = value
            return KeyedJaggedTensor(keys=keys, values=kjt.values(), lengths=kjt.lengths(), weights=w,
                                     stride=kjt.stride())

        if validate_weights:
            out[case] = _rejected_everywhere(model, configs, keys, world, damage, InvalidWeightError,
                                             ["'f3'", "non-finite", str(value)], seed=100 * (i + 1),
                                             weighted=True)
        else:  # the check is off: the batch goes through, its weight as given (not replaced by 0)
            kjt = skewed_batch(configs, keys, batch=4, seed=7 + rank, hot=hot_ids(), weighted=True)
            pooled = model(damage(kjt, keys) if rank == world - 1 else kjt).wait().to_dict()
            out[case] = bool(torch.isfinite(pooled["f3"]).all())
    out["weights-missing"] = (None if not validate_weights else _rejected_everywhere(
        model, configs, keys, world, lambda kjt, keys: _rebuild(kjt, keys, drop_weights=True),
        MalformedBatchError, ["no per-sample weights"], seed=600, weighted=True))
    if validate_weights:
        _trains(model, configs, keys, seed=700, weighted=True)
    return out


def test_non_finite_weights_rejected_on_every_rank():
    results = run_ranks(weight_cases, 2, timeout=240, validate_weights=True)
    for case in results[0]:
        assert results[0][case][1] == results[1][case][1]
        assert all(r[case][2] < SECONDS for r in results)


def test_weight_check_can_be_switched_off():
    """validate_weights=False: a NaN / inf weight is neither refused nor cleaned: it reaches its rank's
    pooled output; the other rank's batch is clean."""
    results = run_ranks(weight_cases, 2, timeout=240, validate_weights=False)
    for case in ("nan", "inf", "-inf"):
        assert results[-1][case] is False and results[0][case] is True, (case, results)


def test_bad_id_error_is_an_invalid_input_error():
    from torchrec_hybrid import InvalidInputError

    assert issubclass(InvalidIdError, InvalidInputError) and issubclass(MalformedBatchError, InvalidInputError)


def _empty(keys, weighted):
    return torchrec.KeyedJaggedTensor(keys=keys, values=torch.empty(0, dtype=torch.int64),
                                      lengths=torch.empty(0, dtype=torch.int64), stride=0,
                                      weights=torch.empty(0) if weighted else None)


def empty_batches(rank, world, weighted, mean):
    """Hybrid and stock table_wise on the same batches, some of 0 samples (on one rank, then
    on all): same outputs every step, same weights after training."""
    configs = tables(mean=mean)
    keys = _keys(configs)
    torch.manual_seed(0)
    ref = torchrec.EmbeddingBagCollection(tables=configs, is_weighted=weighted)
    hot_t = hot_ids()
    mh = build(configs, world, KINDS, HybridEmbeddingBagCollectionSharder(hot_t, fused_params=OPTIMIZERS["sgd"]),
               weighted=weighted)
    mt = build(configs, world, STOCK, EmbeddingBagCollectionSharder(fused_params=OPTIMIZERS["sgd"]),
               weighted=weighted)
    mh.load_state_dict(ref.state_dict())
    mt.load_state_dict(ref.state_dict())
    empty_on = {0: [world - 1], 2: list(range(world)), 3: [0]}  # step -> ranks with 0 samples
    for step in range(5):
        if rank in empty_on.get(step, []):
            kjt = _empty(keys, weighted)
        else:
            kjt = skewed_batch(configs, keys, batch=4, seed=100 * step + rank, hot=hot_t, weighted=weighted)
        oh, ot = mh(kjt).wait().to_dict(), mt(kjt).wait().to_dict()
        vh = torch.cat([oh[k] for k in keys], dim=1)
        vt = torch.cat([ot[k] for k in keys], dim=1)
        assert vh.shape == vt.shape == (kjt.stride(), vt.shape[1])
        torch.testing.assert_close(vh, vt, atol=1e-5, rtol=1e-5)
        coef = torch.randn(vt.shape, generator=torch.Generator().manual_seed(7 + step + rank))
        (vh * coef).sum().backward()
        (vt * coef).sum().backward()
    sh, st = mh.state_dict(), mt.state_dict()
    for k in st:
        torch.testing.assert_close(full_weight(sh[k]), full_weight(st[k]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("weighted,mean", [(False, True), (True, False)], ids=["mean", "weighted"])
def test_empty_batches_train_like_table_wise(weighted, mean):
    run_ranks(empty_batches, 2, timeout=240, weighted=weighted, mean=mean)
