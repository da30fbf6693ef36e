"""Data, config and metric pieces of the DLRM example (single process)."""

import numpy as np
import pytest
import torch

from examples.dlrm.config import ConfigError, load_config
from examples.dlrm.data import (
    CriteoNpyBatches,
    CriteoTSVBatches,
    SyntheticCriteoBatches,
    table_sizes_from_config,
)
from torchmetrics.functional.classification import binary_auroc

from torchrec_hybrid.planner.config import HOT_SET_KEYS
from torchrec_hybrid.stats.synthetic import DLRMV2_MULTI_HOT_SIZES, criteo_table_sizes

SIZES = criteo_table_sizes(scale=0.001)


def _rows(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    dense = rng.integers(-1, 50, (n, 13))
    cats = rng.integers(0, 2**31, (n, 26))
    return labels, dense, cats


def _write_tsv(path, labels, dense, cats, blank=()):
    with open(path, "w") as f:
        for i in range(len(labels)):
            d = [str(v) for v in dense[i]]
            c = [format(v, "x") for v in cats[i]]
            for j in blank:  # empty fields, as in real Criteo
                d[j % 13], c[j % 26] = "", ""
            f.write("\t".join([str(labels[i])] + d + c) + "\n")


def test_synthetic_is_random_access_and_rank_distinct():
    src = SyntheticCriteoBatches(SIZES, 64, rank=0, world_size=2, effect_features=["cat_2"])
    it = src.batches(3)
    b3 = next(it)
    again = src.batch(3)
    assert torch.equal(b3.sparse_features.values(), again.sparse_features.values())
    assert torch.equal(b3.labels, again.labels) and torch.equal(b3.dense_features, again.dense_features)
    other = SyntheticCriteoBatches(SIZES, 64, rank=1, world_size=2, effect_features=["cat_2"]).batch(3)
    assert not torch.equal(other.sparse_features.values(), b3.sparse_features.values())
    assert b3.dense_features.shape == (64, 13) and b3.labels.shape == (64,)
    assert b3.sparse_features.keys() == [f"cat_{i}" for i in range(26)]
    for k, n in zip(b3.sparse_features.keys(), SIZES):
        v = b3.sparse_features[k].values()
        assert int(v.min()) >= 0 and int(v.max()) < n


def test_synthetic_multi_hot_and_labels():
    src = SyntheticCriteoBatches(SIZES, 256, multi_hot=True, effect_features=["cat_2", "cat_3"], base_ctr=0.25)
    b = src.batch(0)
    assert b.sparse_features.length_per_key() == [256 * h for h in DLRMV2_MULTI_HOT_SIZES]
    ctr = float(torch.cat([src.batch(i).labels for i in range(8)]).mean())
    assert 0.15 < ctr < 0.35
    assert set(b.labels.unique().tolist()) <= {0.0, 1.0}


def test_synthetic_labels_follow_hidden_model():
    # The hidden logit itself separates the labels well: a learnable signal exists.
    src = SyntheticCriteoBatches(SIZES, 4096, effect_features=["cat_2", "cat_3", "cat_11"])
    b = src.batch(0)
    z = (torch.log(torch.expm1(b.dense_features.double()) + 0.5) - src.dense_mu) / src.dense_sigma
    assert float(binary_auroc(z @ src.dense_w, b.labels.long())) > 0.6


def test_criteo_tsv_batches(tmp_path):
    labels, dense, cats = _rows(10)
    path = tmp_path / "day_0"
    _write_tsv(path, labels, dense, cats, blank=(3,))
    sizes = np.asarray(SIZES)
    parts = [list(CriteoTSVBatches([str(path)], SIZES, batch_size=2, rank=r, world_size=2).batches())
             for r in range(2)]
    assert [len(p) for p in parts] == [2, 2]  # 10 lines = 2 full global batches of 4, rest dropped
    got_cats = torch.cat([torch.stack([b.sparse_features[k].values() for k in b.sparse_features.keys()], 1)
                          for i in range(2) for b in (parts[0][i], parts[1][i])])
    exp = cats[:8].copy()
    exp[:, 3] = 0
    np.testing.assert_array_equal(got_cats.numpy(), exp % sizes)
    got_dense = torch.cat([b.dense_features for i in range(2) for b in (parts[0][i], parts[1][i])])
    d = dense[:8].copy()
    d[:, 3] = 0
    np.testing.assert_allclose(got_dense.numpy(), np.log1p(np.maximum(d, 0)), rtol=1e-6)
    got_labels = torch.cat([b.labels for i in range(2) for b in (parts[0][i], parts[1][i])])
    np.testing.assert_array_equal(got_labels.numpy(), labels[:8])
    # resuming at global batch 1 gives the same batch as the second one of a full pass
    resumed = next(CriteoTSVBatches([str(path)], SIZES, 2, rank=1, world_size=2).batches(start=1))
    assert torch.equal(resumed.sparse_features.values(), parts[1][1].sparse_features.values())


def test_criteo_npy_batches(tmp_path):
    labels, dense, cats = _rows(12, seed=1)
    for day, sl in ((0, slice(0, 8)), (1, slice(8, 12))):
        np.save(tmp_path / f"day_{day}_dense.npy", np.log(np.maximum(dense[sl], 0) + 1).astype(np.float32))
        np.save(tmp_path / f"day_{day}_sparse.npy", cats[sl])
        np.save(tmp_path / f"day_{day}_labels.npy", labels[sl].reshape(-1, 1).astype(np.int32))
    src = CriteoNpyBatches(str(tmp_path), SIZES, batch_size=3, rank=0, world_size=1)
    batches = list(src.batches())
    assert src.num_batches == len(batches) == 4
    ids = torch.cat([torch.stack([b.sparse_features[k].values() for k in b.sparse_features.keys()], 1)
                     for b in batches])
    np.testing.assert_array_equal(ids.numpy(), cats % np.asarray(SIZES))
    assert torch.cat([b.labels for b in batches]).tolist() == labels.astype(float).tolist()
    assert batches[0].dense_features.dtype == torch.float32
    later = next(src.batches(start=2))
    assert torch.equal(later.sparse_features.values(), batches[2].sparse_features.values())


def test_config_overrides(tmp_path):
    cfg = load_config("configs/dlrm_tiny.yaml", ["train.steps=50", "model.dense_arch=[32, 16]"],
                      {"sharding.planner": "stock"})
    assert cfg.train.steps == 50 and cfg.model.dense_arch == [32, 16] and cfg.sharding.planner == "stock"
    assert table_sizes_from_config(cfg.data) == SIZES


def test_config_files_validate_and_share_the_planner_keys():
    import yaml

    for path in ("configs/dlrm.yaml", "configs/dlrm_tiny.yaml"):
        cfg = load_config(path)
        assert set(cfg.sharding.hot_set) == set(HOT_SET_KEYS)  # the planner.yaml names
    with open("configs/planner.yaml") as f:
        assert set(yaml.safe_load(f)["hot_set"]) == set(HOT_SET_KEYS)


@pytest.mark.parametrize("text, words", [
    ("data: {batch_sz: 4}\n", ["data.batch_sz", "batch_size"]),
    ("bogus: 1\n", ["'bogus'", "checkpoint"]),
    ("train: {progress_bar: 3}\n", ["train.progress_bar", "true/false"]),
    ("metrics: {window: 0}\n", ["metrics.window", "> 0"]),
    ("data: {cardinalities: huge}\n", ["data.cardinalities", "'kaggle'"]),
    ("sharding: {manual_hot_set: {coverage: 0.5, rows_per_table: 3}}\n", ["sharding.manual_hot_set", "exactly one"]),
    ("sharding: {hot_set: {min_saving: 2}}\n", ["sharding.hot_set.min_saving"]),
    ("- 1\n", ["mapping"]),
    ("seed: -1\n", ["seed: expected an integer in [0, 2**63), got -1"]),
    ("data: {multi_hot: [1, 2]}\n", ["data.multi_hot: expected 26 integers >= 1", "[1, 2]"]),
    ("data: {cardinalities: [0, 5]}\n", ["data.cardinalities: expected 26 integers >= 1"]),
    ("data: {source: criteo_tsv, paths: [x.tsv], alpha: 0.5}\n",
     ["data.alpha: only for data.source 'synthetic'", "'criteo_tsv'"]),
    ("data: {source: criteo_npy, dir: d, multi_hot: true}\n", ["data.multi_hot: only for data.source 'synthetic'"]),
    ("optim: {dense: {optimizer: sgd, eps: 0.1}}\n", ["optim.dense.eps: SGD has no eps, got 0.1"]),
    ("metrics: {validation_every: 5, validation_batches: 0}\n", ["metrics.validation_every: 5 needs"]),
    ("checkpoint: {every: 10}\n", ["checkpoint.every: set without checkpoint.dir"]),
    # values the run cannot use or would ignore (an independent review of the example)
    ("dist: {timeout_s: .inf}\n", ["dist.timeout_s: expected a finite number > 0"]),
    ("data: {alpha: .inf}\n", ["data.alpha: expected a finite number >= 0"]),
    ("data: {label: {effect_features: [cat_99]}}\n", ["data.label.effect_features", "cat_99"]),
    ("model: {embedding_dim: 6, dense_arch: [6]}\n", ["model.embedding_dim", "multiple of 4", "6"]),
    ("optim: {embedding: {optimizer: sgd, eps: 0.1}}\n", ["optim.embedding.eps: SGD has no eps"]),
    ("data: {validation_dir: d}\n", ["data.validation_dir: only read by data.source 'criteo_npy'"]),
    ("data: {paths: [x.tsv]}\n", ["data.paths: only read by data.source 'criteo_tsv'"]),
    ("sharding: {planner: stock, stats: {save: s.pt}}\n", ["sharding.stats.save", "'stock' uses no statistics"]),
    ("sharding: {planner: stock, tables: {t_cat_99: {sharding_types: [table_wise]}}}\n",
     ["sharding.tables: no table named ['t_cat_99']"]),
])
def test_bad_config_file_names_the_key(tmp_path, text, words):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ValueError) as e:
        load_config(str(p))
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    if "hot_set" not in text:  # the planner's own sections raise PlannerConfigError (a ValueError)
        assert isinstance(e.value, ConfigError)


