"""Bad ids and bad hot sets fail clearly on every rank, without hangs or weight changes."""

import pytest
import torch
import torchrec

from tests.models import OPTIMIZERS, build, full_weight, hot_ids, skewed_batch, tables
from tests.multiprocess import run_ranks
from torchrec_hybrid import HotSetError, HybridEmbeddingBagCollectionSharder, InvalidIdError

KINDS = {"t0": "hybrid", "t1": "hybrid", "t2": "tw", "t3": "hybrid"}


def _step(model, kjt, keys):
    d = model(kjt).wait().to_dict()
    torch.cat([d[k] for k in keys], dim=1).sum().backward()


def _as_tensordict(kjt):
    """The batch as a TensorDict of jagged nested tensors, one per key (TorchRec's input_dist takes one)."""
    from tensordict import TensorDict

    return TensorDict({k: torch.nested.nested_tensor_from_jagged(jt.values(), lengths=jt.lengths())
                       for k, jt in kjt.to_dict().items()}, batch_size=[kjt.stride()])


def bad_ids(rank, world, feature, value, kinds=KINDS, fused_only=True, as_tensordict=False):
    configs = tables()
    hot_t = hot_ids()
    model = build(configs, world, kinds, HybridEmbeddingBagCollectionSharder(hot_t, fused_params=OPTIMIZERS["sgd"],
                                                                             validate_ids=True))
    keys = [f for c in configs for f in c.feature_names]
    _step(model, skewed_batch(configs, keys, batch=4, seed=rank, hot=hot_t), keys)
    before = {k: full_weight(v) for k, v in model.state_dict().items()}
    kjt = skewed_batch(configs, keys, batch=4, seed=10 + rank, hot=hot_t)
    if rank == world - 1:  # only the last rank sees the bad id
        values = kjt.values().clone()
        start = int(sum(kjt.length_per_key()[: keys.index(feature)]))
        values[start] = value
        kjt = torchrec.KeyedJaggedTensor(keys=keys, values=values, lengths=kjt.lengths())
    with pytest.raises(InvalidIdError) as err:
        _step(model, _as_tensordict(kjt) if as_tensordict else kjt, keys)
    msg = str(err.value)
    assert f"'{feature}'" in msg and str(value) in msg and f"rank {world - 1}" in msg, msg
    for k, v in model.state_dict().items():
        assert torch.equal(full_weight(v), before[k]), f"{k} changed on a rejected batch"
    # the next good batch trains normally (fused optimizers update in backward; data_parallel
    # tables only get their gradients, which a dense optimizer would apply)
    _step(model, skewed_batch(configs, keys, batch=4, seed=20 + rank, hot=hot_t), keys)
    if fused_only:
        after = {k: full_weight(v) for k, v in model.state_dict().items()}
        assert any(not torch.equal(after[k], before[k]) for k in after)
    else:
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters() if p.requires_grad)
    return msg


@pytest.mark.parametrize("feature,value", [("f1", 30), ("f0b", -3), ("f2", 2**40 + 5)],
                         ids=["too-large-hybrid", "negative-shared-table", "too-large-table-wise"])
def test_bad_id_fails_on_every_rank(feature, value):
    """The verdicts ride the hybrid cold all-to-all."""
    messages = run_ranks(bad_ids, 2, timeout=120, feature=feature, value=value)
    assert messages[0] == messages[1]


def test_bad_id_in_a_tensordict_batch_fails_on_every_rank():
    """A TensorDict batch is checked like a KJT (converted as TorchRec converts it): no id reaches a TBE
    unchecked, whose own bounds check is off while the input check is on."""
    messages = run_ranks(bad_ids, 2, timeout=120, feature="f2", value=2**40 + 5, kinds={c: "tw" for c in KINDS},
                         as_tensordict=True)
    assert messages[0] == messages[1]


@pytest.mark.parametrize("kind,overflow_debug", [("tw", False), ("tw", True), ("dp", False), ("rw", False)],
                         ids=["tw", "tw-overflow-debug", "dp", "rw"])
