"""``ShardedEmbeddingBagCollection`` that knows the frequency-hybrid sharding type.

Adds to the stock module: building the hybrid sharding, MEAN-pooling wiring (hybrid
features are divided in their own output dist, never by SEBC's callback), the refusal of
options a hybrid table cannot honour, and the per-step input check (``input_check.py``;
``validate_ids``: by default in modules that hold frequency_hybrid tables, whose dists index
by id, so a module of stock tables alone runs exactly as TorchRec's), whose verdicts ride the
hybrid cold ids' headers and are read before any lookup.
"""

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionContext, ShardedEmbeddingBagCollection
from torchrec.distributed.types import ParameterSharding, QuantizedCommCodecs, ShardingEnv
from torchrec.distributed.utils import add_params_from_parameter_sharding
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.sparse.tensor_dict import maybe_td_to_kjt
from torchrec.types import DataType

from torchrec_hybrid import _compat
from torchrec_hybrid.input_check import IdCheck, InputCheck, MalformedBatchError, exchange_reports
from torchrec_hybrid.sharding.cold_all_to_all import ColdIdsAllToAll
from torchrec_hybrid.sharding.hybrid_sharding import HybridPooledEmbeddingSharding
from torchrec_hybrid.sharding.input_dist import (
    ID_REPORT_WORDS,
    HybridInputDistAwaitable,
    id_report_words,
)
from torchrec_hybrid.sharding.output_dist import describe_codec_problems
from torchrec_hybrid.sharding import variable_batch
from torchrec_hybrid.types import (FREQUENCY_HYBRID, HotIds, HotSetError, HybridParameterSharding, normalize_hot_ids)

logger = logging.getLogger(__name__)


@dataclass
class HybridEmbeddingBagCollectionContext(EmbeddingBagCollectionContext):
    """The stock context plus the step's id check (set in input_dist, settled before lookups)."""

    id_check: Optional[IdCheck] = None
    # the error the step was rejected with: a second compute_and_output_dist on this context raises it
    # again instead of looking up the batch (its ids may be out of range; the TBEs do not check them)
    rejected: Optional[Exception] = None

    def record_stream(self, stream: torch.Stream) -> None:
        super().record_stream(stream)
        if self.id_check is not None and self.id_check.gathered is not None:  # the report is a host tensor
            self.id_check.gathered.record_stream(stream)


_UNVERIFIED_DECAY_MODES = ("COUNTER", "COWCLIP", "DECOUPLE_GLOBAL")
# The fused optimizers a frequency_hybrid table trains with exactly like table_wise (outputs, weights
# and optimizer state after several steps, tests/test_sharded_ebc_equivalence.py). Every other one is
# refused: FBGEMM's CPU kernels run no other non-deprecated optimizer, so none could be verified here,
# and on CUDA it would run unverified.
VERIFIED_OPTIMIZERS = (EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD, EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                       EmbOptimType.EMAINPLACE_ROWWISE_ADAGRAD)


def unsupported_fused_options(params: Mapping[str, Any]) -> List[str]:
    """Fused TBE options a frequency_hybrid table would ignore or apply differently, described."""
    out = []
    opt = params.get("optimizer")
    if opt is not None and opt not in VERIFIED_OPTIMIZERS:
        out.append(f"optimizer={getattr(opt, 'name', opt)} (not verified to train like table_wise; verified: "
                   f"{', '.join(o.name for o in VERIFIED_OPTIMIZERS)})")
    dtype = params.get("output_dtype")
    if dtype is not None and dtype not in (SparseType.FP32, torch.float32, DataType.FP32):
        out.append(f"output_dtype={dtype} (the hybrid output dist adds fp32 hot pooling to the partial sums; "
                   "only FP32 output is supported)")
    if params.get("gradient_clipping"):
        out.append("gradient_clipping=True (FBGEMM clips per bag; a hot row reaches its owner's TBE as one bag "
                   "carrying every rank's summed gradient, so it would be clipped differently)")
    mode = params.get("weight_decay_mode")
    if mode is not None and getattr(mode, "name", str(mode)) in _UNVERIFIED_DECAY_MODES:
        out.append(f"weight_decay_mode={getattr(mode, 'name', mode)} (per-row counters/regularisation see a hot "
                   "row as one pre-aggregated bag per step; not verified against stock)")
    for key in ("counter_based_regularization", "cowclip_regularization"):
        if params.get(key) is not None:
            out.append(f"{key} (see weight_decay_mode)")
    return out


