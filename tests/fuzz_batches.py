"""Random batches for the input fuzzing (issue 58 item 1): valid ones of every shape a user may send,
and damaged ones, each labelled with what was damaged.

:func:`fuzz_batch` draws one rank's batch for one case from ``(seed, case, rank)`` alone, so every
rank knows nothing of the others' batches and a failing case re-runs from its numbers. A valid
batch varies its batch size (0 included, different per rank), bag lengths (0 included), id and
length dtypes (int32 / int64), how many ids are hot, finite weights (negative and 0 included; float32,
float64 or float16) and may be a variable batch per feature (VBE, with inverse indices). A damaged one (drawn with
probability ``p_bad``, one or two damages) has keys missing, reordered, unknown or repeated, sizes
that do not add up, negative lengths, ids negative, past their table or of another dtype or shape,
weights missing, unexpected, non-finite, of the wrong length or dtype, or a VBE batch without or
with bad inverse indices. With each batch comes the reference a stock table_wise module gets for
the same samples (int64, one batch for every feature), None when damaged.
"""

import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.models import expanded_batch, variable_batch

UNKNOWN_KEY = "zz_not_a_feature"
# damages of a batch with one batch size for every feature (keys, sizes, ids, weights)
STRUCTURE = ("missing-key", "reordered", "unknown-key", "duplicate-key", "values-size", "lengths-size",
             "negative-length", "float-ids", "int16-ids", "2d-ids")
KEYS = ("missing-key", "reordered", "unknown-key", "duplicate-key")
VALUES = ("negative-id", "id-past-table", "huge-id")
WEIGHTED = ("weights-missing", "nan-weight", "inf-weight", "weights-size", "int-weights")
UNWEIGHTED = ("weights-unexpected",)
VBE = ("vbe-no-inverse", "vbe-inverse-range", "vbe-extra-length")


@dataclass
class FuzzBatch:
    """One rank's batch of one case: ``kjt`` for the hybrid module, ``reference`` (the same samples for
    stock table_wise; None when damaged) and ``damage`` (what was damaged, in order; empty: valid)."""

    kjt: KeyedJaggedTensor
    reference: Optional[KeyedJaggedTensor]
    damage: Tuple[str, ...]


# a batch as parts per key: (key, lengths, ids, weights or None)
_Part = Tuple[str, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]


def _parts(rng: random.Random, g: torch.Generator, configs, hot: Dict[str, torch.Tensor], weighted: bool,
           batch: int) -> List[_Part]:
    """Per feature: ``batch`` bags of 0 .. max_len ids, a drawn share of them hot (test data set-up: a loop
    over features)."""
    max_len = rng.choice([0, 1, 3, 4, 12])
    hot_share = rng.choice([0.0, 0.5, 0.9, 1.0])
    parts = []
    for c in configs:
        h = hot.get(c.name, torch.empty(0, dtype=torch.int64))
        for f in c.feature_names:
            lengths = torch.randint(0, max_len + 1, (batch,), generator=g)
            n = int(lengths.sum())
            ids = torch.randint(0, c.num_embeddings, (n,), generator=g)
            if h.numel():
                pick = torch.rand(n, generator=g) < hot_share
                ids = torch.where(pick, h[torch.randint(0, h.numel(), (n,), generator=g)], ids)
            weights = (torch.rand(n, generator=g) * 4 - 2) if weighted else None
            if weights is not None and n and rng.random() < 0.2:
                weights[0] = 0.0
            parts.append((f, lengths, ids, weights))
    return parts


def _assemble(parts: List[_Part], batch: int, ids_dtype: torch.dtype, lengths_dtype: torch.dtype,
              weights: Optional[torch.dtype]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=[p[0] for p in parts], values=torch.cat([p[2] for p in parts]).to(ids_dtype),
        lengths=torch.cat([p[1] for p in parts]).to(lengths_dtype),
        weights=torch.cat([p[3] for p in parts]).to(weights) if weights else None, stride=batch)


def _damage_parts(parts: List[_Part], damage: str, rng: random.Random, g: torch.Generator) -> List[_Part]:
    """A damage of the keys (before the parts are put together)."""
    parts = list(parts)
    if damage == "missing-key":
        parts.pop(rng.randrange(len(parts)))
    elif damage == "reordered":
        order = list(range(len(parts)))
        while order == sorted(order):
            rng.shuffle(order)
        parts = [parts[i] for i in order]
    elif damage == "unknown-key":
        batch = parts[0][1].numel()
        lengths = torch.randint(0, 3, (batch,), generator=g)
        n = int(lengths.sum())
        weights = None if parts[0][3] is None else torch.rand(n, generator=g)
        parts.insert(rng.randrange(len(parts) + 1),
                     (UNKNOWN_KEY, lengths, torch.randint(0, 10 ** 6, (n,), generator=g), weights))
    elif damage == "duplicate-key":
        parts.insert(rng.randrange(len(parts) + 1), parts[rng.randrange(len(parts))])
    return parts


