"""Shared test fixtures: EBC configs, hybrid vs table-wise DMP pairs, skewed batches."""

from typing import Dict, List, Optional

import torch
import torchrec
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ShardingPlan

from torchrec_hybrid import frequency_hybrid

OPTIMIZERS = {
    "sgd": {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1},
    "adagrad": {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.1, "eps": 1e-8},
    "rowwise_adagrad": {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-8},
    "emainplace_rowwise_adagrad": {"optimizer": EmbOptimType.EMAINPLACE_ROWWISE_ADAGRAD, "learning_rate": 0.1,
                                   "eps": 1e-8},
    # weight decay changes a row even on a zero gradient: only looked-up hot rows may update
    "rowwise_adagrad_wd": {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-8,
                           "weight_decay": 0.05, "weight_decay_mode": WeightDecayMode.L2},
}


def tables(mean: bool = False, weighted: bool = False) -> List[torchrec.EmbeddingBagConfig]:
    """Four tables: different dims, one shared by two features, one MEAN (optional)."""
    pool = torchrec.PoolingType.MEAN if mean else torchrec.PoolingType.SUM
    return [
        torchrec.EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=41, feature_names=["f0", "f0b"]),
        torchrec.EmbeddingBagConfig(name="t1", embedding_dim=16, num_embeddings=30, feature_names=["f1"], pooling=pool),
        torchrec.EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=23, feature_names=["f2"]),
        torchrec.EmbeddingBagConfig(name="t3", embedding_dim=4, num_embeddings=17, feature_names=["f3"]),
    ]


DEFAULT_HOT = {"t0": [3, 7, 21, 35, 40], "t1": [0, 29, 5], "t2": [], "t3": [16]}


def hot_ids(spec: Optional[Dict[str, List[int]]] = None) -> Dict[str, torch.Tensor]:
    return {k: torch.tensor(v, dtype=torch.int64) for k, v in (spec or DEFAULT_HOT).items()}


def build(configs, world: int, kinds: Dict[str, str], sharder, weighted: bool = False):
    """DMP over an EBC with the given per-table plan kinds: 'tw', 'rw', 'cw', 'dp' (stock), 'hybrid'
    (even row-wise cold blocks), 'hybrid_tw' (every cold row on one rank; 'hybrid_tw_mh': planned as
    multi-hot, so its owner looks it up in a TBE call of its own), 'hybrid_uneven' (uneven
    row blocks), 'hybrid_cw' (two column slices, each on one rank: the ranks of 'cw'))."""
    from torchrec.distributed.sharding_plan import column_wise, data_parallel, row_wise

    ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"), is_weighted=weighted)
    gens = {}
    for i, c in enumerate(configs):
        kind = kinds.get(c.name, "tw")
        gens[c.name] = {
            "hybrid": lambda: frequency_hybrid(),
            "hybrid_tw": lambda: frequency_hybrid(cold="table_wise", rank=(i + 1) % world),
            "hybrid_tw_mh": lambda: frequency_hybrid(cold="table_wise", rank=(i + 1) % world, pooling_factor=4.0),
            "hybrid_uneven": lambda: frequency_hybrid(row_bounds=uneven_bounds(c.num_embeddings, world)),
            "hybrid_cw": lambda: frequency_hybrid(cold="column_wise", ranks=[i % world, (i + 1) % world]),
            "tw": lambda: table_wise(rank=i % world, compute_kernel="fused"),
            "rw": lambda: row_wise(compute_kernel="fused"),
            "cw": lambda: column_wise(ranks=[i % world, (i + 1) % world], compute_kernel="fused"),
            "dp": lambda: data_parallel(),
        }[kind]()
    plan = construct_module_sharding_plan(ebc, gens, sharder=sharder, local_size=world, world_size=world,
                                          device_type="cpu")
    model = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=ShardingPlan({"": plan}),
                                     sharders=[sharder])
    return model


def uneven_bounds(rows: int, world: int) -> List[int]:
    """Row blocks of growing size 1 : 2 : 3 ... (a layout no stock helper makes)."""
    if world == 1:
        return [0, rows]
    weights = torch.arange(1, world + 1, dtype=torch.float64)
    cum = (torch.cumsum(weights, 0) / weights.sum() * rows).round().to(torch.int64).tolist()
    return [0] + cum[:-1] + [rows]


def full_weight(value, size=None) -> torch.Tensor:
    """The full logical table behind a state_dict entry (collective for ShardedTensor).

    ``value`` may be None on ranks that hold no shard of it (give ``size`` then).
    """
    if value is not None and not isinstance(value, ShardedTensor):
        return value.detach().clone()
    out = torch.zeros(size if value is None else value.size())
    for s in value.local_shards() if value is not None else []:
        o, z = s.metadata.shard_offsets, s.metadata.shard_sizes
        out[tuple(slice(a, a + n) for a, n in zip(o, z))] = s.tensor.detach().view(z)
    torch.distributed.all_reduce(out)
    return out


