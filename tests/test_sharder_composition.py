"""Issue 16: our sharder beside ``get_default_sharders()``'s in one model (EBC, EmbeddingCollection,
FeatureProcessedEmbeddingBagCollection), sharders that offer only frequency_hybrid, and the clear
errors for what frequency_hybrid cannot take (docs/usage.md, "Composition")."""

import pytest
import torch
import torchrec
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner.stats import NoopEmbeddingStats
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

from tests.multiprocess import run_ranks
from tests.planner.planner_testutils import exact_stats, zipf_probs
from torchrec_hybrid import FREQUENCY_HYBRID, HybridEmbeddingBagCollectionSharder
from torchrec_hybrid.planner import HybridEmbeddingShardingPlanner, gloo_topology

WORLD = 2


class ThreeKinds(torch.nn.Module):
    """An EBC, an EmbeddingCollection and a position-weighted FPEBC."""

    def __init__(self, device: torch.device = torch.device("meta"), tiny: bool = False) -> None:
        super().__init__()
        bags = [torchrec.EmbeddingBagConfig(name="b0", embedding_dim=8, num_embeddings=2000, feature_names=["fb0"]),
                torchrec.EmbeddingBagConfig(name="b1", embedding_dim=8, num_embeddings=1 if tiny else 300,
                                            feature_names=["fb1"])]
        self.ebc = torchrec.EmbeddingBagCollection(tables=bags, device=device)
        self.ec = torchrec.EmbeddingCollection(tables=[torchrec.EmbeddingConfig(
            name="e0", embedding_dim=8, num_embeddings=500, feature_names=["fe0"])], device=device)
        self.fp = FeatureProcessedEmbeddingBagCollection(
            torchrec.EmbeddingBagCollection(tables=[torchrec.EmbeddingBagConfig(
                name="p0", embedding_dim=8, num_embeddings=400, feature_names=["fp0"])], is_weighted=True,
                device=device),
            PositionWeightedModuleCollection({"fp0": 8}, device=device))

    def forward(self, bags, seq, pos) -> torch.Tensor:
        parts = [self.ebc(bags).values(), self.fp(pos).values()]
        parts += [j.values().sum(0, keepdim=True).expand(parts[0].shape[0], -1) for j in self.ec(seq).values()]
        return torch.cat(parts, dim=1)


def _sharders(hybrid=None):
    """docs/usage.md "Composition": ours for the EBCs, TorchRec's defaults for every other module type."""
    hybrid = hybrid or HybridEmbeddingBagCollectionSharder()
    return [hybrid] + [s for s in get_default_sharders() if type(s) is not EmbeddingBagCollectionSharder]


def _planner(constraints=None, tiny=False, **kw):
    m = ThreeKinds(tiny=tiny)
    stats = exact_stats(m.ebc.embedding_bag_configs(), {"b0": zipf_probs(2000, 1.1)})
    return HybridEmbeddingShardingPlanner(topology=gloo_topology(WORLD), batch_size=256, frequency_stats=stats,
                                          constraints=constraints, stats=[NoopEmbeddingStats()], compute_costs=None,
                                          **kw)


def _types(plan):
    return {t: ps.sharding_type for module_plan in plan.plan.values() for t, ps in module_plan.items()}


def test_ebc_ec_fpebc_planned_together():
    types = _types(_planner().plan(ThreeKinds(), _sharders()))
    assert set(types) == {"b0", "b1", "e0", "p0"}
    assert types["e0"] != FREQUENCY_HYBRID and types["p0"] != FREQUENCY_HYBRID
    assert types["b0"] == FREQUENCY_HYBRID  # skewed ids, gloo bytes only: hybrid pays


@pytest.mark.parametrize("table, module_type", [("e0", "EmbeddingCollection"),
                                                ("p0", "FeatureProcessedEmbeddingBagCollection")])
