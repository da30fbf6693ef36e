"""Criteo readers for the statistics CLI, built on `torchrec.datasets.criteo`.

Both yield KeyedJaggedTensors with keys ``cat_0 .. cat_25`` (one id per feature), ids
reduced modulo the table sizes, as TorchRec's DLRM example does:

- TSV (Kaggle ``train.txt`` or 1TB ``day_N``): `CriteoIterDataPipe` splits the lines;
  the categorical columns are the last 26 (hex strings; empty -> 0, as in
  `BinaryCriteoUtils.tsv_to_npys`).
- Preprocessed .npy (``*_dense.npy``, ``*_sparse.npy``, ``*_labels.npy`` per day, as
  written by `BinaryCriteoUtils.tsv_to_npys`): `InMemoryBinaryCriteoIterDataPipe`
  memory-maps them and applies the modulo (its ``hashes`` argument).
"""

from __future__ import annotations

import glob
import os
import re
from typing import Iterator, List, Sequence

import numpy as np
import torch
from torchrec.datasets.criteo import (
    CAT_FEATURE_COUNT,
    DEFAULT_CAT_NAMES,
    InMemoryBinaryCriteoIterDataPipe,
    criteo_terabyte,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def _cat_columns(row: List[str]) -> List[str]:
    return row[-CAT_FEATURE_COUNT:]


def _to_kjt(sparse: np.ndarray) -> KeyedJaggedTensor:
    """[batch, 26] int64 ids -> KJT, feature-major values, one id per feature."""
    b = sparse.shape[0]
    values = torch.from_numpy(np.ascontiguousarray(sparse.T).reshape(-1))
    return KeyedJaggedTensor(keys=DEFAULT_CAT_NAMES, values=values,
                             lengths=torch.ones(b * CAT_FEATURE_COUNT, dtype=torch.int32),
                             stride=b)


def criteo_tsv_batches(
    paths: Sequence[str], table_sizes: Sequence[int], batch_size: int
) -> Iterator[KeyedJaggedTensor]:
    """Batches of the TSV files, hex categorical values hashed mod the table sizes."""
    sizes = np.asarray(table_sizes, dtype=np.int64)
    rows: List[List[int]] = []
    for row in criteo_terabyte(list(paths), row_mapper=_cat_columns):
        if len(row) != CAT_FEATURE_COUNT:
            raise ValueError(f"TSV line with {len(row)} categorical columns, expected 26")
        rows.append([int(v, 16) if v else 0 for v in row])
        if len(rows) == batch_size:
            yield _to_kjt(np.asarray(rows, dtype=np.int64) % sizes)
            rows = []
    if rows:
        yield _to_kjt(np.asarray(rows, dtype=np.int64) % sizes)


def _day_key(path: str):
    m = re.search(r"(\d+)_sparse\.npy$", os.path.basename(path))
    return (int(m.group(1)) if m else -1, path)


def criteo_npy_dataset(
    directory: str, table_sizes: Sequence[int], batch_size: int
) -> InMemoryBinaryCriteoIterDataPipe:
    """`InMemoryBinaryCriteoIterDataPipe` over every ``*_sparse.npy`` day in `directory`."""
    sparse = sorted(glob.glob(os.path.join(directory, "*_sparse.npy")), key=_day_key)
    if not sparse:
        raise FileNotFoundError(f"no *_sparse.npy files in {directory}")
    stem = [p[: -len("_sparse.npy")] for p in sparse]
    return InMemoryBinaryCriteoIterDataPipe(
        stage="train",
        dense_paths=[s + "_dense.npy" for s in stem],
        sparse_paths=sparse,
        labels_paths=[s + "_labels.npy" for s in stem],
        batch_size=batch_size, rank=0, world_size=1,
        mmap_mode=True, hashes=list(table_sizes),
    )


def criteo_npy_batches(
    directory: str, table_sizes: Sequence[int], batch_size: int
) -> Iterator[KeyedJaggedTensor]:
    """Sparse features of each batch of the .npy days in `directory`."""
    for batch in criteo_npy_dataset(directory, table_sizes, batch_size):
        yield batch.sparse_features
