"""Issue 16: frequency_hybrid honours TorchRec's quantized comms (``qcomm_codecs_registry``).

The ``POOLED_EMBEDDINGS_ALL_TO_ALL`` codecs encode the hybrid's output all-to-all (cold partial
sums and hot-row sync) like TorchRec's pooled all-to-all: forward precision on the forward,
backward precision on the gradient's. On 2 gloo ranks (one spawn, module-scoped):

- a hybrid-sharded EBC (every cold layout, a MEAN table) trains like the same EBC sharded
  table_wise with the same registry, to fp16 / bf16 tolerance; without codecs exactly;
- measured bytes (``/proc/self/io``): the output all-to-all's forward and backward bytes per
  rank halve with FP16 forward + BF16 backward, the input dist's do not change; no extra
  collective or host sync per step;
- codecs it cannot honour raise at shard time, naming the tables, the comm op and the setting;
- the planner prices the codec: the output-dist and hot-sync bytes halve in its estimate.

The registries are built for TorchRec's default device (cuda): for a CPU device TorchRec would
replace BF16 by FP16 ("not supported on GLOO"), but gloo in torch 2.13 carries bfloat16.
"""

import math

import pytest
import torch
import torchrec
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

from tests.models import OPTIMIZERS, build, full_weight, hot_ids, refused, skewed_batch, tables
from tests.multiprocess import run_ranks
from torchrec_hybrid import FREQUENCY_HYBRID, HybridEmbeddingBagCollectionSharder
from torchrec_hybrid.comm_bytes import count_sent_bytes

WORLD = 2
# every cold layout, and a MEAN table (divided after the partials are decoded and added)
KINDS = {"t0": "hybrid", "t1": "hybrid_tw", "t2": "hybrid_uneven", "t3": "hybrid"}
BYTES_ROWS, BYTES_DIM, BYTES_BATCH, BYTES_TABLES = 2000, 32, 512, 4


def _registry(fwd: CommType, bwd: CommType, **kw):
    return get_qcomm_codecs_registry(QCommsConfig(forward_precision=fwd, backward_precision=bwd, **kw),
                                     device=torch.device("cuda"))


FP16_BF16 = dict(fwd=CommType.FP16, bwd=CommType.BF16)


# -- on the ranks -------------------------------------------------------------------------------

def _train_pair(rank, world, opt, qcomm, steps=3):
    """Hybrid vs table_wise, same init, same registry: max |difference| of the outputs (the
    first step's, before any update, and every step's; ``scale``: max |output|) and of the
    trained weights (``moved``: how far training moved them); and, at the first step, max
    |hybrid - exact fp32 pooling| (the unsharded EBC on this rank's batch: what the codec
    alone changes); ``codec_moved``: max |hybrid - the same hybrid without codecs| of the trained weights
    (what the codecs, the backward one included, changed)."""
    configs = tables(mean=True)
    torch.manual_seed(0)
    ref = torchrec.EmbeddingBagCollection(tables=configs)
    hot = hot_ids()
    reg = None if qcomm is None else _registry(**qcomm)
    fused = dict(OPTIMIZERS[opt])
    mh = build(configs, world, KINDS, HybridEmbeddingBagCollectionSharder(hot, fused_params=fused,
                                                                          qcomm_codecs_registry=reg))
    mt = build(configs, world, {}, EmbeddingBagCollectionSharder(fused_params=fused, qcomm_codecs_registry=reg))
    mf = build(configs, world, KINDS, HybridEmbeddingBagCollectionSharder(hot, fused_params=fused))  # no codecs
    for m in (mh, mt, mf):
        m.load_state_dict(ref.state_dict())
    keys = [f for c in configs for f in c.feature_names]
    out = {"first_outputs": 0.0, "outputs": 0.0, "scale": 0.0, "weights": 0.0, "moved": 0.0, "first_vs_fp32": 0.0,
           "codec_moved": 0.0}
    for step in range(steps):
        kjt = skewed_batch(configs, keys, batch=6, seed=100 * step + rank, hot=hot)
        oh, ot = mh(kjt).wait().to_dict(), mt(kjt).wait().to_dict()
        vh = torch.cat([oh[k] for k in keys], 1)
        vt = torch.cat([ot[k] for k in keys], 1)
        assert vh.dtype == vt.dtype == torch.float32
        out["outputs"] = max(out["outputs"], float((vh - vt).abs().max()))
        out["scale"] = max(out["scale"], float(vt.abs().max()))
        if step == 0:
            out["first_outputs"] = out["outputs"]
            exact = ref(kjt).to_dict()
            out["first_vs_fp32"] = float((vh - torch.cat([exact[k] for k in keys], 1)).abs().max())
        coef = torch.randn(vt.shape, generator=torch.Generator().manual_seed(7 + step + rank))
        (vh * coef).sum().backward()
        (vt * coef).sum().backward()
        of = mf(kjt).wait().to_dict()
        (torch.cat([of[k] for k in keys], 1) * coef).sum().backward()
    sh, st, sf, s0 = mh.state_dict(), mt.state_dict(), mf.state_dict(), ref.state_dict()
    for k in st:
        wt = full_weight(st[k])
        out["weights"] = max(out["weights"], float((full_weight(sh[k]) - wt).abs().max()))
        out["moved"] = max(out["moved"], float((wt - s0[k]).abs().max()))
        out["codec_moved"] = max(out["codec_moved"], float((full_weight(sh[k]) - full_weight(sf[k])).abs().max()))
    return out