@pytest.mark.parametrize("types", [[FREQUENCY_HYBRID], [FREQUENCY_HYBRID, "table_wise"]])
def test_constraints_asking_hybrid_for_other_module_types_raise(table, module_type, types):
    planner = _planner({table: ParameterConstraints(sharding_types=types)})
    with pytest.raises(ValueError, match=f"table '{table}' \\({module_type} .*does not offer it"):
        planner.plan(ThreeKinds(), _sharders())


def test_sharder_offering_only_hybrid_is_honoured():
    only = HybridEmbeddingBagCollectionSharder(sharding_types=[FREQUENCY_HYBRID])
    assert only.sharding_types("cpu") == [FREQUENCY_HYBRID]
    planner = _planner()
    types = _types(planner.plan(ThreeKinds(), _sharders(only)))
    assert types["b0"] == types["b1"] == FREQUENCY_HYBRID
    assert types["e0"] != FREQUENCY_HYBRID and types["p0"] != FREQUENCY_HYBRID
    # TorchRec's own planner cannot plan a sharder without stock types: no stock candidate
    assert not any(c.name.startswith("stock") for c in planner.candidates)


def test_subclass_offering_only_hybrid_is_honoured():
    class OnlyHybrid(HybridEmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type):
            return [FREQUENCY_HYBRID]

    types = _types(_planner(min_saving=0.9).plan(ThreeKinds(), _sharders(OnlyHybrid())))
    assert types["b0"] == types["b1"] == FREQUENCY_HYBRID


def test_only_hybrid_and_fewer_rows_than_ranks_is_table_wise_cold():
    """A table with fewer rows than ranks gets frequency_hybrid with every row on one owner,
    written as stock table_wise writes it (one shard of the whole table): no empty row block."""
    only = HybridEmbeddingBagCollectionSharder(sharding_types=[FREQUENCY_HYBRID])
    plan = _planner(tiny=True).plan(ThreeKinds(tiny=True), _sharders(only))
    ps = next(mp["b1"] for mp in plan.plan.values() if "b1" in mp)
    assert ps.sharding_type == FREQUENCY_HYBRID and ps.cold_layout == "table_wise"
    (shard,) = ps.sharding_spec.shards
    assert shard.shard_offsets == [0, 0] and shard.shard_sizes[0] == 1
    # with a stock type beside it the planner chooses between the two
    both = HybridEmbeddingBagCollectionSharder(sharding_types=[FREQUENCY_HYBRID, "data_parallel"])
    types = _types(_planner(tiny=True).plan(ThreeKinds(tiny=True), _sharders(both)))
    assert types["b1"] in (FREQUENCY_HYBRID, "data_parallel") and types["b0"] in (FREQUENCY_HYBRID, "data_parallel")


def test_statistics_of_another_model_are_refused():
    """Statistics counted on a 300-row b1 do not describe a 1-row b1: refused, naming the table."""
    with pytest.raises(ValueError, match="table 'b1' count 300 rows, but the table has 1 rows"):
        _planner().plan(ThreeKinds(tiny=True), _sharders())


def test_unknown_sharding_types_option_raises():
    with pytest.raises(ValueError, match="not offered"):
        HybridEmbeddingBagCollectionSharder(sharding_types=["frequency_hybird"])


def _qcomm_sharder():
    """Quantized comms frequency_hybrid cannot honour (INT8 rowwise; FP16 / BF16 it can:
    tests/test_sharded_ebc_qcomms.py)."""
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

    reg = get_qcomm_codecs_registry(QCommsConfig(forward_precision=CommType.INT8, backward_precision=CommType.BF16),
                                    device=torch.device("cpu"))
    return HybridEmbeddingBagCollectionSharder(qcomm_codecs_registry=reg)


def test_planner_does_not_offer_hybrid_with_quantized_comms_it_cannot_honour():
    types = _types(_planner().plan(ThreeKinds(), _sharders(_qcomm_sharder())))
    assert FREQUENCY_HYBRID not in types.values()
    with pytest.raises(ValueError, match="table 'b0'.*quantized comms .*POOLED_EMBEDDINGS_ALL_TO_ALL'\\] forward "
                                         "codec INT8"):
        _planner({"b0": ParameterConstraints(sharding_types=[FREQUENCY_HYBRID])}).plan(
            ThreeKinds(), _sharders(_qcomm_sharder()))