def test_bad_id_fails_on_every_rank_without_hybrid_tables(kind, overflow_debug, monkeypatch):
    """With no frequency_hybrid table in the module the verdicts ride the stock input dist's
    split sizes (table_wise; also with TorchRec's overflow checks of those sizes on, which read
    their last row: the verdicts go first), or, with no stock input dist (data_parallel only),
    take an all-to-all of their own. Row-wise dists bucket by id, so there the bad id is
    clamped into range until the verdict is read; table-wise and data-parallel ones (and
    column-wise) only move ids, so there it travels as it is, and is refused before any lookup."""
    if overflow_debug:  # read when the ranks import torchrec
        monkeypatch.setenv("TORCHREC_OVERFLOW_DEBUG", "1")
    kinds = {c: kind for c in KINDS}
    messages = run_ranks(bad_ids, 3, timeout=120, feature="f1", value=-(2**40), kinds=kinds,
                         fused_only=kind != "dp")
    assert messages[0] == messages[1] == messages[2]


def bad_hot_set(rank, world, case):
    configs = tables()
    hot = {k: list(v) for k, v in {"t0": [3, 7], "t1": [0, 29], "t3": [16]}.items()}
    if case == "differs" and rank == 1:
        hot["t1"] = [0, 28]
    if case == "size-differs" and rank == 0:
        hot["t0"] = [3]
    if case == "out-of-range" and rank == 1:
        hot["t3"] = [17]
    if case == "duplicate":
        hot["t0"] = [3, 7, 3]
    sharder = HybridEmbeddingBagCollectionSharder({k: torch.tensor(v) for k, v in hot.items()},
                                                 fused_params=OPTIMIZERS["sgd"])
    with pytest.raises(HotSetError) as err:
        build(configs, world, KINDS, sharder)
    return str(err.value)


@pytest.mark.parametrize("case,expect", [("differs", "t1"), ("size-differs", "t0"), ("out-of-range", "rank(s) [1]"),
                                         ("duplicate", "3 appears more than once")])
def test_bad_hot_set_refused_at_shard_time(case, expect):
    messages = run_ranks(bad_hot_set, 2, timeout=120, case=case)
    assert all(expect in m for m in messages), messages


def collectives_per_step(rank, world, kinds, validate_ids):
    """Collectives one good step issues, and the context the sharded module created."""
    import torch.distributed as dist

    from torchrec_hybrid.sharded_ebc import HybridEmbeddingBagCollectionContext, HybridShardedEmbeddingBagCollection

    configs = tables()
    hot_t = hot_ids()
    sharder = HybridEmbeddingBagCollectionSharder(hot_t, fused_params=OPTIMIZERS["sgd"], validate_ids=validate_ids)
    model = build(configs, world, kinds, sharder)
    keys = [f for c in configs for f in c.feature_names]
    _step(model, skewed_batch(configs, keys, batch=4, seed=rank, hot=hot_t), keys)  # input dists built
    sebc = next(m for m in model.modules() if isinstance(m, HybridShardedEmbeddingBagCollection))
    ctx = sebc.create_context()
    assert isinstance(ctx, HybridEmbeddingBagCollectionContext) and ctx.id_check is None
    calls = []
    originals = {n: getattr(dist, n) for n in ("all_gather_into_tensor", "all_to_all_single", "all_gather")}

    def counting(name):
        def call(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)
        return call

    for name in originals:
        setattr(dist, name, counting(name))
    try:
        kjt = skewed_batch(configs, keys, batch=4, seed=30 + rank, hot=hot_t)
        dist_input = sebc.input_dist(ctx, kjt).wait().wait()
        checked = ctx.id_check is not None
        sebc.compute_and_output_dist(ctx, dist_input).wait()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return sorted(calls), checked, ctx.id_check is None


