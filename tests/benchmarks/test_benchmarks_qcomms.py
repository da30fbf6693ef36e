"""`python -m benchmarks.qcomms`, tiny: FP16 / BF16 comms cut what each plan sends, measured."""

import json

from benchmarks.qcomms import main


def test_quantized_comms_cut_the_bytes_of_both_plans(tmp_path):
    out = tmp_path / "qcomms"
    results = main(["--world", "2", "--workloads", "onehot", "--rows-cap", "2000", "--warmup", "1", "--steps", "2",
                    "--out", str(out)])
    assert json.loads((tmp_path / "qcomms.json").read_text())["results"] == json.loads(json.dumps(results))
    (r,) = results
    for plan in ("hybrid", "stock"):
        fp32, q = r[f"{plan}_fp32"], r[f"{plan}_fp16_bf16"]
        assert q["busiest_bytes"] < fp32["busiest_bytes"], plan
        # the floats halve; ids, lengths and metadata do not
        assert 0.2 < r[f"{plan}_drop"]["busiest_bytes"] < 0.5, (plan, r[f"{plan}_drop"])
    assert (tmp_path / "qcomms.md").read_text().count("| onehot | 2 |") == 2
