"""Our sharder under TrainPipelineSparseDist: detach / attach around a validation pass (the DLRM
example's pattern), pipelined steps' collectives, and bad ids in flight.

``attach`` re-runs the in-flight batch's input dists and then computes on the tensors of their
first run. The reference is the same model sharded by TorchRec's own sharder (table_wise for
frequency_hybrid), trained through the same calls. A module without hybrid tables is checked
only when asked (``validate_ids=True``: its verdicts then take an all-to-all of their own).
"""

import itertools

import pytest
import torch
import torchrec

from tests.models import OPTIMIZERS
from tests.multiprocess import run_ranks
from torchrec_hybrid import HybridEmbeddingBagCollectionSharder, InvalidIdError, frequency_hybrid


def dlrm_pair(rank, world, kind, bad_batch=None, validate_ids=None):
    """The same small DLRM sharded by our sharder and by TorchRec's (table_wise for
    frequency_hybrid), from one unsharded model's weights, and ``batches(seed)`` (this rank's:
    seeds 100 + rank train, 200 + rank held out; ``bad_batch``: the last rank's training
    batch of that index has an id of no row)."""
    from torchrec.datasets.utils import Batch
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.models.dlrm import DLRM, DLRMTrain

    configs = [torchrec.EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=20 + i,
                                           feature_names=[f"f{i}"]) for i in range(3)]
    keys = [c.feature_names[0] for c in configs]
    path = "model.sparse_arch.embedding_bag_collection"

    def dlrm(device):
        ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device(device))
        return DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[8],
                              over_arch_layer_sizes=[4, 1], dense_device=torch.device("cpu")))

    def build(sharder, hybrid):
        model = dlrm("meta")
        ebc = model.model.sparse_arch.embedding_bag_collection
        first = {"tw": table_wise(rank=0), "tw+dp": data_parallel(),
                 "fh+tw": frequency_hybrid() if hybrid else table_wise(rank=0)}[kind]
        spec = {c.name: (first if i == 0 else table_wise(rank=i % world)) for i, c in enumerate(configs)}
        plan = ShardingPlan({path: construct_module_sharding_plan(ebc, spec, sharder=sharder, local_size=world,
                                                                  world_size=world, device_type="cpu")})
        return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])

    def batches(seed):
        g = torch.Generator().manual_seed(seed)
        for i in itertools.count():
            values = torch.randint(0, 20, (6 * len(keys),), generator=g)
            if i == bad_batch and seed == 100 + world - 1:  # the last rank's training batch: an id of no row
                values[0] = 10**6
            sparse = torchrec.KeyedJaggedTensor(keys=keys, values=values, lengths=torch.full((3 * len(keys),), 2))
            yield Batch(dense_features=torch.rand(3, 4, generator=g), sparse_features=sparse,
                        labels=torch.randint(0, 2, (3,), generator=g).float())

    hot = {"t0": torch.tensor([0, 1, 2])} if kind == "fh+tw" else None
    ours = build(HybridEmbeddingBagCollectionSharder(hot_ids=hot, fused_params=OPTIMIZERS["sgd"],
                                                     validate_ids=validate_ids), hybrid=True)
    stock = build(EmbeddingBagCollectionSharder(fused_params=OPTIMIZERS["sgd"]), hybrid=False)
    torch.manual_seed(0)
    reference = dlrm("cpu").state_dict()  # both start from one unsharded model's weights
    ours.load_state_dict(reference.copy())  # DMP renames the dense keys of the dict it gets in place
    stock.load_state_dict(reference.copy())
    return ours, stock, batches


def detach_attach_losses(rank, world, kind, bad_batch=None, validate_ids=None):
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    ours, stock, batches = dlrm_pair(rank, world, kind, bad_batch, validate_ids)
    out = {}
    for name, dmp in (("ours", ours),) if bad_batch is not None else (("ours", ours), ("stock", stock)):
        opt = torch.optim.SGD([p for p in dmp.parameters() if p.requires_grad], lr=0.1)
        pipeline = TrainPipelineSparseDist(dmp, opt, torch.device("cpu"))
        train, held_out = batches(100 + rank), batches(200 + rank)
        losses = [pipeline.progress(train)[0].item() for _ in range(3)]
        model = pipeline.detach()  # a validation pass outside the pipeline, its in-flight batch kept
        model.eval()
        with torch.no_grad():
            val = [model(next(held_out))[0].item() for _ in range(2)]
        model.train()
        pipeline.attach(model)
        if bad_batch is not None:  # the in-flight batch: its verdict, read after the re-run
            with pytest.raises(InvalidIdError) as err:
                pipeline.progress(train)
            return str(err.value)
        losses += [pipeline.progress(train)[0].item() for _ in range(3)]
        out[name] = (losses, val)
    return out