def test_resume_with_another_global_batch_continues_at_the_same_sample():
    """A checkpoint records its global batch: a run with another world size or batch size resumes at the sample
    where it stopped (real data would otherwise skip or repeat lines), or refuses when no batch starts there."""
    from examples.dlrm.checkpoint import CheckpointError, _data_position

    saved = {"step": 10, "data_position": 12, "global_batch": 4096}  # 12 x 4096 samples read
    assert _data_position("ck", saved, 4096) == 12
    assert _data_position("ck", saved, 8192) == 6 and _data_position("ck", saved, 2048) == 24
    assert _data_position("ck", {"step": 10, "data_position": 12}, 8192) == 12  # written before it was recorded
    assert _data_position("ck", saved, 5000, "synthetic") == 12  # batch i is generated for the run's own world
    with pytest.raises(CheckpointError) as e:  # a CheckpointError: one line per rank, no traceback (train.main)
        _data_position("ck", saved, 5000)
    assert "checkpoint ck read 49152 samples in global batches of 4096" in str(e.value) and "5000" in str(e.value)
    with pytest.raises(CheckpointError, match="resume with the checkpoint's world size and data.batch_size"):
        _data_position("ck", saved, 8192, "criteo_npy")
    assert _data_position("ck", saved, 4096, "criteo_npy") == 12


