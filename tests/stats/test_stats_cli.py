"""The statistics CLI, the synthetic generator and the Criteo TSV / .npy readers."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torchrec.datasets.criteo import BinaryCriteoUtils

from torchrec_hybrid.stats import FrequencyStats, SyntheticCriteo, criteo_table_sizes
from torchrec_hybrid.stats.cli import build_parser, main
from torchrec_hybrid.stats.sources import criteo_npy_batches, criteo_tsv_batches
from torchrec_hybrid.stats.synthetic import CRITEO_KAGGLE_CARDINALITIES, DLRMV2_MULTI_HOT_SIZES

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# -- synthetic -------------------------------------------------------------------------
def test_synthetic_is_seeded_in_range_and_skewed():
    sizes = [50, 1000, 3]
    data = SyntheticCriteo(sizes, batch_size=400, num_batches=5, alpha=1.2, multi_hot=[1, 3, 2], seed=4)
    first, second = list(data), list(data)
    assert len(first) == 5
    for a, b in zip(first, second):
        assert torch.equal(a.values(), b.values())
    other = next(iter(SyntheticCriteo(sizes, 400, 1, 1.2, [1, 3, 2], seed=5)))
    assert not torch.equal(other.values(), first[0].values())
    for kjt in first:
        for (name, jt), n, h in zip(kjt.to_dict().items(), sizes, [1, 3, 2]):
            assert (jt.lengths() == h).all() and jt.lengths().numel() == 400
            assert 0 <= int(jt.values().min()) and int(jt.values().max()) < n
    ids = torch.cat([k.to_dict()["cat_1"].values() for k in first])
    freq = torch.bincount(ids, minlength=1000).double() / ids.numel()
    p = torch.arange(1, 1001, dtype=torch.float64).pow(-1.2)
    p /= p.sum()
    # Zipf: sorted empirical frequencies follow the rank law
    np.testing.assert_allclose(torch.sort(freq, descending=True).values[:5].numpy(), p[:5].numpy(), rtol=0.15)


def test_table_sizes_scale_and_cap():
    sizes = criteo_table_sizes(scale=0.01, max_rows=5000)
    assert sizes == [min(max(1, int(np.ceil(c * 0.01))), 5000) for c in CRITEO_KAGGLE_CARDINALITIES]


# -- CLI on synthetic data ---------------------------------------------------------------
def test_cli_synthetic_writes_stats_and_plot(tmp_path, capsys):
    out, png = tmp_path / "stats.pt", tmp_path / "coverage.png"
    rc = main(["--synthetic", "--max-rows", "300", "--num-batches", "3", "--batch-size", "32",
               "--multi-hot", "--exact-max-rows", "200", "--sketch-capacity", "50",
               "--sketch-eps", "0.01", "--out", str(out), "--plot", str(png), "--hot-sizes", "10,100"])
    assert rc == 0
    stats = FrequencyStats.load(out)
    sizes = criteo_table_sizes(max_rows=300)
    for i, name in enumerate(stats.table_names):
        assert stats.config(name).num_embeddings == sizes[i]
        assert stats.lookups(name) == 3 * 32 * DLRMV2_MULTI_HOT_SIZES[i]
        assert stats.is_exact(name) == (sizes[i] <= 200)
    assert png.read_bytes()[:8] == PNG_MAGIC
    printed = capsys.readouterr().out
    assert "cov@100" in printed and all(n in printed for n in stats.table_names)


def test_module_entry_point(tmp_path):
    out = tmp_path / "s.pt"
    proc = subprocess.run([sys.executable, "-m", "torchrec_hybrid.stats", "--synthetic",
                           "--max-rows", "100", "--num-batches", "2", "--batch-size", "16",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert FrequencyStats.load(out).num_samples == 32
    assert "t_cat_25" in proc.stdout


# -- Criteo readers ----------------------------------------------------------------------
def write_tsv(path, rng, n):
    """n Criteo lines: label, 13 ints, 26 hex categoricals (some missing); returns the cats."""
    cats = []
    with open(path, "w") as f:
        for _ in range(n):
            ints = [str(v) if v >= 0 else "" for v in rng.integers(-1, 50, size=13)]
            row = [f"{v:08x}" if rng.random() > 0.1 else "" for v in rng.integers(0, 2**32, size=26)]
            cats.append([int(v, 16) if v else 0 for v in row])
            f.write("\t".join([str(rng.integers(0, 2))] + ints + row) + "\n")
    return np.array(cats, dtype=np.int64)


SIZES = [97, 1000, 13] * 8 + [5, 7]


def per_feature(kjts):
    out = {}
    for kjt in kjts:
        for k, jt in kjt.to_dict().items():
            assert (jt.lengths() == 1).all()
            out.setdefault(k, []).append(jt.values().long().numpy())
    return {k: np.concatenate(v) for k, v in out.items()}


def test_tsv_reader(tmp_path):
    cats = write_tsv(tmp_path / "day_0", np.random.default_rng(0), 11)
    got = per_feature(criteo_tsv_batches([str(tmp_path / "day_0")], SIZES, batch_size=4))
    expected = cats % np.array(SIZES)
    for i in range(26):
        np.testing.assert_array_equal(got[f"cat_{i}"], expected[:, i])


def make_npy_days(tmp_path, rng):
    """day_0 via torchrec's own tsv_to_npys, day_1 written directly (int32 sparse)."""
    cats0 = write_tsv(tmp_path / "day_0.tsv", rng, 9)
    d = tmp_path / "npy"
    d.mkdir()
    BinaryCriteoUtils.tsv_to_npys(str(tmp_path / "day_0.tsv"), str(d / "day_0_dense.npy"),
                                  str(d / "day_0_sparse.npy"), str(d / "day_0_labels.npy"))
    cats1 = rng.integers(0, 2**31 - 1, size=(6, 26)).astype(np.int32)
    np.save(d / "day_1_dense.npy", rng.random((6, 13)).astype(np.float32))
    np.save(d / "day_1_sparse.npy", cats1)
    np.save(d / "day_1_labels.npy", rng.integers(0, 2, size=(6, 1)).astype(np.int32))
    return d, np.concatenate([cats0, cats1.astype(np.int64)])


