"""Statistics files and the stats CLI refuse what they cannot use, naming the path, flag or field (issue 20)."""

import os

import numpy as np
import pytest
import torch
from stats_testutils import random_kjt, table

from torchrec_hybrid.stats import FrequencyStats, StatsFileError, SyntheticCriteo, criteo_table_sizes
from torchrec_hybrid.stats.cli import main
from torchrec_hybrid.stats.persistence import state_checksum

# one exact table, one sketched (exact_max_rows below)
TABLES = [table("small", 50, ["f_a", "f_b"]), table("large", 20_000, ["f_d"])]
KW = dict(exact_max_rows=1000, sketch_capacity=64, sketch_eps=0.01)


def stream(seed, batches=2):
    rng = np.random.default_rng(seed)
    return [random_kjt(rng, {"f_a": 50, "f_b": 50, "f_d": 20_000}, batch=16) for _ in range(batches)]


def _saved(tmp_path):
    stats = FrequencyStats(TABLES, **KW)
    for k in stream(3, batches=2):
        stats.update(k)
    path = tmp_path / "stats.pt"
    stats.save(path)
    return stats, path


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


# -- files that are not statistics, or damaged ones --------------------------------------
def test_random_bytes_are_not_a_statistics_file(tmp_path):
    path = _write(tmp_path / "random.pt", os.urandom(4096))
    with pytest.raises(StatsFileError, match="not a frequency statistics file") as e:
        FrequencyStats.load(path)
    assert str(path) in str(e.value) and "Weights only" not in str(e.value)


@pytest.mark.parametrize("keep", [0.0, 0.1, 0.5, 0.99])
def test_truncated_file_is_refused(tmp_path, keep):
    _, path = _saved(tmp_path)
    data = path.read_bytes()
    cut = _write(tmp_path / "cut.pt", data[: int(len(data) * keep)])
    with pytest.raises(StatsFileError, match="truncated or corrupt") as e:
        FrequencyStats.load(cut)
    assert str(cut) in str(e.value)


def test_flipped_bit_in_the_counts_is_caught_by_the_checksum(tmp_path):
    stats, path = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    at = data.find(stats.counts("small").numpy().tobytes())  # torch.save stores tensors raw
    assert at > 0
    data[at + 8] ^= 0x10  # torch.load itself accepts this file
    bad = _write(tmp_path / "flipped.pt", bytes(data))
    with pytest.raises(StatsFileError, match="corrupt: its content checksum") as e:
        FrequencyStats.load(bad)
    assert str(bad) in str(e.value)


def test_missing_file_and_directory_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        FrequencyStats.load(tmp_path / "nope.pt")
    with pytest.raises(StatsFileError, match="is a directory"):
        FrequencyStats.load(tmp_path)


@pytest.mark.parametrize("obj, says", [
    ({"weight": torch.zeros(3)}, r"keys \['weight'\], without a 'format_version'"),
    ([1, 2, 3], "holds a list"),
    (torch.zeros(4), "holds a Tensor"),
])
def test_other_torch_files_are_not_statistics(tmp_path, obj, says):
    torch.save(obj, tmp_path / "other.pt")
    with pytest.raises(StatsFileError, match=says):
        FrequencyStats.load(tmp_path / "other.pt")


def _break(state, how):
    if how == "missing key":
        del state["lookups"]
    elif how == "counts length":
        state["counts"]["small"] = state["counts"]["small"][:10]
    elif how == "counts dtype":
        state["counts"]["small"] = state["counts"]["small"].float()
    elif how == "negative count":
        state["counts"]["small"][0] = -1
    elif how == "counts vs lookups":
        state["lookups"]["small"] += 1
    elif how == "sketch seed":
        state["sketches"]["large"]["seed"] += 1
    elif how == "sketch table":
        state["sketches"]["large"]["table"] = state["sketches"]["large"]["table"][:7]
    elif how == "exact table missing":
        del state["counts"]["small"]
    elif how == "table rows":
        state["tables"][0]["num_embeddings"] = "50"
    elif how == "eps":
        state["sketch_eps"] = 2.0
    return state


@pytest.mark.parametrize("how, says", [
    ("missing key", r"missing key\(s\) \['lookups'\]"),
    ("counts length", "counts of table 'small' has 10 entries, expected 50"),
    ("counts dtype", "counts of table 'small' is a torch.float32 tensor"),
    ("negative count", "counts of table 'small' holds a negative count -1"),
    ("counts vs lookups", "counts of table 'small' add up to"),
    ("sketch seed", "sketch of table 'large': seed is"),
    ("sketch table", "sketch of table 'large': table has 7 entries"),
    ("exact table missing", r"exact counts are for tables \[\]"),
    ("table rows", "table 'small': num_embeddings is '50'"),
    ("eps", "sketch_eps is 2.0"),
])
def test_wrong_schema_names_the_field(tmp_path, how, says):
    stats, _ = _saved(tmp_path)
    state = _break(stats.state_dict(), how)
    state["checksum"] = state_checksum(state)  # well-formed file, wrong content
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(StatsFileError, match=says) as e:
        FrequencyStats.load(tmp_path / "bad.pt")
    assert str(tmp_path / "bad.pt") in str(e.value)
    with pytest.raises(ValueError, match=says):  # from_state checks a state in memory too
        FrequencyStats.from_state(_break(stats.state_dict(), how))