def skewed_batch(configs, keys: List[str], batch: int, seed: int, hot: Dict[str, torch.Tensor],
                 weighted: bool = False, max_len: int = 4, hot_frac: float = 0.5,
                 mode: str = "mixed") -> torchrec.KeyedJaggedTensor:
    """Jagged batch, empty bags included. ``mode``: "mixed" (about ``hot_frac`` of ids from
    the hot set, the rest uniform), "hot_only" or "cold_only"."""
    g = torch.Generator().manual_seed(seed)
    rows = {f: c.num_embeddings for c in configs for f in c.feature_names}
    table = {f: c.name for c in configs for f in c.feature_names}
    lengths = torch.randint(0, max_len + 1, (len(keys) * batch,), generator=g)
    values = []
    for i, k in enumerate(keys):  # test data set-up: a loop over features
        n = int(lengths[i * batch:(i + 1) * batch].sum())
        h = hot.get(table[k], torch.empty(0, dtype=torch.int64))
        cold = torch.tensor(sorted(set(range(rows[k])) - set(h.tolist())), dtype=torch.int64)
        if mode == "hot_only":
            assert h.numel(), f"hot_only needs hot ids for {table[k]}"
            values.append(h[torch.randint(0, len(h), (n,), generator=g)])
        elif mode == "cold_only":
            values.append(cold[torch.randint(0, len(cold), (n,), generator=g)])
        else:
            src = h if h.numel() else cold
            pick_hot = torch.rand(n, generator=g) < hot_frac
            values.append(torch.where(pick_hot, src[torch.randint(0, len(src), (n,), generator=g)],
                                      torch.randint(0, rows[k], (n,), generator=g)))
    weights = torch.rand(int(lengths.sum()), generator=g) if weighted else None
    return torchrec.KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=lengths,
                                                        weights=weights)


def variable_batch(kjt: torchrec.KeyedJaggedTensor, seed: int) -> torchrec.KeyedJaggedTensor:
    """``kjt`` as a VBE batch (as TorchRec's variable-batch pipelines make): feature f keeps its
    first ``b_f`` bags (b_f drawn per feature, 1 .. stride) and every one of the stride samples
    names one of them in ``inverse_indices``."""
    g = torch.Generator().manual_seed(seed)
    keys, stride = kjt.keys(), kjt.stride()
    strides = torch.randint(1, stride + 1, (len(keys),), generator=g).tolist()
    lengths, values, weights, inverse = [], [], [], []
    for f, jt in enumerate(kjt.split([1] * len(keys))):  # test data set-up: a loop over features
        n = int(jt.lengths()[:strides[f]].sum())
        lengths.append(jt.lengths()[:strides[f]])
        values.append(jt.values()[:n])
        weights.append(jt.weights()[:n] if jt.weights_or_none() is not None else None)
        inverse.append(torch.randint(0, strides[f], (stride,), generator=g))
    return torchrec.KeyedJaggedTensor(
        keys=keys, values=torch.cat(values), lengths=torch.cat(lengths),
        weights=None if weights[0] is None else torch.cat(weights),
        stride_per_key_per_rank=[[b] for b in strides], inverse_indices=(keys, torch.stack(inverse)))


def expanded_batch(kjt: torchrec.KeyedJaggedTensor) -> torchrec.KeyedJaggedTensor:
    """A VBE batch as the same samples with one batch for every feature, copied bag by bag
    (the reference for what stock sharded EBCs cannot take as VBE on CPU)."""
    keys, (_, inverse) = kjt.keys(), kjt.inverse_indices()
    lengths, values, weights = [], [], []
    for f, jt in enumerate(kjt.split([1] * len(keys))):  # test reference: loops over features and samples
        offsets = jt.offsets().tolist()
        for b in inverse[f].tolist():
            lengths.append(offsets[b + 1] - offsets[b])
            values.append(jt.values()[offsets[b]:offsets[b + 1]])
            if jt.weights_or_none() is not None:
                weights.append(jt.weights()[offsets[b]:offsets[b + 1]])
    return torchrec.KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.tensor(lengths),
                                      weights=torch.cat(weights) if weights else None)


def full_optimizer_state(optimizer, world: int) -> Dict[str, torch.Tensor]:
    """``{param/state_name: full tensor}`` of a fused optimizer, identical on every rank.

    Stock table-wise keeps a table's state on its owner only, so the key set is gathered
    first and every rank joins every (collective) assembly in the same order.
    """
    state = optimizer.state_dict()["state"]
    mine = {f"{p}/{n}": (tuple(v.size()) if hasattr(v, "size") else None)
            for p, states in state.items() for n, v in states.items()}
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, mine)
    merged = {}
    for d in everyone:
        merged.update({k: v for k, v in d.items() if v is not None})
    out = {}
    for key in sorted(merged):
        p, n = key.split("/", 1)
        out[key] = full_weight(state.get(p, {}).get(n), size=merged[key])
    return out


def refused(fn):
    """``("raised", message)`` when ``fn()`` raises ValueError, else ``("built", "")``: plain data a
    rank can return across processes."""
    try:
        fn()
    except ValueError as e:
        return ("raised", str(e))
    return ("built", "")
