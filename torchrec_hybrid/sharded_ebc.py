"""``ShardedEmbeddingBagCollection`` that knows the frequency-hybrid sharding type.

Adds to the stock module: building the hybrid sharding, MEAN-pooling wiring (hybrid
features are divided in their own output dist, never by SEBC's callback), and a per-step
id check that fails on every rank at once.
"""

import logging
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionContext, ShardedEmbeddingBagCollection
from torchrec.distributed.types import QuantizedCommCodecs, ShardingEnv
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_hybrid import _compat
from torchrec_hybrid.sharding.hybrid_sharding import HybridPooledEmbeddingSharding
from torchrec_hybrid.sharding.input_dist import HybridLookupInput, IdCheckCarrier
from torchrec_hybrid.sharding.lookup import HybridLookup
from torchrec_hybrid.types import FREQUENCY_HYBRID, HotIds, collective_device, normalize_hot_ids

logger = logging.getLogger(__name__)


class InvalidIdError(ValueError):
    """An input id is negative or >= num_embeddings of its table (raised on every rank)."""


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
        hybrid = [c for c in module.embedding_bag_configs()
                  if table_name_to_parameter_sharding[c.name].sharding_type == FREQUENCY_HYBRID]
        # A plan may carry the hot ids itself (``HybridParameterSharding.hot_ids``): it wins.
        hot_ids = dict(hot_ids or {})
        for c in hybrid:
            planned = getattr(table_name_to_parameter_sharding[c.name], "hot_ids", None)
            if planned is not None:
                hot_ids[c.name] = planned
        checked = normalize_hot_ids(hot_ids, hybrid, env.process_group) if hybrid else {}
        object.__setattr__(self, "_hybrid_hot_ids", checked)
        # the id-check verdicts ride the hybrid cold metadata all-to-all when there is one
        object.__setattr__(self, "_id_check_carrier", IdCheckCarrier() if validate_ids and hybrid else None)
        super().__init__(module, table_name_to_parameter_sharding, env, fused_params=fused_params,
                         device=device, qcomm_codecs_registry=qcomm_codecs_registry, module_fqn=module_fqn)
        stock_mean = set(self._pooling_type_to_rs_features.get("MEAN", []))
        _compat.sebc_fix_mean_pooling(self, stock_mean)
        self._validate_ids = validate_ids
        self._rows_by_feature = {f: c.num_embeddings for c in self._embedding_bag_configs for f in c.feature_names}
        self._table_by_feature = {f: c.name for c in self._embedding_bag_configs for f in c.feature_names}
        self._limit_cache: Dict[tuple, torch.Tensor] = {}
        self._no_report = torch.zeros(3, dtype=torch.int64)
        self._no_report_words = torch.zeros(IdCheckCarrier.WIDTH, dtype=torch.int32)
        for c in hybrid:
            logger.info("table %s: frequency_hybrid with %d hot rows of %d", c.name,
                        checked[c.name].numel(), c.num_embeddings)

    def create_embedding_bag_sharding(self, sharding_infos: List[EmbeddingShardingInfo], env: ShardingEnv,
                                      device: Optional[torch.device] = None, permute_embeddings: bool = False,
                                      qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None):
        if sharding_infos[0].param_sharding.sharding_type == FREQUENCY_HYBRID:
            return HybridPooledEmbeddingSharding(sharding_infos, env, device, self._hybrid_hot_ids,
                                                 qcomm_codecs_registry=qcomm_codecs_registry,
                                                 id_check=self._id_check_carrier)
        return super().create_embedding_bag_sharding(sharding_infos, env, device, permute_embeddings,
                                                     qcomm_codecs_registry)

    def hybrid_lookups(self) -> List[HybridLookup]:
        return [lk for lk in _compat.sebc_lookups(self) if isinstance(lk, HybridLookup)]

    def refresh_hot_replicas(self) -> None:
        """Nothing to do: the replicas are re-sent by the rows' owners in every forward."""

    def input_dist(self, ctx: EmbeddingBagCollectionContext, features: KeyedJaggedTensor):
        if self._validate_ids and isinstance(features, KeyedJaggedTensor):
            features = self._start_id_check(ctx, features)
        return super().input_dist(ctx, features)

    def compute_and_output_dist(self, ctx: EmbeddingBagCollectionContext, input):
        self._finish_id_check(ctx, input)  # before any lookup: a rejected batch changes nothing
        return super().compute_and_output_dist(ctx, input)

    @record_function("## hybrid:id_check ##")
    def _start_id_check(self, ctx, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """Checks ids locally and sends the verdict to every rank.

        With a frequency-hybrid sharding the verdict rides its cold metadata (no collective
        of its own); else an async all-gather overlaps the input all-to-alls. Either way it
        is read before the lookups. Bad ids are replaced by 0 meanwhile so the dists stay in
        step.
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
        report = self._no_report
        if not torch.equal(torch.minimum(values.clamp(min=0), limit_of_value), values):  # rare path
            bad = (values < 0) | (values > limit_of_value)
            i = int(bad.nonzero()[0])
            key = int(torch.searchsorted(torch.cumsum(counts, 0), i, right=True))
            report = torch.tensor([1, key, int(values[i])], dtype=torch.int64)
            features = KeyedJaggedTensor(keys=list(keys), values=torch.where(bad, torch.zeros_like(values), values),
                                         weights=features.weights_or_none(), lengths=features.lengths(),
                                         stride=features.stride())
        pg = self._env.process_group
        if self._id_check_carrier is not None:
            self._id_check_carrier.report = (self._no_report_words if report is self._no_report else
                                             torch.cat([report[:2].to(torch.int32), report[2:].view(torch.int32)]))
            ctx._hybrid_id_check = ("carried", None, keys)
        elif pg is None or dist.get_world_size(pg) == 1:
            ctx._hybrid_id_check = (None, report.view(1, 3), keys)
        else:
            dev = collective_device(pg)
            out = torch.empty(dist.get_world_size(pg) * 3, dtype=torch.int64, device=dev)
            work = dist.all_gather_into_tensor(out, report.to(dev), group=pg, async_op=True)
            ctx._hybrid_id_check = (work, out, keys)
        return features

    def _finish_id_check(self, ctx, input) -> None:
        pending = getattr(ctx, "_hybrid_id_check", None)
        if pending is None:
            return
        ctx._hybrid_id_check = None
        work, out, keys = pending
        if work == "carried":  # [flag, key, value low word, value high word] from every rank
            words = next(x for x in input if isinstance(x, HybridLookupInput)).id_reports
            out = torch.cat([words[:, :2].to(torch.int64), words[:, 2:].clone().view(torch.int64)], 1)
        elif work is not None:
            work.wait()
        reports = out.view(-1, 3).cpu()
        if int(reports[:, 0].sum()) == 0:
            return
        msgs = []
        for r in reports[:, 0].nonzero().view(-1).tolist():  # only on the error path
            f = keys[int(reports[r, 1])]
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