def test_files_without_a_checksum_still_load(tmp_path):
    stats, _ = _saved(tmp_path)
    torch.save(stats.state_dict(), tmp_path / "old.pt")  # what save() wrote before checksums
    loaded = FrequencyStats.load(tmp_path / "old.pt")
    assert torch.equal(loaded.counts("small"), stats.counts("small"))


def test_save_replaces_the_file_whole(tmp_path):
    stats, path = _saved(tmp_path)
    stats.update(stream(9, batches=1)[0])
    stats.save(path)
    assert os.listdir(tmp_path) == ["stats.pt"]  # no temporary left behind
    assert FrequencyStats.load(path).num_batches == stats.num_batches


# -- the stats CLI refuses bad flags before counting ---------------------------------------
SMALL = ["--synthetic", "--max-rows", "50", "--num-batches", "1", "--batch-size", "8"]


@pytest.mark.parametrize("flag, value", [
    ("--scale", "-1"), ("--scale", "0"), ("--scale", "nan"), ("--max-rows", "0"), ("--batch-size", "0"),
    ("--alpha", "-1"), ("--num-batches", "0"), ("--max-batches", "0"), ("--embedding-dim", "0"),
    ("--sketch-capacity", "0"), ("--sketch-eps", "1"), ("--exact-max-rows", "-5"), ("--hot-sizes", "10,0"),
    ("--hot-sizes", "10,x"), ("--batch-size", "two"),
])
def test_cli_refuses_bad_values(tmp_path, capsys, flag, value):
    args = SMALL + ["--out", str(tmp_path / "s.pt"), flag, value]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and repr(value) in err, err
    assert not (tmp_path / "s.pt").exists()


def test_cli_refuses_missing_inputs_and_output_dirs(tmp_path, capsys):
    for args, says in [
        (["--criteo-tsv", str(tmp_path / "no.tsv")], "argument --criteo-tsv: "),
        (["--criteo-npy", str(tmp_path / "nodir")], "argument --criteo-npy: "),
        (SMALL + ["--out", str(tmp_path / "no" / "s.pt")], "argument --out: "),
        (SMALL + ["--out", str(tmp_path)], "is a directory"),
        (SMALL + ["--out", str(tmp_path / "s.pt"), "--plot", str(tmp_path / "no" / "c.png")], "argument --plot: "),
    ]:
        with pytest.raises(SystemExit):
            main(args)
        assert says in capsys.readouterr().err


def test_library_refuses_the_same_values():
    with pytest.raises(ValueError, match="max_rows must be an int >= 1.*got 0"):
        criteo_table_sizes(max_rows=0)
    with pytest.raises(ValueError, match="scale must be .* > 0, got -1"):
        criteo_table_sizes(scale=-1)
    for kw, says in [({"batch_size": 0}, "batch_size"), ({"num_batches": 0}, "num_batches"),
                     ({"alpha": -1.0}, "alpha"), ({"table_sizes": [5, 0]}, r"\(1, 0\)")]:
        args = dict(table_sizes=[5, 7], batch_size=4, num_batches=1, alpha=1.1) | kw
        with pytest.raises(ValueError, match=says):
            SyntheticCriteo(**args)
    assert criteo_table_sizes(max_rows=None)[0] == 1460  # None still means no cap


@pytest.mark.parametrize("field, value, says", [
    ("format_version", True, "unsupported statistics format_version True"),
    ("count_dtype", ["float64"], r"count_dtype is \['float64'\]"),
])
def test_wrongly_typed_header_fields_name_the_file(tmp_path, field, value, says):
    stats, _ = _saved(tmp_path)
    state = stats.state_dict()
    state[field] = value
    state.pop("checksum", None)  # no checksum (files from before checksums load): the schema check reads the header
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(StatsFileError, match=says) as e:
        FrequencyStats.load(tmp_path / "bad.pt")
    assert str(tmp_path / "bad.pt") in str(e.value)


def test_cli_refuses_flags_it_would_ignore_or_fail_on_after_counting(tmp_path, capsys):
    """--alpha 0 with real data (0.0 == False was taken for "not given"), a plot it cannot write as
    PNG, an output directory nothing can be created in, a seed beyond 64 bits: refused up front."""
    tsv = tmp_path / "day.tsv"
    tsv.write_text("\t".join(["0"] * 14 + ["a"] * 26) + "\n")
    cases = [
        (["--criteo-tsv", str(tsv), "--alpha", "0", "--out", str(tmp_path / "s.pt")], "argument --alpha"),
        (SMALL + ["--out", str(tmp_path / "s.pt"), "--plot", str(tmp_path / "c.xyz")], "give a .png file name"),
        (SMALL + ["--out", str(tmp_path / "s.pt"), "--seed", str(2 ** 64)], "argument --seed: must fit 64 bits"),
    ]
    if os.path.isdir("/proc"):  # a directory where no file can be created, even by root
        cases.append((SMALL + ["--out", "/proc/stats.pt"], "argument --out: cannot write into /proc"))
    for args, says in cases:
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2
        assert says in capsys.readouterr().err, args
    assert not (tmp_path / "s.pt").exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".stats-probe-")]


def test_synthetic_stream_refuses_arguments_that_would_make_malformed_batches():
    for kw, says in [({"multi_hot": [2]}, "multi_hot needs an int >= 0"),
                     ({"multi_hot": [1, -1, 1]}, "multi_hot needs an int >= 0"),
                     ({"table_sizes": [5] * 27}, "27 tables need 27 feature names")]:
        args = dict(table_sizes=[5, 7, 9], batch_size=4, num_batches=1) | kw
        with pytest.raises(ValueError, match=says):
            SyntheticCriteo(**args)