def _zipf_batch(seed):
    """One id per feature, Zipf(1.2) over a fixed permutation of each table's rows."""
    g = torch.Generator().manual_seed(seed)
    p = torch.arange(1, BYTES_ROWS + 1, dtype=torch.float64) ** -1.2
    ranks = torch.multinomial(p, BYTES_BATCH * BYTES_TABLES, replacement=True, generator=g)
    perms = torch.stack([torch.randperm(BYTES_ROWS, generator=torch.Generator().manual_seed(i))
                         for i in range(BYTES_TABLES)])
    values = torch.gather(perms, 1, ranks.view(BYTES_TABLES, BYTES_BATCH)).reshape(-1)
    return torchrec.KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(BYTES_TABLES)], values=values,
                                                        lengths=torch.ones_like(values))


def _phase_bytes(model, kjt):
    """Bytes this rank sends in the input dist, the forward output dist and the backward."""
    sebc = model.module
    ctx = sebc.create_context()
    with count_sent_bytes() as n_in:
        features = sebc.input_dist(ctx, kjt).wait().wait()
    with count_sent_bytes() as n_out:
        pooled = sebc.compute_and_output_dist(ctx, features).wait()
    with count_sent_bytes() as n_bwd:
        pooled.values().sum().backward()
    return {"input": n_in[0], "output_fwd": n_out[0], "output_bwd": n_bwd[0]}


def _bytes_and_counts(rank, world):
    """Per model (hybrid and table_wise, fp32 and FP16 fwd / BF16 bwd): bytes per phase of one
    step (after a warm-up step) and the step's collectives / host syncs."""
    from benchmarks.step_counts import count_training_step

    configs = [torchrec.EmbeddingBagConfig(name=f"t{i}", embedding_dim=BYTES_DIM, num_embeddings=BYTES_ROWS,
                                           feature_names=[f"f{i}"]) for i in range(BYTES_TABLES)]
    hot = {c.name: torch.randperm(BYTES_ROWS, generator=torch.Generator().manual_seed(i))[:40]
           for i, c in enumerate(configs)}
    sgd = dict(OPTIMIZERS["sgd"])
    reg = _registry(**FP16_BF16)
    models = {}
    for codec, r in (("fp32", None), ("fp16_bf16", reg)):
        models[f"hybrid_{codec}"] = build(configs, world, {c.name: "hybrid" for c in configs},
                                          HybridEmbeddingBagCollectionSharder(hot, fused_params=sgd,
                                                                              qcomm_codecs_registry=r))
        models[f"table_wise_{codec}"] = build(configs, world, {}, EmbeddingBagCollectionSharder(
            fused_params=sgd, qcomm_codecs_registry=r))
    out = {}
    for name, model in models.items():
        _phase_bytes(model, _zipf_batch(seed=rank))  # warm-up: first-step set-up is not a step
        out[name] = _phase_bytes(model, _zipf_batch(seed=10 + rank))
        if name.startswith("hybrid"):
            out[name].update(count_training_step(model, _zipf_batch(seed=20 + rank)))
    return out