def test_npy_reader(tmp_path):
    d, cats = make_npy_days(tmp_path, np.random.default_rng(1))
    got = per_feature(criteo_npy_batches(str(d), SIZES, batch_size=4))
    expected = cats % np.array(SIZES)
    for i in range(26):
        np.testing.assert_array_equal(got[f"cat_{i}"], expected[:, i])


@pytest.mark.parametrize("fmt", ["tsv", "npy"])
def test_cli_on_criteo_files(tmp_path, fmt):
    rng = np.random.default_rng(2)
    if fmt == "tsv":
        cats = write_tsv(tmp_path / "train.txt", rng, 10)
        src = ["--criteo-tsv", str(tmp_path / "train.txt")]
    else:
        d, cats = make_npy_days(tmp_path, rng)
        src = ["--criteo-npy", str(d)]
    out = tmp_path / "stats.pt"
    assert main(src + ["--max-rows", "500", "--batch-size", "4", "--out", str(out)]) == 0
    stats = FrequencyStats.load(out)
    sizes = criteo_table_sizes(max_rows=500)
    for i, name in enumerate(stats.table_names):
        expected = np.bincount(cats[:, i] % sizes[i], minlength=sizes[i])
        np.testing.assert_array_equal(stats.counts(name).numpy(), expected)
    assert stats.num_samples == len(cats)


@pytest.mark.parametrize("flags", [["--alpha", "0.5"], ["--multi-hot"], ["--num-batches", "10"]])
def test_synthetic_only_flags_refused_with_real_data(tmp_path, capsys, flags):
    write_tsv(tmp_path / "train.txt", np.random.default_rng(0), 4)
    with pytest.raises(SystemExit):
        main(["--criteo-tsv", str(tmp_path / "train.txt"), "--out", str(tmp_path / "s.pt")] + flags)
    assert f"argument {flags[0]}: only for --synthetic data" in capsys.readouterr().err
    assert not (tmp_path / "s.pt").exists()


@pytest.mark.parametrize("argv0, prog", [
    ("/venv/bin/torchrec-hybrid-stats", "torchrec-hybrid-stats"),
    ("/repo/torchrec_hybrid/stats/__main__.py", "python -m torchrec_hybrid.stats")])
def test_usage_names_the_command_it_was_run_as(monkeypatch, argv0, prog):
    monkeypatch.setattr(sys, "argv", [argv0, "--help"])
    assert build_parser().prog == prog
