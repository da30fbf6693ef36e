"""Shared helpers for the stats tests: tables, random KJT streams, a Zipf stream."""

from typing import Dict, List, Sequence

import numpy as np
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def table(name: str, rows: int, features: Sequence[str], dim: int = 8) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(num_embeddings=rows, embedding_dim=dim, name=name,
                              feature_names=list(features))


def random_kjt(rng: np.random.Generator, rows: Dict[str, int], batch: int,
               max_len: int = 4, weighted: bool = False) -> KeyedJaggedTensor:
    """Random jagged batch; rows maps feature -> id range."""
    keys = list(rows)
    lengths = rng.integers(0, max_len + 1, size=len(keys) * batch)
    per_key = lengths.reshape(len(keys), batch).sum(1)
    values = np.concatenate([rng.integers(0, rows[k], size=n) for k, n in zip(keys, per_key)])
    kw = dict(keys=keys, values=torch.from_numpy(values), lengths=torch.from_numpy(lengths).int(),
              stride=batch)
    if weighted:
        kw["weights"] = torch.from_numpy(rng.random(values.size).astype(np.float32) * 5)
    return KeyedJaggedTensor(**kw)


def feature_values(kjt: KeyedJaggedTensor) -> Dict[str, np.ndarray]:
    return {k: jt.values().numpy() for k, jt in kjt.to_dict().items()}


def zipf_stream(num_ids: int, length: int, alpha: float, seed: int) -> torch.Tensor:
    """`length` ids over `num_ids` rows, P(rank r) ~ r**-alpha, ranks scattered randomly."""
    g = torch.Generator().manual_seed(seed)
    cdf = torch.cumsum(torch.arange(1, num_ids + 1, dtype=torch.float64).pow_(-alpha), 0)
    cdf /= cdf[-1].clone()
    ranks = torch.searchsorted(cdf, torch.rand(length, dtype=torch.float64, generator=g))
    return torch.randperm(num_ids, generator=g)[ranks.clamp_(max=num_ids - 1)]


def one_feature_kjts(ids: torch.Tensor, feature: str, batch: int) -> List[KeyedJaggedTensor]:
    """Split a flat id stream into one-hot KJTs of one feature."""
    out = []
    for s in range(0, ids.numel(), batch):
        v = ids[s : s + batch]
        out.append(KeyedJaggedTensor(keys=[feature], values=v,
                                     lengths=torch.ones(v.numel(), dtype=torch.int32)))
    return out