@pytest.mark.parametrize("plan", ["hybrid", "table_wise", "row_wise", "data_parallel"])
def test_id_check_verdict_rides_the_cold_exchange(plan):
    """The id check adds no collective where a hybrid table's cold exchange carries its verdicts (in
    its headers); a module the plan leaves all stock, checked on request, adds one small all-to-all.
    The check is carried in the module's typed context and settled before the lookups."""
    kinds = KINDS if plan == "hybrid" else {c: {"table_wise": "tw", "row_wise": "rw"}.get(plan, "dp") for c in KINDS}
    on = run_ranks(collectives_per_step, 2, timeout=120, kinds=kinds, validate_ids=True)
    off = run_ranks(collectives_per_step, 2, timeout=120, kinds=kinds, validate_ids=False)
    for (calls_on, checked, settled), (calls_off, unchecked, _) in zip(on, off):
        assert checked and settled and not unchecked
        extra = list(calls_on)
        for c in calls_off:
            extra.remove(c)
        assert extra == ([] if plan == "hybrid" else ["all_to_all_single"]), (calls_on, calls_off)


def bad_id_under_pipeline(rank, world, kind, bad_step):
    """A DLRM trained by TrainPipelineSparseDist (which fuses the input dists' split-size
    exchanges from its second batch on); the last rank's batch ``bad_step`` has a bad id."""
    import itertools

    from torchrec.datasets.utils import Batch
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel, table_wise
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.distributed.types import ShardingPlan
    from torchrec.models.dlrm import DLRM, DLRMTrain

    configs = [torchrec.EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=20 + i,
                                           feature_names=[f"f{i}"]) for i in range(3)]
    keys = [c.feature_names[0] for c in configs]
    ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    model = DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[8],
                           over_arch_layer_sizes=[4, 1], dense_device=torch.device("cpu")))
    sharder = HybridEmbeddingBagCollectionSharder(fused_params=OPTIMIZERS["sgd"], validate_ids=True)
    spec = {c.name: (table_wise(rank=i % world) if kind == "tw" else data_parallel()) for i, c in enumerate(configs)}
    path = "model.sparse_arch.embedding_bag_collection"
    plan = ShardingPlan({path: construct_module_sharding_plan(ebc, spec, sharder=sharder, local_size=world,
                                                              world_size=world, device_type="cpu")})
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    opt = torch.optim.SGD([p for p in dmp.parameters() if p.requires_grad], lr=0.1)
    g = torch.Generator().manual_seed(rank)

    def batch(step):
        values = torch.randint(0, 20, (6 * len(keys),), generator=g)
        if step == bad_step and rank == world - 1:
            values[0] = 10**6
        sparse = torchrec.KeyedJaggedTensor(keys=keys, values=values, lengths=torch.full((3 * len(keys),), 2))
        return Batch(dense_features=torch.rand(3, 4, generator=g), sparse_features=sparse,
                     labels=torch.randint(0, 2, (3,), generator=g).float())

    pipeline = TrainPipelineSparseDist(dmp, opt, torch.device("cpu"))
    it = iter(batch(s) for s in itertools.count())
    for _ in range(bad_step):  # the good batches train
        pipeline.progress(it)
    with pytest.raises(InvalidIdError) as err:
        pipeline.progress(it)
    assert "'f0'" in str(err.value) and f"rank {world - 1}" in str(err.value), str(err.value)
    return str(err.value)


@pytest.mark.parametrize("kind", ["tw", "dp"])
def test_bad_id_fails_on_every_rank_under_train_pipeline(kind):
    """Under TrainPipelineSparseDist the verdicts of a module without hybrid tables take an
    all-to-all of their own from the second batch on (the pipeline fuses the split-size
    exchanges outside the module): every rank still raises the same error, on the same step."""
    messages = run_ranks(bad_id_under_pipeline, 2, timeout=120, kind=kind, bad_step=3)
    assert messages[0] == messages[1]