def _build_with(world, reg, kinds=None):
    configs = tables()
    sharder = HybridEmbeddingBagCollectionSharder(hot_ids(), fused_params=dict(OPTIMIZERS["sgd"]),
                                                  qcomm_codecs_registry=reg)
    return build(configs, world, kinds or {"t0": "hybrid", "t1": "tw", "t2": "hybrid", "t3": "tw"}, sharder)


def _refusals(world):
    from torchrec.distributed.types import QuantizedCommCodecs

    fp16 = _registry(CommType.FP16, CommType.FP16)
    return {
        "fp8_rowwise": refused(lambda: _build_with(world, _registry(CommType.FP8, CommType.FP16,
                                                                     fp8_quantize_dim=32))),
        "fp8_elementwise": refused(lambda: _build_with(world, _registry(CommType.BF16, CommType.FP8))),
        "int8": refused(lambda: _build_with(world, _registry(CommType.INT8, CommType.INT8))),
        "mx4": refused(lambda: _build_with(world, _registry(CommType.FP16, CommType.MX4))),
        # a codec for a comm op TorchRec does not define (the cold id all-to-alls take none)
        "unknown_op": refused(lambda: _build_with(world, {**fp16, "SPARSE_FEATURES_ALL_TO_ALL": QuantizedCommCodecs(
            forward=fp16["POOLED_EMBEDDINGS_ALL_TO_ALL"].forward)})),
        # accepted: a refused codec only where no table is frequency_hybrid
        "int8_stock_only": refused(lambda: _build_with(world, _registry(CommType.INT8, CommType.INT8),
                                                        kinds={"t0": "tw"})),
    }


def _everything(rank, world):
    out = {"refusals": _refusals(world)}
    out["sgd"] = _train_pair(rank, world, "sgd", FP16_BF16)
    out["rowwise_adagrad"] = _train_pair(rank, world, "rowwise_adagrad", FP16_BF16)
    # the directions are independent: fp32 forward, FP16 backward with a loss scale
    out["fp32_fwd_fp16_bwd"] = _train_pair(rank, world, "rowwise_adagrad",
                                           dict(fwd=CommType.FP32, bwd=CommType.FP16, backward_loss_scale=64.0))
    out["fp32"] = _train_pair(rank, world, "rowwise_adagrad", None)
    out["bytes"] = _bytes_and_counts(rank, world)
    return out


@pytest.fixture(scope="module")
def outcomes():
    per_rank = run_ranks(_everything, WORLD, timeout=240)
    return per_rank


# -- the checks ---------------------------------------------------------------------------------

# Relative tolerances: a few roundings each side (hybrid: partial sums and hot rows; table_wise:
# the pooled sum) at fp16's 2^-11 or bf16's 2^-8 relative precision, of the output scale (forward)
# or of how far 3 steps moved the weights (backward: the gradients are rounded). Later steps'
# outputs also carry the weights' difference, up to once per id of a bag (at most 4).
FP16_REL, BF16_REL, MAX_BAG = 4e-3, 2e-2, 4


@pytest.mark.parametrize("case, out_rel, weight_rel", [("sgd", FP16_REL, BF16_REL),
                                                       ("rowwise_adagrad", FP16_REL, BF16_REL),
                                                       ("fp32_fwd_fp16_bwd", None, FP16_REL)])
def test_quantized_comms_train_like_table_wise(outcomes, case, out_rel, weight_rel):
    """FP16 forward / BF16 backward output all-to-all: outputs of 3 steps and the trained
    weights within fp16 / bf16 rounding of table_wise with the same codecs; the codec is
    really applied (an FP16 forward output differs from exact fp32 pooling, an FP32 one does
    not). FP32 forward + FP16 backward (loss-scaled): the directions are independent."""
    for r in outcomes:
        res = r[case]
        assert res["moved"] > 0.1, res  # training moved the weights far past the tolerances
        assert res["weights"] <= weight_rel * res["moved"], (case, res)
        if out_rel is None:  # fp32 forward: the first step's outputs are exact
            assert res["first_vs_fp32"] <= 1e-6 and res["first_outputs"] <= 1e-6, res
            # ... and the backward codec alone moved the weights off the codec-free run's (applied, not dropped)
            assert res["codec_moved"] > 1e-6, res
        else:
            assert res["first_outputs"] <= out_rel * res["scale"], (case, res)
            assert 1e-5 < res["first_vs_fp32"] <= out_rel * res["scale"], res  # rounded, not exact
        fwd_tol = (out_rel or 0.0) * res["scale"]
        assert res["outputs"] <= fwd_tol + MAX_BAG * res["weights"] + 1e-6, (case, res)