def _like(kjt: KeyedJaggedTensor, **tensors) -> KeyedJaggedTensor:
    """``kjt`` with some of its values / lengths / weights replaced (a VBE batch stays one)."""
    parts = dict(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), weights=kjt.weights_or_none())
    parts.update(tensors)
    if kjt.variable_stride_per_key():
        return KeyedJaggedTensor(stride_per_key_per_rank=kjt.stride_per_key_per_rank(),
                                 inverse_indices=kjt.inverse_indices_or_none(), **parts)
    return KeyedJaggedTensor(stride=kjt.stride(), **parts)


def _looked_up(kjt: KeyedJaggedTensor, rows: Dict[str, int]) -> List[int]:
    """Positions of ids some sample reads (first and last id of each bag of a feature; of a VBE batch only
    the bags its inverse indices name): where a bad id or weight must be refused (test set-up: loops)."""
    lengths = kjt.lengths().tolist()
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    variable = kjt.variable_stride_per_key()
    bags = kjt.stride_per_key() if variable else [kjt.stride()] * len(kjt.keys())
    inverse = kjt.inverse_indices_or_none() if variable else None
    spots: List[int] = []
    first = 0
    for k, key in enumerate(kjt.keys()):
        used = sorted(set(inverse[1][k].tolist())) if inverse is not None else range(bags[k])
        if key in rows:
            spots += [j for b in used if lengths[first + b] > 0
                      for j in (starts[first + b], starts[first + b + 1] - 1)]
        first += bags[k]
    return spots


def _damage_ids(kjt: KeyedJaggedTensor, damage: str, rng: random.Random, rows: Dict[str, int]) -> KeyedJaggedTensor:
    """One id some sample reads made negative, past its table or huge (the batch's structure kept)."""
    spots = _looked_up(kjt, rows)
    if not spots:  # a key damage took them all (there is another damage then)
        return kjt
    j = rng.choice(spots)
    ends = torch.tensor(kjt.length_per_key()).cumsum(0).tolist()
    key = kjt.keys()[next(k for k, end in enumerate(ends) if j < end)]
    ids = kjt.values().clone()
    ids[j] = {"negative-id": -rng.randint(1, 10 ** 6), "id-past-table": rows[key] + rng.randint(0, 3),
              "huge-id": 2 ** 31 - 1}[damage]
    return _like(kjt, values=ids)


def _damage_tensors(kjt: KeyedJaggedTensor, damage: str, rng: random.Random, spots: List[int]
                    ) -> KeyedJaggedTensor:
    """A damage of the assembled batch's tensors (sizes, dtypes, shapes, weights)."""
    ids, lengths, weights = kjt.values(), kjt.lengths(), kjt.weights_or_none()
    if damage == "values-size":
        ids = ids[:-1] if ids.numel() and rng.random() < 0.5 else torch.cat([ids, ids.new_tensor([1, 2])])
        if weights is not None:
            weights = weights[:ids.numel()] if weights.numel() > ids.numel() else \
                torch.cat([weights, weights.new_ones(ids.numel() - weights.numel())])
    elif damage == "lengths-size":
        lengths = torch.cat([lengths, lengths.new_zeros(1)]) if rng.random() < 0.5 or not lengths.numel() else \
            torch.cat([lengths[:-2], lengths[-2:].sum(0, keepdim=True)])
    elif damage == "negative-length":
        lengths = lengths.clone()
        i, j = rng.sample(range(lengths.numel()), 2)
        lengths[j] += lengths[i] + 1
        lengths[i] = -1
    elif damage == "float-ids":
        ids = ids.float()
    elif damage == "int16-ids":
        ids = ids.to(torch.int16)
    elif damage == "2d-ids":
        ids = ids.view(-1, 1)
    elif damage == "weights-missing":
        weights = None
    elif damage in ("nan-weight", "inf-weight"):
        weights = weights.clone()
        weights[rng.choice(spots)] = float("nan") if damage == "nan-weight" else \
            rng.choice([float("inf"), float("-inf")])
    elif damage == "weights-size":
        weights = torch.cat([weights, weights.new_ones(1)])
    elif damage == "int-weights":
        weights = weights.round().to(torch.int64)
    elif damage == "weights-unexpected":
        weights = torch.ones(ids.shape[0] if ids.dim() else 0)
    return _like(kjt, values=ids, lengths=lengths, weights=weights)


