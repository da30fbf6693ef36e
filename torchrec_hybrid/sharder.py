"""The sharder users hand to ``DistributedModelParallel``: stock types + ``frequency_hybrid``."""

import warnings
from typing import Any, Dict, List, Optional

import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ParameterSharding, QuantizedCommCodecs, ShardingEnv
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_hybrid.sharded_ebc import HybridShardedEmbeddingBagCollection
from torchrec_hybrid.stats.selection import resolve_hot_ids
from torchrec_hybrid.types import FREQUENCY_HYBRID, HotIds


class HybridEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """``EmbeddingBagCollectionSharder`` that also offers the frequency-hybrid type.

    Args:
        hot_ids: ``{table_name: 1-D int64 tensor of distinct row ids}`` replicated on every
            rank (tables missing here get no hot rows). Identical on all ranks.
        fused_params: FBGEMM fused optimizer settings, applied to hot and cold rows alike.
        qcomm_codecs_registry: as for the stock sharder. frequency_hybrid tables honour its
            ``POOLED_EMBEDDINGS_ALL_TO_ALL`` codecs on their output all-to-all (FP16 / BF16,
            forward and backward apart, like TorchRec's pooled all-to-all) and refuse others.
        stats / hot_set_rule: alternatively a ``FrequencyStats`` and a ``HotSetRule``, both
            (not with ``hot_ids``: ``ValueError``); the hot ids are then selected from them
            (deterministically, same on all ranks). A plan's own hot ids
            (``HybridParameterSharding``) win over the sharder's; a hybrid table left with none
            while the sharder names tables the module lacks gets a ``UserWarning``.
        validate_ids: per-step input check on all ranks: batch structure and id ranges (see
            the sharded module); it replaces FBGEMM's per-call bounds check (the TBEs get
            ``BoundsCheckMode.NONE`` unless ``fused_params`` or the plan set a mode). None
            (default): in modules holding frequency_hybrid tables, so a module the plan leaves
            all stock is sharded exactly as TorchRec's sharder does; True: in every module (a
            stock-only one's verdicts take one small all-to-all per step); False: none, and
            FBGEMM's default bounds check.
        validate_weights: with ``validate_ids``, also reject NaN / infinite per-sample weights.
        sharding_types: restrict the types offered (e.g. ``["frequency_hybrid"]``: the planner
            then gives this sharder's tables frequency_hybrid or raises); default: every stock
            type of ``EmbeddingBagCollectionSharder`` plus ``frequency_hybrid``.

    Refused at shard time (``ValueError``, on every rank, before any collective), for
    frequency_hybrid tables only: quantized comms other than FP16 / BF16 / FP32 (INT8, FP8,
    MX4; ``sharding/output_dist.py``), fused options that would be ignored or
    change the training (``sharded_ebc.check_hybrid_supported``). Within a
    ``FeatureProcessedEmbeddingBagCollection`` (whose sharder offers stock types only) a hand-written
    frequency_hybrid plan is refused at its first step, on every rank, when the feature processors read
    the hybrid lookup input (``sharding/input_dist.HybridLookupInput``): nothing TorchRec passes to
    ``shard`` tells an FPEBC's inner EBC from a plain one.
    """

    def __init__(self, hot_ids: Optional[HotIds] = None, fused_params: Optional[Dict[str, Any]] = None,
                 qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
                 stats: Any = None, hot_set_rule: Any = None, validate_ids: Optional[bool] = None,
                 validate_weights: bool = True, sharding_types: Optional[List[str]] = None) -> None:
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)
        if sharding_types is not None:
            known = set(super().sharding_types("cuda")) | set(super().sharding_types("cpu")) | {FREQUENCY_HYBRID}
            unknown = [t for t in sharding_types if t not in known]
            if unknown or not sharding_types:
                raise ValueError(f"sharding_types={list(sharding_types)}: not offered by an EmbeddingBagCollection "
                                 f"sharder: {unknown or 'empty list'}; known: {sorted(known)}")
        self._only_types = None if sharding_types is None else list(sharding_types)
        if hot_ids is not None and (stats is not None or hot_set_rule is not None):
            raise ValueError("pass either hot_ids or stats with a hot_set_rule, not both (hot_ids would win and "
                             "the rule be ignored)")
        if (stats is None) != (hot_set_rule is None):
            given, missing = ("stats", "hot_set_rule") if stats is not None else ("hot_set_rule", "stats")
            raise ValueError(f"{given} needs {missing}: the hot ids are selected by the rule from the statistics "
                             "(e.g. stats=FrequencyStats(...), hot_set_rule=HotSetRule(coverage=0.8))")
        if stats is not None:
            hot_ids = resolve_hot_ids(stats, hot_set_rule)
        self._hot_ids = dict(hot_ids) if hot_ids is not None else {}
        self._validate_ids = validate_ids
        self._validate_weights = validate_weights

    @property
    def hot_ids(self) -> Dict[str, torch.Tensor]:
        return self._hot_ids

    def sharding_types(self, compute_device_type: str) -> List[str]:
        types = super().sharding_types(compute_device_type) + [FREQUENCY_HYBRID]
        return types if self._only_types is None else [t for t in types if t in self._only_types]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        if sharding_type == FREQUENCY_HYBRID:
            return [EmbeddingComputeKernel.FUSED.value]
        return super().compute_kernels(sharding_type, compute_device_type)

    def shard(self, module: EmbeddingBagCollection, params: Dict[str, ParameterSharding], env: ShardingEnv,
              device: Optional[torch.device] = None, module_fqn: Optional[str] = None
              ) -> HybridShardedEmbeddingBagCollection:
        hybrid = sorted(n for n, ps in params.items() if ps.sharding_type == FREQUENCY_HYBRID)
        if hybrid:
            _warn_unmatched_hot_ids(self._hot_ids, module, params, hybrid)
        return HybridShardedEmbeddingBagCollection(
            module=module, table_name_to_parameter_sharding=params, env=env, fused_params=self.fused_params,
            device=device, qcomm_codecs_registry=self.qcomm_codecs_registry, module_fqn=module_fqn,
            hot_ids=self._hot_ids, validate_ids=self._validate_ids,
            validate_weights=self._validate_weights,
        )


def _warn_unmatched_hot_ids(hot_ids: Dict[str, Any], module: EmbeddingBagCollection,
                            params: Dict[str, ParameterSharding], hybrid: List[str]) -> None:
    """One warning when this module's frequency_hybrid tables get no hot ids (neither from the
    plan nor from the sharder) while the sharder holds hot ids for tables this module lacks: a
    misspelt name, most likely (they may also belong to another module this sharder shards)."""
    tables = {c.name for c in module.embedding_bag_configs()}
    elsewhere = sorted(set(hot_ids) - tables)
    bare = [n for n in hybrid if n not in hot_ids and getattr(params[n], "hot_ids", None) is None]
    if elsewhere and bare:
        warnings.warn(f"{FREQUENCY_HYBRID} tables {bare} get no hot ids (all their rows cold), while the sharder's "
                      f"hot_ids name tables this module does not have: {elsewhere} (its tables: {sorted(tables)}); "
                      "a misspelt table name?", UserWarning, stacklevel=3)