def _batches(rank: int):
    g = torch.Generator().manual_seed(rank)
    B = 4

    def kjt(key, rows, weighted=False):
        lengths = torch.randint(1, 4, (B,), generator=g)
        n = int(lengths.sum())
        return torchrec.KeyedJaggedTensor(keys=[key], values=torch.randint(0, rows, (n,), generator=g),
                                          lengths=lengths, weights=torch.rand(n, generator=g) if weighted else None)

    bags = torchrec.KeyedJaggedTensor.concat([kjt("fb0", 2000), kjt("fb1", 300)])
    return bags, kjt("fe0", 500), kjt("fp0", 400)


def _readme_composition(rank, world):
    """Mirrors docs/usage.md "Composition": plan, shard and train ThreeKinds; beside it, the same model and
    plan with the hybrid table table_wise under TorchRec's own sharders, from the same weights: the
    outputs of 3 steps and the trained EBC weights must agree."""
    import copy

    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise

    from tests.models import full_weight

    model = ThreeKinds()
    stats = exact_stats(model.ebc.embedding_bag_configs(), {"b0": zipf_probs(2000, 1.1)})
    sharders = [HybridEmbeddingBagCollectionSharder()] + [
        s for s in get_default_sharders() if type(s) is not EmbeddingBagCollectionSharder]
    planner = HybridEmbeddingShardingPlanner(topology=gloo_topology(world), batch_size=4, frequency_stats=stats,
                                             compute_costs=None, stats=[NoopEmbeddingStats()])
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    stock_sharders = get_default_sharders()
    stock_plan = copy.deepcopy(plan)
    ebc_path = next(p for p, mp in plan.plan.items() if "b0" in mp)
    tw = construct_module_sharding_plan(  # every hybrid table of the EBC table_wise, on the same kernel
        ThreeKinds().ebc, {t: table_wise(rank=0, compute_kernel=plan.plan[ebc_path]["b0"].compute_kernel)
                           for t in ("b0", "b1")},
        sharder=next(s for s in stock_sharders if type(s) is EmbeddingBagCollectionSharder),
        local_size=world, world_size=world, device_type="cpu")
    for t, ps in plan.plan[ebc_path].items():
        if ps.sharding_type == FREQUENCY_HYBRID:
            stock_plan.plan[ebc_path][t] = tw[t]
    torch.manual_seed(0)
    init = ThreeKinds(device=torch.device("cpu")).state_dict()
    models = []
    for p, sh in ((plan, sharders), (stock_plan, stock_sharders)):
        m = DistributedModelParallel(ThreeKinds(), device=torch.device("cpu"), plan=p, sharders=sh)
        for name in ("ebc", "ec", "fp"):  # each sharded part from the same unsharded weights
            getattr(m.module, name).load_state_dict(
                {k[len(name) + 1:]: v for k, v in init.items() if k.startswith(name + ".")})
        models.append(m)
    shape = None
    for step in range(3):
        batch = _batches(10 * step + rank)
        outs = [m(*batch) for m in models]
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
        shape = tuple(outs[0].shape)
        for o in outs:
            (o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum().backward()
    states = [m.state_dict() for m in models]
    for k in (k for k in states[1] if ".ebc." in f".{k}" and k.endswith("weight")):
        torch.testing.assert_close(full_weight(states[0][k]), full_weight(states[1][k]), atol=1e-5, rtol=1e-5)
    return _types(plan), shape


def test_readme_composition_trains_like_stock_on_two_ranks():
    results = run_ranks(_readme_composition, WORLD, timeout=180)
    types, shape = results[0]
    assert results[1][0] == types
    assert types["b0"] == FREQUENCY_HYBRID and types["e0"] != FREQUENCY_HYBRID and types["p0"] != FREQUENCY_HYBRID
    assert shape == (4, 8 * 4)
