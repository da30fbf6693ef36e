"""``ShardedEmbeddingBagCollection`` that knows the frequency-hybrid sharding type.

Adds to the stock module: building the hybrid sharding, MEAN-pooling wiring (hybrid
features are divided in their own output dist, never by SEBC's callback), and a per-step
id check that fails on every rank at once.
"""

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionContext, ShardedEmbeddingBagCollection
from torchrec.distributed.types import ParameterSharding, QuantizedCommCodecs, ShardingEnv
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_hybrid import _compat
from torchrec_hybrid.planner.types import HybridParameterSharding
from torchrec_hybrid.sharding.hybrid_sharding import HybridPooledEmbeddingSharding
from torchrec_hybrid.sharding.input_dist import (
    ID_REPORT_WORDS,
    HybridInputDistAwaitable,
    HybridLookupInput,
    id_report_words,
    id_reports_from_words,
)
from torchrec_hybrid.sharding.lookup import HybridLookup
from torchrec_hybrid.types import FREQUENCY_HYBRID, HotIds, collective_device, normalize_hot_ids

logger = logging.getLogger(__name__)


class InvalidIdError(ValueError):
    """An input id is negative or >= num_embeddings of its table (raised on every rank)."""


@dataclass
class IdCheck:
    """One step's id check, from the input dist to the lookups.

    keys: the features the reports' key index refers to.
    report: this rank's int64 ``[flag, key index, value]`` (the first bad id; zeros: none).
    carried: every rank's report rides the hybrid cold metadata and arrives in the lookup
        input (:attr:`HybridLookupInput.id_reports`).
    gathered / work: otherwise the async all-gather of every rank's report (None on one rank).
    """

    keys: Tuple[str, ...]
    report: torch.Tensor
    carried: bool = False
    gathered: Optional[torch.Tensor] = None
    work: Optional[dist.Work] = None

    def reports(self, dist_input: List[Any]) -> torch.Tensor:
        """Every rank's int64 report ``[W, 3]`` (waits for them if they are still on the way)."""
        if self.carried:
            words = next(x for x in dist_input if isinstance(x, HybridLookupInput)).id_reports
            assert words is not None  # carried: the cold metadata brought every rank's report
            return id_reports_from_words(words)
        if self.work is not None:
            self.work.wait()
        return (self.report if self.gathered is None else self.gathered).view(-1, 3)


@dataclass
class HybridEmbeddingBagCollectionContext(EmbeddingBagCollectionContext):
    """The stock context plus the step's id check (set in input_dist, settled before lookups)."""

    id_check: Optional[IdCheck] = None

    def record_stream(self, stream: torch.Stream) -> None:
        super().record_stream(stream)
        if self.id_check is not None and self.id_check.gathered is not None:  # the report is a host tensor
            self.id_check.gathered.record_stream(stream)


def _with_hot_ids(plan: Mapping[str, ParameterSharding], hot_ids: Mapping[str, torch.Tensor]
                  ) -> Dict[str, ParameterSharding]:
    """``plan`` with each hybrid table's entry a :class:`HybridParameterSharding` carrying its
    validated hot ids: how they reach ``create_embedding_bag_sharding`` (in the sharding infos)."""
    out = dict(plan)
    for name, ids in hot_ids.items():
        ps = plan[name]
        if isinstance(ps, HybridParameterSharding):
            out[name] = dataclasses.replace(ps, hot_ids=ids)
        else:
            base = {f.name: getattr(ps, f.name) for f in dataclasses.fields(ps)}
            out[name] = HybridParameterSharding(**base, hot_ids=ids, hot_rows=int(ids.numel()))
    return out


class HybridShardedEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """A SEBC whose plan may place tables as ``frequency_hybrid`` beside stock types.

    Args (beyond the stock ones):
        hot_ids: hot row ids per table name (validated collectively here).
        validate_ids: check every input id against its table size each step (one tiny
            all-gather) so bad ids raise on all ranks instead of crashing or hanging one.
    """

    def __init__(self, module, table_name_to_parameter_sharding, env: ShardingEnv,
                 fused_params: Optional[Dict[str, Any]] = None, device: Optional[torch.device] = None,
                 qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
                 module_fqn: Optional[str] = None, hot_ids: Optional[HotIds] = None,
                 validate_ids: bool = True) -> None:
        configs = module.embedding_bag_configs()
        hybrid = [c for c in configs if table_name_to_parameter_sharding[c.name].sharding_type == FREQUENCY_HYBRID]
        # A plan may carry the hot ids itself (``HybridParameterSharding.hot_ids``): it wins.
        hot_ids = dict(hot_ids or {})
        for c in hybrid:
            planned = getattr(table_name_to_parameter_sharding[c.name], "hot_ids", None)
            if planned is not None:
                hot_ids[c.name] = planned
        checked = normalize_hot_ids(hot_ids, hybrid, env.process_group) if hybrid else {}
        super().__init__(module, _with_hot_ids(table_name_to_parameter_sharding, checked), env,
                         fused_params=fused_params, device=device, qcomm_codecs_registry=qcomm_codecs_registry,
                         module_fqn=module_fqn)
        _compat.sebc_fix_mean_pooling(self)
        self._validate_ids = validate_ids
        # the id-check verdicts ride the hybrid cold metadata all-to-all when there is one
        self._carry_id_check = validate_ids and bool(hybrid)
        self._check_pg = env.process_group
        self._rows_by_feature = {f: c.num_embeddings for c in configs for f in c.feature_names}
        self._table_by_feature = {f: c.name for c in configs for f in c.feature_names}
        self._limit_cache: Dict[tuple, torch.Tensor] = {}
        self._no_report = torch.zeros(3, dtype=torch.int64)
        self._no_report_words = torch.zeros(ID_REPORT_WORDS, dtype=torch.int32)
        for c in hybrid:
            logger.info("table %s: frequency_hybrid with %d hot rows of %d", c.name,
                        checked[c.name].numel(), c.num_embeddings)

    def create_embedding_bag_sharding(self, sharding_infos: List[EmbeddingShardingInfo], env: ShardingEnv,
                                      device: Optional[torch.device] = None, permute_embeddings: bool = False,
                                      qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None):
        if sharding_infos[0].param_sharding.sharding_type == FREQUENCY_HYBRID:
            hot_ids = {i.embedding_config.name: i.param_sharding.hot_ids for i in sharding_infos}
            return HybridPooledEmbeddingSharding(sharding_infos, env, device, hot_ids,
                                                 qcomm_codecs_registry=qcomm_codecs_registry)
        return super().create_embedding_bag_sharding(sharding_infos, env, device, permute_embeddings,
                                                     qcomm_codecs_registry)

    def create_context(self) -> HybridEmbeddingBagCollectionContext:
        return HybridEmbeddingBagCollectionContext()

    def hybrid_lookups(self) -> List[HybridLookup]:
        return [lk for lk in _compat.sebc_lookups(self) if isinstance(lk, HybridLookup)]

    def refresh_hot_replicas(self) -> None:
        """Nothing to do: the replicas are re-sent by the rows' owners in every forward."""

    def input_dist(self, ctx: HybridEmbeddingBagCollectionContext, features: KeyedJaggedTensor):
        if self._validate_ids and isinstance(features, KeyedJaggedTensor):
            features, ctx.id_check = self._start_id_check(features)
        splits = super().input_dist(ctx, features)
        if self._carry_id_check:  # the cold all-to-all starts now, carrying the report
            words = self._no_report_words if ctx.id_check is None else id_report_words(ctx.id_check.report)
            for awaitable in splits.awaitables:
                if isinstance(awaitable, HybridInputDistAwaitable):
                    awaitable.start(words)
        return splits

    def compute_and_output_dist(self, ctx: HybridEmbeddingBagCollectionContext, input):
        self._finish_id_check(ctx, input)  # before any lookup: a rejected batch changes nothing
        return super().compute_and_output_dist(ctx, input)

    @record_function("## hybrid:id_check ##")
    def _start_id_check(self, features: KeyedJaggedTensor) -> Tuple[KeyedJaggedTensor, IdCheck]:
        """Checks ids locally and starts sending the verdict to every rank.

        With a frequency-hybrid sharding the verdict rides its cold metadata (no collective
        of its own; :meth:`input_dist` hands it over); else an async all-gather overlaps the
        input all-to-alls. Either way it is read before the lookups. Bad ids are replaced by
        0 meanwhile so the dists stay in step.
        """
        keys = tuple(features.keys())
        values = features.values()
        limit = self._limit_cache.get((keys, values.dtype))
        if limit is None:  # largest valid id per key (ids of unknown keys are not checked)
            top = torch.iinfo(values.dtype).max
            limit = torch.tensor([min(self._rows_by_feature.get(k, top + 1) - 1, top) for k in keys],
                                 dtype=values.dtype, device=values.device)
            self._limit_cache[(keys, values.dtype)] = limit
        counts = torch.tensor(features.length_per_key(), device=values.device)
        limit_of_value = torch.repeat_interleave(limit, counts, output_size=values.numel())
        check = IdCheck(keys=keys, report=self._no_report, carried=self._carry_id_check)
        if not torch.equal(torch.minimum(values.clamp(min=0), limit_of_value), values):  # rare path
            bad = (values < 0) | (values > limit_of_value)
            i = int(bad.nonzero()[0])
            key = int(torch.searchsorted(torch.cumsum(counts, 0), i, right=True))
            check.report = torch.tensor([1, key, int(values[i])], dtype=torch.int64)
            features = KeyedJaggedTensor(keys=list(keys), values=torch.where(bad, torch.zeros_like(values), values),
                                         weights=features.weights_or_none(), lengths=features.lengths(),
                                         stride=features.stride())
        pg = self._check_pg
        if not check.carried and pg is not None and dist.get_world_size(pg) > 1:
            dev = collective_device(pg)
            check.gathered = torch.empty(dist.get_world_size(pg) * 3, dtype=torch.int64, device=dev)
            check.work = dist.all_gather_into_tensor(check.gathered, check.report.to(dev), group=pg,
                                                     async_op=True)
        return features, check

    def _finish_id_check(self, ctx: HybridEmbeddingBagCollectionContext, input) -> None:
        check, ctx.id_check = ctx.id_check, None
        if check is None:
            return
        reports = check.reports(input).cpu()
        if int(reports[:, 0].sum()) == 0:
            return
        msgs = []
        for r in reports[:, 0].nonzero().view(-1).tolist():  # only on the error path
            f = check.keys[int(reports[r, 1])]
            msgs.append(f"rank {r}: feature '{f}' (table '{self._table_by_feature.get(f, '?')}') has id "
                        f"{int(reports[r, 2])} outside [0, {self._rows_by_feature.get(f, '?')})")
        raise InvalidIdError("invalid embedding ids, batch rejected before any lookup or update: "
                             + "; ".join(msgs))


def refresh_hot_replicas(model: torch.nn.Module) -> None:
    """Kept for callers of earlier versions; a no-op now.

    The hot replicas are copies the rows' owners send in every forward (their only home is
    the cold shard, which ``load_state_dict`` and ``torch.distributed.checkpoint.load``
    write), so a load can never leave them stale.
    """
    for m in model.modules():
        if isinstance(m, HybridShardedEmbeddingBagCollection):
            m.refresh_hot_replicas()