def bounds_check_modes(rank, world, validate_ids, fused_mode):
    """Each fused TBE's bounds-check mode in a module of hybrid, table_wise and row_wise tables."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    fused = dict(OPTIMIZERS["sgd"])
    if fused_mode is not None:
        fused["bounds_check_mode"] = fused_mode
    sharder = HybridEmbeddingBagCollectionSharder(hot_ids(), fused_params=fused, validate_ids=validate_ids)
    from torchrec_hybrid.sharded_ebc import HybridShardedEmbeddingBagCollection

    model = build(tables(), world, {"t0": "hybrid", "t1": "hybrid_tw", "t2": "tw", "t3": "rw"}, sharder)
    (sebc,) = [m for m in model.modules() if isinstance(m, HybridShardedEmbeddingBagCollection)]
    # the sharded module hides its lookups from modules(); every TBE of every lookup (the hybrid one's
    # cold TBEs included)
    tbes = [m for lookup in sebc._lookups for m in lookup.modules()
            if isinstance(m, SplitTableBatchedEmbeddingBagsCodegen)]
    assert len(tbes) >= 2, tbes  # hybrid cold, row_wise (and table_wise on rank 0)
    return sorted({m.bounds_check_mode_int for m in tbes}), "bounds_check_mode" in sharder.fused_params


@pytest.mark.parametrize("validate_ids,fused_mode,expect", [(True, None, "NONE"), (False, None, "WARNING"),
                                                            (True, "FATAL", "FATAL"), (False, "FATAL", "FATAL")],
                         ids=["checked-replaces-fbgemm", "unchecked-keeps-fbgemm", "user-mode-wins",
                              "user-mode-wins-unchecked"])
def test_id_check_replaces_fbgemm_bounds_check(validate_ids, fused_mode, expect):
    """With the input check on, every id reaching a TBE is in range (the check refuses a batch on every
    rank before any lookup: the tests above), so the TBEs' own per-call bounds check is off - for
    stock and hybrid tables alike; without the check FBGEMM's default stays, and a mode the user
    sets is kept either way (the sharder's own fused params untouched)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode

    user = None if fused_mode is None else BoundsCheckMode[fused_mode]
    for modes, sharder_has_mode in run_ranks(bounds_check_modes, 2, timeout=120, validate_ids=validate_ids,
                                             fused_mode=user):
        assert modes == [BoundsCheckMode[expect].value], modes
        assert sharder_has_mode == (fused_mode is not None)


def retried_rejected_step(rank, world):
    """A rejected step's context, used again: raises the same error again, and still looks nothing up."""
    from torchrec_hybrid.sharded_ebc import HybridShardedEmbeddingBagCollection

    configs = tables()
    model = build(configs, world, {c: "tw" for c in KINDS},
                  HybridEmbeddingBagCollectionSharder(hot_ids(), fused_params=OPTIMIZERS["sgd"], validate_ids=True))
    keys = [f for c in configs for f in c.feature_names]
    _step(model, skewed_batch(configs, keys, batch=4, seed=rank, hot=hot_ids()), keys)
    (sebc,) = [m for m in model.modules() if isinstance(m, HybridShardedEmbeddingBagCollection)]
    before = {k: full_weight(v) for k, v in model.state_dict().items()}
    kjt = skewed_batch(configs, keys, batch=4, seed=10 + rank, hot=hot_ids())
    if rank == world - 1:
        values = kjt.values().clone()
        values[0] = 2**40 + 5  # far outside its table: a lookup would read past the weights
        kjt = torchrec.KeyedJaggedTensor(keys=keys, values=values, lengths=kjt.lengths())
    ctx = sebc.create_context()
    dist_input = sebc.input_dist(ctx, kjt).wait().wait()
    messages = []
    for _ in range(2):
        with pytest.raises(InvalidIdError) as err:
            sebc.compute_and_output_dist(ctx, dist_input).wait()
        messages.append(str(err.value))
    for k, v in model.state_dict().items():
        assert torch.equal(full_weight(v), before[k]), f"{k} changed on a rejected batch"
    return messages


def test_rejected_step_stays_rejected_when_retried():
    for first, second in run_ranks(retried_rejected_step, 2, timeout=120):
        assert first == second and "rank 1:" in first