@pytest.mark.parametrize("kind", ["tw", "tw+dp", "fh+tw"])
def test_validation_between_pipeline_steps_matches_stock(kind):
    for got in run_ranks(detach_attach_losses, 2, timeout=120, kind=kind):
        assert got["ours"][0] == pytest.approx(got["stock"][0], rel=1e-5, abs=1e-6)
        assert got["ours"][1] == pytest.approx(got["stock"][1], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("kind", ["tw", "fh+tw"])
def test_bad_id_in_flight_at_attach_fails_on_every_rank(kind):
    """The verdict the module reads after ``attach`` is the in-flight batch's own: a bad id
    there fails every rank with the same error, naming the rank that had it."""
    messages = run_ranks(detach_attach_losses, 2, timeout=120, kind=kind, bad_batch=3, validate_ids=True)
    assert messages[0] == messages[1] and "rank 1" in messages[0] and "'f0'" in messages[0], messages


def pipeline_step_counts(rank, world, kind, validate_ids):
    """Collectives and host syncs of 3 pipelined steps (after 3 to warm up), ours and stock's."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from benchmarks.step_counts import counting

    ours, stock, batches = dlrm_pair(rank, world, kind, validate_ids=validate_ids)
    out = {}
    for name, dmp in (("ours", ours), ("stock", stock)):
        opt = torch.optim.SGD([p for p in dmp.parameters() if p.requires_grad], lr=0.1)
        pipeline = TrainPipelineSparseDist(dmp, opt, torch.device("cpu"))
        train = batches(100 + rank)
        for _ in range(3):
            pipeline.progress(train)
        with counting() as counter:
            for _ in range(3):
                pipeline.progress(train)
        out[name] = counter.summary()
    return out


@pytest.mark.parametrize("validate_ids,extra", [(None, 0), (True, 1)], ids=["default", "checked"])
@pytest.mark.parametrize("kind", ["tw", "tw+dp"])
def test_pipelined_stock_module_costs_what_torchrec_does(kind, validate_ids, extra):
    """A module the plan leaves all stock, pipelined: by default exactly the collectives and host syncs
    of the same plan under TorchRec's sharder (no check); with its check asked for, one small all-to-all
    of the verdicts per step (3 steps: 3 more collectives, and their read: 3 more host syncs)."""
    for got in run_ranks(pipeline_step_counts, 2, timeout=120, kind=kind, validate_ids=validate_ids):
        for what in ("collectives", "host_syncs"):
            assert got["ours"][what] == got["stock"][what] + 3 * extra, (what, got)


def pipelined_bad_id(rank, world, kind):
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    ours, _, batches = dlrm_pair(rank, world, kind, bad_batch=4, validate_ids=True)
    opt = torch.optim.SGD([p for p in ours.parameters() if p.requires_grad], lr=0.1)
    pipeline = TrainPipelineSparseDist(ours, opt, torch.device("cpu"))
    train = batches(100 + rank)
    for step in range(8):
        try:
            pipeline.progress(train)
        except InvalidIdError as err:
            return step, str(err)
    return None


@pytest.mark.parametrize("kind", ["tw", "tw+dp"])
def test_bad_id_in_a_pipelined_step_fails_on_every_rank(kind):
    """A bad id in a pipelined batch of a checked stock-only module fails that batch's step on every
    rank, naming the rank that had it."""
    got = run_ranks(pipelined_bad_id, 2, timeout=120, kind=kind)
    assert got[0] is not None and got[0] == got[1], got
    step, message = got[0]
    assert step == 4 and "rank 1" in message and "'f0'" in message, got