def check_hybrid_supported(configs: List[Any], plan: Mapping[str, ParameterSharding],
                           fused_params: Optional[Dict[str, Any]],
                           qcomm_codecs_registry: Optional[Mapping[str, QuantizedCommCodecs]]) -> None:
    """Refuses (``ValueError``) what a frequency_hybrid table in ``plan`` cannot honour yet:
    quantized-comm codecs other than FP16 / BF16 / FP32 on its output all-to-all
    (``output_dist.codec_problems``), a compute kernel other than ``fused`` (UVM / caching / key-value), and
    the fused options of :func:`unsupported_fused_options` (from the sharder's fused params
    or the plan's per-table ones). Deterministic on every rank; raised before any collective.
    (An empty cold row block is refused where the layout is read: ``row_blocks.check_bounds``.)"""
    hybrid = [c.name for c in configs if plan[c.name].sharding_type == FREQUENCY_HYBRID]
    if not hybrid:
        return
    problems = []
    codecs = describe_codec_problems(qcomm_codecs_registry)
    if codecs is not None:
        problems.append(f"tables {hybrid}: {FREQUENCY_HYBRID} cannot honour quantized comms {codecs}; use FP16, "
                        "BF16 or FP32 codecs for POOLED_EMBEDDINGS_ALL_TO_ALL, or a stock sharding type for "
                        "these tables")
    for name in hybrid:
        ps = plan[name]
        if ps.compute_kernel != EmbeddingComputeKernel.FUSED.value:
            problems.append(f"table '{name}': compute kernel {ps.compute_kernel!r} is not supported by "
                            f"{FREQUENCY_HYBRID} (only 'fused'; no UVM / caching / key-value kernels)")
        for what in unsupported_fused_options(add_params_from_parameter_sharding(dict(fused_params or {}), ps)):
            problems.append(f"table '{name}': fused option {what} is not supported by {FREQUENCY_HYBRID}")
    if problems:
        raise ValueError("; ".join(problems))