@pytest.mark.parametrize("damage, words", [
    (lambda cols: cols[:37], "37 columns, not 40"),
    (lambda cols: cols[:5] + ["zz6"] + cols[6:], "column 6 is 'zz6', not an integer"),
    (lambda cols: cols[:20] + ["xyz"] + cols[21:], "column 21 is 'xyz', not a hexadecimal id"),
    (lambda cols: ["7"] + cols[1:], "label '7', not 0 or 1"),
])
def test_a_bad_tsv_line_is_named(tmp_path, damage, words):
    labels, dense, cats = _rows(8)
    path = tmp_path / "day_0"
    _write_tsv(path, labels, dense, cats)
    lines = path.read_text().splitlines()
    lines[6] = "\t".join(damage(lines[6].split("\t")))  # line 7: global batch 1 (lines 5-8), rank 1's second line
    path.write_text("\n".join(lines) + "\n")
    src = CriteoTSVBatches([str(path)], SIZES, batch_size=2, rank=1, world_size=2)
    with pytest.raises(ValueError) as e:
        list(src.batches())
    assert str(e.value) == f"data.paths {[str(path)]}: Criteo TSV line 7: {words}"


@pytest.mark.parametrize("path", ["configs/dlrm.yaml", "configs/dlrm_tiny.yaml"])
@pytest.mark.parametrize("source", [["data.source=criteo_tsv", "data.paths=[x.tsv]"],
                                    ["data.source=criteo_npy", "data.dir=d"]])
def test_shipped_configs_load_with_real_data(path, source):
    """The README's way to real Criteo data: the shipped config with its source switched (its synthetic label
    settings do not stand in the way)."""
    cfg = load_config(path, source)
    assert cfg.data.source == source[0].split("=")[1]


def test_a_resumed_metrics_log_keeps_only_the_steps_before_the_resume(tmp_path):
    """Resuming from a checkpoint older than the last logged step (a crash) trains those steps again: the
    log drops its records after the checkpoint's step instead of holding them twice (and a line the
    crash cut short)."""
    import json

    from examples.dlrm.metrics import JsonlLog

    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in range(1, 7)) + '{"step": 7, "lo')
    log = JsonlLog(str(path), resume_from=4)
    for s in (5, 6):
        log.write({"step": s, "loss": 0.25})
    log.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6] and records[4]["loss"] == 0.25
    JsonlLog(str(path)).close()  # a fresh run starts a fresh file
    assert path.read_text() == ""