def _damage_variable(kjt: KeyedJaggedTensor, damage: str, rng: random.Random) -> KeyedJaggedTensor:
    """A damage of a VBE batch's inverse indices or per-key batch sizes."""
    keys, inverse = kjt.inverse_indices()
    common = dict(keys=kjt.keys(), values=kjt.values(), weights=kjt.weights_or_none(),
                  stride_per_key_per_rank=kjt.stride_per_key_per_rank())
    if damage == "vbe-no-inverse":
        return KeyedJaggedTensor(lengths=kjt.lengths(), **common)
    if damage == "vbe-inverse-range":
        inverse = inverse.clone()
        f = rng.randrange(inverse.shape[0])
        inverse[f, rng.randrange(inverse.shape[1])] = kjt.stride_per_key()[f] + rng.randint(0, 5)
        return KeyedJaggedTensor(lengths=kjt.lengths(), inverse_indices=(keys, inverse), **common)
    lengths = torch.cat([kjt.lengths(), kjt.lengths().new_zeros(1)])  # vbe-extra-length
    return KeyedJaggedTensor(lengths=lengths, inverse_indices=(keys, inverse), **common)


def fuzz_batch(configs, hot: Dict[str, torch.Tensor], weighted: bool, seed: int, case: int, rank: int,
               p_bad: float) -> FuzzBatch:
    """One rank's batch of one case (see the module docstring); case 0 is valid on every rank (the first
    batch fixes the key order)."""
    rng = random.Random(f"{seed}/{case}/{rank}")
    g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    rows = {f: c.num_embeddings for c in configs for f in c.feature_names}
    batch = rng.choice([0, 1, 2, 3, 5, 8])
    ids_dtype = rng.choice([torch.int64, torch.int64, torch.int32])
    lengths_dtype = rng.choice([torch.int64, torch.int64, torch.int32])
    parts = _parts(rng, g, configs, hot, weighted, batch)
    weights_dtype = rng.choice([torch.float32, torch.float32, torch.float64, torch.float16]) if weighted else None
    variable = batch > 0 and rng.random() < 0.15
    kjt = _assemble(parts, batch, ids_dtype, lengths_dtype, weights_dtype)
    if variable:
        kjt = variable_batch(kjt, seed=rng.randrange(2 ** 31))
    spots = _looked_up(kjt, rows)
    damage: List[str] = []
    if case > 0 and rng.random() < p_bad:
        choices = list(VALUES if spots else ())
        if variable:  # a VBE batch's sizes too (its expansion copies only the bags samples name)
            choices += list(VBE) + ["values-size"] + (["negative-length"] if kjt.lengths().numel() >= 2 else [])
        else:
            choices += [d for d in STRUCTURE if d != "negative-length" or len(parts) * batch >= 2]
        choices += [d for d in (WEIGHTED if weighted else UNWEIGHTED)
                    if spots or d not in ("nan-weight", "inf-weight")]
        damage = rng.sample(choices, 1 if rng.random() < 0.8 else 2)
        groups = [g for g in (WEIGHTED, VBE) if all(d in g for d in damage)]
        damage = damage[:1] if groups else damage  # two damages of the weights or of a VBE batch: one
    reference = None
    if not damage:
        reference = expanded_batch(kjt) if variable else _assemble(parts, batch, torch.int64, torch.int64,
                                                                   weights_dtype)
    if any(d in KEYS for d in damage):
        for d in damage:
            if d in KEYS:
                parts = _damage_parts(parts, d, rng, g)
        kjt = _assemble(parts, batch, ids_dtype, lengths_dtype, weights_dtype)
        spots = _looked_up(kjt, rows)
    for d in damage:  # ids first (the structure kept), then the rest
        if d in VALUES:
            kjt = _damage_ids(kjt, d, rng, rows)
    last = ("float-ids", "int16-ids", "2d-ids", "int-weights")  # dtype and shape damages after the size ones
    for d in sorted(damage, key=lambda d: d in last):
        if d in VBE:
            kjt = _damage_variable(kjt, d, rng)
        elif d not in VALUES and d not in KEYS:
            if d in ("nan-weight", "inf-weight") and not spots:
                continue  # a key damage took every looked-up id (there is another damage then)
            kjt = _damage_tensors(kjt, d, rng, spots)
    if reference is not None:  # what stock gets: int64 ids and lengths, float32 weights (the same values)
        weights = reference.weights_or_none()
        reference = KeyedJaggedTensor(keys=reference.keys(), values=reference.values().long(),
                                      lengths=reference.lengths().long(), stride=reference.stride(),
                                      weights=None if weights is None else weights.float())
    return FuzzBatch(kjt=kjt, reference=reference, damage=tuple(damage))