def without_redundant_bounds_check(fused_params: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """``fused_params`` for the kernels of a module whose input check is on: FBGEMM's per-call
    ``bounds_check_indices`` off (``BoundsCheckMode.NONE``) unless the user set a mode. The
    check already refuses, on every rank before any lookup, every id outside its table and
    every malformed batch, so the TBE's own pass over the ids and offsets could find nothing;
    it is per-id work on every lookup (every rank's, and the hybrid cold lanes' per virtual
    feature). A plan's per-table ``bounds_check_mode`` still wins (TorchRec's
    ``add_params_from_parameter_sharding``)."""
    params = dict(fused_params or {})
    params.setdefault("bounds_check_mode", BoundsCheckMode.NONE)
    return params


def _with_hot_ids(plan: Mapping[str, ParameterSharding], hot_ids: Mapping[str, torch.Tensor]
                  ) -> Dict[str, ParameterSharding]:
    """``plan`` with each hybrid table's entry a :class:`HybridParameterSharding` carrying its
    validated hot ids: how they reach ``create_embedding_bag_sharding`` (in the sharding infos)."""
    out = dict(plan)
    for name, ids in hot_ids.items():
        ps = plan[name]
        if isinstance(ps, HybridParameterSharding):
            out[name] = dataclasses.replace(ps, hot_ids=ids, hot_rows=int(ids.numel()))
        else:
            out[name] = HybridParameterSharding.from_stock(ps, hot_ids=ids, hot_rows=int(ids.numel()))
    return out


class HybridShardedEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """A SEBC whose plan may place tables as ``frequency_hybrid`` beside stock types.

    Args (beyond the stock ones):
        hot_ids: hot row ids per table name (validated collectively here).
        validate_ids: check each rank's batch every step - its structure and every id
            against its table size - and raise on all ranks instead of crashing or hanging
            one (the verdicts ride the header of the hybrid cold ids' all-to-all; see the module
            docstring); the module's TBEs then skip FBGEMM's own bounds check
            (:func:`without_redundant_bounds_check`). None (default): where the module holds a
            frequency_hybrid table (a module of stock tables alone then runs exactly as TorchRec's);
            True: every module (one without hybrid tables sends its verdicts in one small all-to-all
            of their own each step); False: no input check (the weights' neither).
        validate_weights: with ``validate_ids``, also reject NaN / infinite per-sample
            weights (one pass over the weights; False skips it).
    """

    def __init__(self, module, table_name_to_parameter_sharding, env: ShardingEnv,
                 fused_params: Optional[Dict[str, Any]] = None, device: Optional[torch.device] = None,
                 qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
                 module_fqn: Optional[str] = None, hot_ids: Optional[HotIds] = None,
                 validate_ids: Optional[bool] = None, validate_weights: bool = True) -> None:
        configs = module.embedding_bag_configs()
        check_hybrid_supported(configs, table_name_to_parameter_sharding, fused_params, qcomm_codecs_registry)
        hybrid = [c for c in configs if table_name_to_parameter_sharding[c.name].sharding_type == FREQUENCY_HYBRID]
        validate_ids = bool(hybrid) if validate_ids is None else validate_ids
        # A plan may carry the hot ids itself (``HybridParameterSharding.hot_ids``): it wins.
        hot_ids = dict(hot_ids or {})
        for c in hybrid:
            planned = getattr(table_name_to_parameter_sharding[c.name], "hot_ids", None)
            if planned is not None:
                hot_ids[c.name] = planned
        checked = normalize_hot_ids(hot_ids, hybrid, env.process_group) if hybrid else {}
        if validate_ids:
            fused_params = without_redundant_bounds_check(fused_params)
        super().__init__(module, _with_hot_ids(table_name_to_parameter_sharding, checked), env,
                         fused_params=fused_params, device=device, qcomm_codecs_registry=qcomm_codecs_registry,
                         module_fqn=module_fqn)
        _compat.sebc_fix_mean_pooling(self)
        self._validate_ids = validate_ids
        self._hybrid_configs = list(hybrid)
        # the id-check verdicts ride the header of the hybrid cold ids' all-to-all when there is one
        self._carry_id_check = validate_ids and bool(hybrid)
        self._has_hybrid = bool(hybrid)
        self._check_pg = env.process_group
        self._input_check = InputCheck(configs, table_name_to_parameter_sharding, env.process_group,
                                       self._carry_id_check, bool(module.is_weighted()), validate_weights)
        self._no_report_words = torch.zeros(ID_REPORT_WORDS, dtype=torch.int32)
        self._table_shapes = {c.name: (c.num_embeddings, c.embedding_dim) for c in configs}
        _compat.add_first_load_state_dict_pre_hook(self, self._check_table_shapes)
        for c in hybrid:
            logger.info("table %s: frequency_hybrid with %d hot rows of %d", c.name,
                        checked[c.name].numel(), c.num_embeddings)

    def _check_table_shapes(self, module, state_dict, prefix, *args) -> None:
        """Refuses a whole (plain tensor) table of another shape before any rank slices it into its
        shards: TorchRec's pre-hook would cut its own block out of it, so one rank would load a
        wrong-sized table silently and another fail, or every rank load a corner of it. Every rank
        holds the same full tensor, so every rank raises (``ValueError``), nothing loaded. Runs
        as the first load_state_dict pre-hook (``__init__``)."""
        bad = [f"'{prefix}embedding_bags.{name}.weight' has shape {tuple(t.shape)}, the table is {shape}"
               for name, shape in self._table_shapes.items()
               for t in [state_dict.get(f"{prefix}embedding_bags.{name}.weight")]
               if type(t) in (torch.Tensor, torch.nn.Parameter) and tuple(t.shape) != shape]
        if bad:
            raise ValueError("load_state_dict: " + "; ".join(bad) + " (rows x dim of its EmbeddingBagConfig); no "
                             "table was loaded")

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

    def _hybrid_shardings(self) -> List[HybridPooledEmbeddingSharding]:
        return [s for s in _compat.sebc_shardings(self) if isinstance(s, HybridPooledEmbeddingSharding)]

    def cold_exchanges(self) -> List[ColdIdsAllToAll]:
        """The cold ids' all-to-all of every hybrid input dist: the pairs' rooms for the next step
        (``rooms``; None on one rank, where nothing travels) and how many steps outgrew them (``spills``:
        each took a second all-to-all)."""
        return [c for s in self._hybrid_shardings() for c in s.cold_exchanges()]

    def hot_ids(self) -> Dict[str, torch.Tensor]:
        """The current sorted hot ids of every frequency_hybrid table."""
        out: Dict[str, torch.Tensor] = {}
        for s in self._hybrid_shardings():
            out.update(s.hot_ids())
        return out

    def refresh_hot_ids(self, hot_ids: HotIds) -> None:
        """Switches the hot sets of some or all hybrid tables, from the next step on.

        Collective: call it on every rank at the same step boundary with the same ids (they
        are checked on every rank like the planned ones: range, duplicates, equal across
        ranks; a problem raises :class:`HotSetError` on every rank). No weights or optimizer
        state move - every row lives in its owner's cold shard whatever the hot set - so
        training continues exactly as before, and a batch already in flight (a pipeline's
        next input) finishes with the set it was split by (sharding/hot_state.py).
        """
        known = {c.name for c in self._hybrid_configs}
        unknown = sorted(set(hot_ids) - known)
        if unknown:
            raise HotSetError(f"refresh_hot_ids: {unknown} are not frequency_hybrid tables of this module "
                              f"(its hybrid tables: {sorted(known)})")
        configs = [c for c in self._hybrid_configs if c.name in hot_ids]
        checked = normalize_hot_ids(hot_ids, configs, self._check_pg)
        for s in self._hybrid_shardings():
            mine = set(s.hot_ids())
            s.refresh({n: ids for n, ids in checked.items() if n in mine})

    def input_dist(self, ctx: HybridEmbeddingBagCollectionContext, features: KeyedJaggedTensor):
        if self._validate_ids and not isinstance(features, KeyedJaggedTensor):
            # a TensorDict batch (TorchRec's input_dist takes one): as TorchRec converts it, so the check
            # sees its ids (the TBEs' own bounds check is off while the check is on)
            features = maybe_td_to_kjt(features)
        problem, check = None, self._input_check
        if self._has_hybrid and isinstance(features, KeyedJaggedTensor) and features.variable_stride_per_key():
            keys, (features, found) = features.keys(), variable_batch.expand_variable_batch(features)
            if found is not None:
                problem = check.variable_batch_problem(keys, found)
                if not self._validate_ids:
                    raise MalformedBatchError(f"this rank: {check.describe(*problem)}")
        if self._validate_ids and isinstance(features, KeyedJaggedTensor):
            features, ctx.id_check = check.start(features, problem)
        if check.reference_keys is None and isinstance(features, KeyedJaggedTensor):
            check.reference_keys = tuple(features.keys())
        splits = super().input_dist(ctx, features)
        step, pg = ctx.id_check, self._check_pg
        if step is not None and not step.carried and pg is not None and dist.get_world_size(pg) > 1:
            # no hybrid table carries the verdicts: a small all-to-all of their own (every rank alike)
            step.gathered, step.work = exchange_reports(step.report, pg)
        if self._carry_id_check:  # the cold all-to-all starts now, carrying the report
            words = self._no_report_words if ctx.id_check is None else id_report_words(ctx.id_check.report)
            for awaitable in splits.awaitables:
                if isinstance(awaitable, HybridInputDistAwaitable):
                    awaitable.start(words)
        return splits

    def compute_and_output_dist(self, ctx: HybridEmbeddingBagCollectionContext, input):
        self._finish_id_check(ctx, input)  # before any lookup: a rejected batch changes nothing
        return super().compute_and_output_dist(ctx, input)

    def _finish_id_check(self, ctx: HybridEmbeddingBagCollectionContext, input) -> None:
        """Raises the step's error on every rank where some rank's batch was bad (again, where the
        step is retried on the same context: its ids may be out of range and the TBEs check none)."""
        if ctx.rejected is not None:
            raise ctx.rejected
        step, ctx.id_check = ctx.id_check, None
        if step is None:
            return
        shardings = self._hybrid_shardings()
        ctx.rejected = self._input_check.finish(step, input, shardings[0].hybrid_pg if shardings else None)
        if ctx.rejected is not None:
            raise ctx.rejected

def refresh_hot_sets(model: torch.nn.Module, stats: Any = None, hot_ids: Optional[HotIds] = None) -> Dict[str, int]:
    """Re-chooses the hot sets of every frequency_hybrid table in ``model`` (a DMP or any
    module holding hybrid sharded EBCs). Collective: every rank, same step, same inputs.

    ``hot_ids`` sets them explicitly; else ``stats`` (a ``FrequencyStats``, identical on
    every rank, e.g. decayed and merged with ``all_reduce_``) gives each table its most
    frequent rows, as many as it has now (the planned hot-row memory stays as planned); a
    hybrid table the statistics do not count keeps its set (logged). ``hot_ids`` naming a
    table that is not frequency_hybrid in ``model`` raise :class:`HotSetError` before any
    set changes. Returns per table how many of its hot ids are new (not hot before; a set of the
    same size, as ``stats`` gives, lost as many).
    """
    if (stats is None) == (hot_ids is None):
        raise ValueError("refresh_hot_sets: pass exactly one of stats and hot_ids")
    if stats is not None and not (callable(getattr(stats, "top_counts", None)) and hasattr(stats, "table_names")):
        raise TypeError(f"refresh_hot_sets: stats must be a FrequencyStats, not {type(stats).__name__}")
    modules = [m for m in model.modules() if isinstance(m, HybridShardedEmbeddingBagCollection)]
    hybrid = {name for m in modules for name in m.hot_ids()}
    # checked before any module changes (same verdict on every rank: the arguments are identical)
    unknown = sorted(set(hot_ids or ()) - hybrid)
    if unknown:
        raise HotSetError(f"refresh_hot_sets: {unknown} are not frequency_hybrid tables of the model "
                          f"(those are {sorted(hybrid)})")
    if stats is not None:
        uncounted = sorted(hybrid - set(stats.table_names))
        if uncounted:
            logger.warning("refresh_hot_sets: the statistics count no lookups of %s: their hot sets stay as they are",
                           uncounted)
    changed: Dict[str, int] = {}
    for m in modules:
        current = m.hot_ids()
        if hot_ids is not None:
            new = {n: torch.as_tensor(v) for n, v in hot_ids.items() if n in current}
        else:
            new = {}
            for name, ids in current.items():
                if name in stats.table_names:
                    top, _ = stats.top_counts(name, int(ids.numel()))
                    new[name] = torch.sort(top.to(torch.int64).cpu()).values
        m.refresh_hot_ids(new)
        after = m.hot_ids()
        for name in new:
            changed[name] = int((~torch.isin(after[name], current[name])).sum())  # entered (growing sets too)
    return changed