def test_fp32_path_stays_exact(outcomes):
    for r in outcomes:
        res = r["fp32"]
        assert res["outputs"] <= 1e-5 and res["weights"] <= 1e-5 and res["first_vs_fp32"] <= 1e-6, res
        assert res["codec_moved"] == 0.0, res  # no codec: the codec-free run itself


def test_output_all_to_all_bytes_halve(outcomes):
    """Measured per rank: FP16 forward / BF16 backward halve the output all-to-all's bytes each
    way (its split sizes are element counts, the elements half as wide); the cold id exchange
    is untouched. TorchRec's table_wise with the same registry, measured alike, halves too."""
    for r in outcomes:
        b = r["bytes"]
        for kind in ("hybrid", "table_wise"):
            full, quant = b[f"{kind}_fp32"], b[f"{kind}_fp16_bf16"]
            assert full["output_fwd"] > 20_000 and full["output_bwd"] > 20_000, b
            for phase in ("output_fwd", "output_bwd"):
                assert 0.48 <= quant[phase] / full[phase] <= 0.52, (kind, phase, b)
            assert math.isclose(quant["input"], full["input"], rel_tol=0.02), (kind, b)
        assert b["hybrid_fp16_bf16"]["output_fwd"] < b["table_wise_fp16_bf16"]["output_fwd"], b


def test_no_extra_collectives_or_host_syncs(outcomes):
    for r in outcomes:
        full, quant = r["bytes"]["hybrid_fp32"], r["bytes"]["hybrid_fp16_bf16"]
        for k in ("fwd_collectives", "bwd_collectives", "fwd_host_syncs", "bwd_host_syncs"):
            assert quant[k] == full[k], (k, full, quant)


@pytest.mark.parametrize("case, words", [
    ("fp8_rowwise", ["['t0', 't2']", "POOLED_EMBEDDINGS_ALL_TO_ALL", "forward codec FP8 rowwise (row_dim 32)",
                     "variable-length run"]),
    ("fp8_elementwise", ["['t0', 't2']", "POOLED_EMBEDDINGS_ALL_TO_ALL", "backward codec FP8 (element-wise)",
                         "+-0.94"]),
    ("int8", ["['t0', 't2']", "forward codec INT8 rowwise", "backward codec INT8 rowwise"]),
    ("mx4", ["['t0', 't2']", "backward codec MX4"]),
    ("unknown_op", ["['t0', 't2']", "SPARSE_FEATURES_ALL_TO_ALL", "not a TorchRec comm op", "int32"]),
])
def test_unsupported_codecs_refused_at_shard_time(outcomes, case, words):
    for r in outcomes:  # every rank, the same verdict
        verdict, msg = r["refusals"][case]
        assert verdict == "raised", f"{case} was accepted"
        for w in words:
            assert w in msg, (case, w, msg)
        assert "'t1'" not in msg and "'t3'" not in msg  # stock tables are not named
        assert "codec BF16" not in msg and "codec FP16" not in msg  # the supported codecs are not named


def test_refused_codec_accepted_without_hybrid_tables(outcomes):
    for r in outcomes:
        assert r["refusals"]["int8_stock_only"] == ("built", "")


# -- the planner ---------------------------------------------------------------------------------

def test_planner_prices_the_codec():
    """The hybrid's output-dist (partial sums) and hot-sync bytes in the planner's estimate
    halve with FP16 forward + BF16 backward, each direction on its own (FP16 forward alone:
    3/4); the cold id bytes do not change; stock table_wise's estimate drops alike."""
    from tests.planner.planner_testutils import exact_stats, tables as ptables, zipf_probs
    from torchrec_hybrid.planner import HybridEnumerator, gloo_topology
    from torchrec_hybrid.planner import cost_model as cm

    n = 20_000
    cfg = ptables({"t": n}, dim=16)
    st = exact_stats(cfg, {"t": zipf_probs(n, 1.2)})

    def options(reg):
        # H at its cap whatever the price (the 10 hottest rows pay for themselves many times)
        enum = HybridEnumerator(gloo_topology(4, bandwidth_gbps=2.0), 256, frequency_stats=st, max_hot_rows=10)
        sharder = HybridEmbeddingBagCollectionSharder(fused_params=dict(OPTIMIZERS["sgd"]), qcomm_codecs_registry=reg)
        opts = enum.enumerate(torchrec.EmbeddingBagCollection(tables=cfg, device=torch.device("meta")), [sharder])
        hyb = {o.hybrid_choice.cold_layout: o for o in opts if o.sharding_type == FREQUENCY_HYBRID}
        return hyb, [o for o in opts if o.sharding_type == "table_wise"][0]

    fp32, tw32 = options(None)
    half, tw16 = options(_registry(**FP16_BF16))
    fwd_only, _ = options(_registry(CommType.FP16, CommType.FP32))
    assert set(fp32) == set(half) == {"row_wise", "table_wise"}
    for layout in fp32:
        a, b, c = (x[layout].hybrid_choice for x in (fp32, half, fwd_only))
        assert a.hot_rows == b.hot_rows == c.hot_rows > 0
        for part in ("partials", "hot_sync"):
            assert math.isclose(b.comm_bytes[part], a.comm_bytes[part] / 2, rel_tol=1e-9), (layout, part)
            assert math.isclose(c.comm_bytes[part], a.comm_bytes[part] * 3 / 4, rel_tol=1e-9), (layout, part)
        for part in ("lengths", "cold_ids"):
            assert b.comm_bytes[part] == a.comm_bytes[part]
        assert b.bytes_per_step < a.bytes_per_step
        assert half[layout].total_perf < fp32[layout].total_perf  # shard perf (what partitioning sees)
    t = cm.TableTraffic(rows=n, dim=16, features=1, pooling=1.0, batch=256, world=4)
    full_out = cm.model("table_wise").parts(t)["output"]
    # table_wise perf: owner's bytes + the others' = W x the mean, the output half of it halved
    bw = 2.0 * 1024 ** 3 / 1000
    assert math.isclose((tw32.total_perf - tw16.total_perf) * bw, 4 * full_out / 2, rel_tol=1e-6)


def test_planner_estimate_of_a_plan_drops():
    """A whole plan (``estimated_rank_bytes``) with every table frequency_hybrid: FP16 / BF16
    comms cost fewer bytes per rank than fp32, by the output all-to-all's half."""
    from torchrec.distributed.planner.types import ParameterConstraints

    from tests.planner.planner_testutils import exact_stats, plan_for, tables as ptables, zipf_probs

    cfg = ptables({"a": 20_000, "b": 5_000}, dim=16)
    st = exact_stats(cfg, {"a": zipf_probs(20_000, 1.2), "b": zipf_probs(5_000, 1.1)})
    only_hybrid = {c.name: ParameterConstraints(sharding_types=[FREQUENCY_HYBRID]) for c in cfg}
    est = {}
    for name, reg in (("fp32", None), ("fp16_bf16", _registry(**FP16_BF16))):
        planner, plan = plan_for(cfg, st, world=4, batch=256, constraints=only_hybrid, compute_costs=None,
                                 sharder=HybridEmbeddingBagCollectionSharder(qcomm_codecs_registry=reg),
                                 max_hot_rows=10)
        assert {ps.sharding_type for ps in plan.values()} == {FREQUENCY_HYBRID}
        est[name] = (sum(planner.estimated_rank_bytes()), planner.hybrid_choices())
    (full, ch32), (half, ch16) = est["fp32"], est["fp16_bf16"]
    saved = sum((c.comm_bytes["partials"] + c.comm_bytes["hot_sync"]) / 2 for c in ch32.values())
    assert all(ch32[n].hot_rows == ch16[n].hot_rows for n in ch32)
    assert half < full
    # the plan's per-rank bytes (placed owners, module overhead) drop by the mean model's output half, x W
    assert math.isclose(full - half, 4 * saved, rel_tol=0.05), (full, half, saved)
