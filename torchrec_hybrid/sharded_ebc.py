"""``ShardedEmbeddingBagCollection`` that knows the frequency-hybrid sharding type.

Adds to the stock module: building the hybrid sharding, MEAN-pooling wiring (hybrid
features are divided in their own output dist, never by SEBC's callback), and a per-step
input check that fails on every rank at once.

The input check (``validate_ids``: by default in modules that hold frequency_hybrid tables,
whose dists index by id; a module of stock tables alone is then exactly TorchRec's) looks at
each rank's batch before any collective: its structure (keys and their order against the first batch, which fixes the
stock feature permutation; lengths, values and weights sizes; weights present exactly when
the module is weighted; a variable batch per feature with hybrid tables is first expanded to
one batch by its inverse indices, ``sharding/variable_batch.py``), every bag length for a
negative one, every id against its table size, and (``validate_weights``) every per-sample weight for NaN / inf, on the
device without a host sync. A rank never raises on its own: it records its first problem in
its report (three int64 words, :func:`input_dist.id_report_words`) and goes on with a
harmless batch (empty when malformed; bad ids clamped into range, bad weights replaced by 0), so the step's
collectives complete; the reports ride the header of the hybrid cold ids' all-to-all (in a
module without hybrid tables whose check is asked for, one small all-to-all of their own) and
every rank raises the same
:class:`InvalidInputError` before any lookup or update, naming the rank, the feature and
the problem.
"""

import dataclasses
import logging
import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torch.autograd.profiler import record_function
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionContext, ShardedEmbeddingBagCollection
from torchrec.distributed.types import ParameterSharding, QuantizedCommCodecs, ShardingEnv, ShardingType
from torchrec.distributed.utils import add_params_from_parameter_sharding
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.sparse.tensor_dict import maybe_td_to_kjt
from torchrec.types import DataType

from torchrec_hybrid import _compat
from torchrec_hybrid.sharding.cold_all_to_all import ColdIdsAllToAll
from torchrec_hybrid.sharding.hybrid_sharding import HybridPooledEmbeddingSharding
from torchrec_hybrid.sharding.input_dist import (
    ID_REPORT_WORDS,
    HybridInputDistAwaitable,
    HybridLookupInput,
    id_report_words,
    id_reports_from_words,
)
from torchrec_hybrid.sharding.output_dist import describe_codec_problems
from torchrec_hybrid.sharding import fused, variable_batch
from torchrec_hybrid.sharding.segments import cached_tensor, host_to_device
from torchrec_hybrid.types import (FREQUENCY_HYBRID, HotIds, HotSetError, HybridParameterSharding, collective_device,
                                   normalize_hot_ids)

logger = logging.getLogger(__name__)


class InvalidInputError(ValueError):
    """A batch was rejected on every rank before any lookup or update (the base class)."""


class InvalidIdError(InvalidInputError):
    """An input id is negative or >= num_embeddings of its table (raised on every rank)."""


class InvalidWeightError(InvalidInputError):
    """A per-sample weight is NaN or infinite (raised on every rank)."""


class MalformedBatchError(InvalidInputError):
    """A rank's KJT is malformed: keys missing, unknown, repeated or reordered, sizes that do
    not add up, weights missing or unexpected (raised on every rank)."""


# Report codes (word 0 of a rank's report); word 1 and 2 as described per code.
_OK = 0
_BAD_ID = 1  # [feature, id]
_BAD_WEIGHT = 2  # [feature, float32 bits of the weight]
_MISSING_KEY = 3  # [feature, 0]
_UNKNOWN_KEY = 4  # [-(position + 1), name prefix]
_DUPLICATE_KEY = 5  # [feature or -(position + 1), name prefix]
_KEY_ORDER = 6  # [feature found, feature expected there]
_KEYS_CHANGED = 7  # [position, 0]: keys that are no feature moved or vanished
_VARIABLE_BATCH = 8  # [0, 0]: no inverse indices to expand it by
_LENGTHS_SIZE = 9  # [stride, lengths numel]
_VALUES_SIZE = 10  # [sum of lengths, values numel]
_WEIGHTS_MISSING = 11  # [0, 0]
_WEIGHTS_UNEXPECTED = 12  # [0, 0]
_WEIGHTS_SIZE = 13  # [values numel, weights numel]
_INVERSE_KEYS = 14  # [0, rows of the inverse indices]
_INVERSE_RANGE = 15  # [feature, the inverse index]
_NEGATIVE_LENGTH = 16  # [feature (-1: a key that is no feature), the length]
_TENSOR_SHAPE = 17  # [part (_PARTS), its number of dimensions]
_TENSOR_DTYPE = 18  # [part (_PARTS), its dtype (_DTYPES index, -1: another)]
_BAGS_SIZE = 19  # [sum of the per-key strides, lengths numel]: a variable batch per feature
# the batch's tensors the structure check reads, and what each must be: 1-D, of these dtypes
_PARTS = ("ids", "lengths", "per-sample weights")
_DTYPES = (torch.int32, torch.int64, torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
           torch.int16, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_ALLOWED = ("int32 or int64", "int32 or int64", "floating point")
# codes the device checks report bare: the rank that reports one finds the details on the error path
_SEARCHED = (_NEGATIVE_LENGTH, _BAD_ID, _BAD_WEIGHT)
_VARIABLE_PROBLEMS = {variable_batch.NO_INVERSE: _VARIABLE_BATCH, variable_batch.INVERSE_KEYS: _INVERSE_KEYS,
                      variable_batch.INVERSE_RANGE: _INVERSE_RANGE, variable_batch.BAGS_SIZE: _BAGS_SIZE}
# stock types whose input dist only moves ids (no bucketing by id): no clamp needed there
_ID_MOVING_TYPES = frozenset(t.value for t in (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE,
                                               ShardingType.TABLE_COLUMN_WISE, ShardingType.DATA_PARALLEL))
# kernels that read rows only in the lookup (no cache to prefetch into before it)
_PLAIN_KERNELS = frozenset(k.value for k in (EmbeddingComputeKernel.FUSED, EmbeddingComputeKernel.DENSE))
_NAME_BYTES = 7  # bytes of an unknown key's name carried in the report (plus its length)
_MESSAGES = {  # per code, the problem in words (HybridShardedEmbeddingBagCollection._describe fills them in)
    _BAD_ID: "{feature} has id {value} outside [0, {rows})",
    _BAD_WEIGHT: "{feature} has a non-finite per-sample weight ({weight})",
    _MISSING_KEY: "{feature} is missing from its batch's keys",
    _UNKNOWN_KEY: ("its batch has key {name} (position {position}), which is no feature of this module and was "
                   "not in its first batch"),
    _DUPLICATE_KEY: "{duplicate} appears more than once in its batch's keys",
    _KEY_ORDER: ("its batch's keys are in a different order than its first batch's (which fixed the feature "
                 "permutation): {feature} comes where '{other}' did"),
    _KEYS_CHANGED: "its batch's keys differ from its first batch's at position {index}",
    _VARIABLE_BATCH: ("its batch has a variable batch size per feature but no inverse_indices, which "
                      "frequency_hybrid needs to expand it to one batch"),
    _INVERSE_KEYS: ("its batch's inverse_indices ({value} rows) are not one row per key of the batch, in the "
                    "batch's key order"),
    _INVERSE_RANGE: "{feature} has inverse index {value}, not one of its bags in the batch (0 .. stride - 1)",
    _LENGTHS_SIZE: "its batch has {value} lengths, not (number of keys) x {index} samples",
    _VALUES_SIZE: "its batch's lengths add up to {index} but it has {value} values",
    _WEIGHTS_MISSING: "its batch has no per-sample weights but the module is weighted",
    _WEIGHTS_UNEXPECTED: "its batch has per-sample weights but the module is not weighted (is_weighted=False)",
    _WEIGHTS_SIZE: "its batch has {value} per-sample weights for {index} values",
    _NEGATIVE_LENGTH: "{feature} has a bag of negative length {value} in its batch",
    _BAGS_SIZE: "its batch has {value} lengths, not the {index} bags its per-key batch sizes add up to",
    _TENSOR_SHAPE: "its batch's {part} are a {value}-D tensor, not 1-D",
    _TENSOR_DTYPE: "its batch's {part} are {dtype}, not {allowed}",
}


def _bare_report(code: torch.Tensor) -> torch.Tensor:
    """A device check's report ``[code, 0, 0]`` from its int64 scalar ``code`` (a :data:`_SEARCHED` code's
    details are found on the error path): one multiply."""
    return code * cached_tensor((1, 0, 0), torch.int64, code.device)


def _pack_name(name: str) -> int:
    """The first bytes of ``name`` and its length in one int64 (unknown keys' names)."""
    raw = name.encode("utf-8")
    packed = int.from_bytes(raw[:_NAME_BYTES].ljust(_NAME_BYTES, b"\0"), "little") | (min(len(raw), 127) << 56)
    return packed


def _unpack_name(value: int) -> str:
    value &= (1 << 64) - 1
    n = value >> 56
    text = (value & ((1 << 56) - 1)).to_bytes(_NAME_BYTES, "little")[:min(n, _NAME_BYTES)]
    return repr(text.decode("utf-8", "replace") + ("..." if n > _NAME_BYTES else ""))


def exchange_reports(report: torch.Tensor, pg: dist.ProcessGroup) -> Tuple[torch.Tensor, dist.Work]:
    """Every rank's id-check report ``[code, index, value]`` in an all-to-all of its own, started
    asynchronously: ``(gathered [W * 3], work)``. One all-to-all round rather than an all-gather
    (gloo's takes W - 1 rounds)."""
    w, dev = dist.get_world_size(pg), collective_device(pg)
    gathered = torch.empty(w * 3, dtype=torch.int64, device=dev)
    work = dist.all_to_all_single(gathered, report.to(dev).repeat(w), group=pg, async_op=True)
    assert work is not None  # async_op=True
    return gathered, work


@dataclass
class IdCheck:
    """One step's id check, from the input dist to the lookups.

    report: this rank's int64 ``[code, index, value]`` (its first problem; zeros: none).
    carried: every rank's report rides the hybrid cold ids' header and arrives in the lookup
        input (:attr:`HybridLookupInput.id_reports`).
    gathered / work: otherwise (a module without hybrid tables, its check asked for) the async
        exchange of every rank's report, an all-to-all of its own (None on one rank), started in
        :meth:`input_dist` after the stock dists.
    batch: the batch as this rank got it, where a bad id or weight is searched for when
        some rank reports one.
    """

    report: torch.Tensor
    carried: bool = False
    gathered: Optional[torch.Tensor] = None
    work: Optional[dist.Work] = None
    batch: Optional[KeyedJaggedTensor] = None

    def reports(self, dist_input: List[Any]) -> List[List[int]]:
        """Every rank's report ``[code, index, value]`` (waits for them if they are still on
        the way). Carried ones are host data already (the cold exchange's one sync)."""
        if self.carried:
            words = next(x for x in dist_input if isinstance(x, HybridLookupInput)).id_reports
            assert words is not None  # carried: the cold ids' header brought every rank's report
            return id_reports_from_words(words)
        if self.work is not None:
            self.work.wait()
        return (self.report if self.gathered is None else self.gathered).view(-1, 3).tolist()


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


def unsupported_fused_options(params: Mapping[str, Any]) -> List[str]:
    """Fused TBE options a frequency_hybrid table would ignore or apply differently, described."""
    out = []
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
        self._validate_weights = validate_weights
        self._hybrid_configs = list(hybrid)
        # the id-check verdicts ride the header of the hybrid cold ids' all-to-all when there is one
        self._carry_id_check = validate_ids and bool(hybrid)
        self._has_hybrid = bool(hybrid)
        self._module_weighted = bool(module.is_weighted())
        self._check_pg = env.process_group
        self._rows_by_feature = {f: c.num_embeddings for c in configs for f in c.feature_names}
        self._table_by_feature = {f: c.name for c in configs for f in c.feature_names}
        self._feature_names = tuple(f for c in configs for f in c.feature_names)
        self._feature_index = {f: i for i, f in enumerate(self._feature_names)}
        # the keys of the first batch: the stock input dist fixes its feature permutation then
        self._reference_keys: Optional[Tuple[str, ...]] = None
        # per (keys, dtype, device): the id limits per key, and per id for the last lengths per key
        self._limit_cache: Dict[tuple, Tuple[tuple, Optional[Tuple[int, ...]], Optional[tuple]]] = {}
        # per (keys, batch size, ids per key, dtype, device): lengths that put each key's ids in its
        # last bag (what a batch with a negative length goes on with)
        self._length_cache: Tuple[tuple, Optional[torch.Tensor]] = ((), None)
        # input dists that index by id (row-wise bucketing, the hybrid's hot/cold split) and
        # caching kernels (a prefetch pipeline fills their caches before the verdict is read)
        # need ids in range even in a batch the check will reject; the others only move them
        self._ids_index_rows = bool(hybrid) or any(
            ps.sharding_type not in _ID_MOVING_TYPES or ps.compute_kernel not in _PLAIN_KERNELS
            for ps in table_name_to_parameter_sharding.values())
        self._no_report = torch.zeros(3, dtype=torch.int64)
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
        problem = None
        if self._has_hybrid and isinstance(features, KeyedJaggedTensor) and features.variable_stride_per_key():
            keys, (features, found) = features.keys(), variable_batch.expand_variable_batch(features)
            if found is not None:
                kind, index, value = found
                if kind == variable_batch.INVERSE_RANGE:  # the key's position -> the module's feature
                    index = self._feature_index.get(keys[index], -1)
                problem = [_VARIABLE_PROBLEMS[kind], index, value]
                if not self._validate_ids:
                    raise MalformedBatchError(f"this rank: {self._describe(*problem)}")
        if self._validate_ids and isinstance(features, KeyedJaggedTensor):
            features, ctx.id_check = self._start_id_check(features, problem)
        if self._reference_keys is None and isinstance(features, KeyedJaggedTensor):
            self._reference_keys = tuple(features.keys())
        splits = super().input_dist(ctx, features)
        check, pg = ctx.id_check, self._check_pg
        if check is not None and not check.carried and pg is not None and dist.get_world_size(pg) > 1:
            # no hybrid table carries the verdicts: a small all-to-all of their own (every rank alike)
            check.gathered, check.work = exchange_reports(check.report, pg)
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
    def _start_id_check(self, features: KeyedJaggedTensor, problem: Optional[List[int]] = None
                        ) -> Tuple[KeyedJaggedTensor, IdCheck]:
        """Checks the batch locally; :meth:`input_dist` sends the verdict to every rank.

        With a frequency-hybrid sharding the verdict rides its cold ids' header; else the split
        sizes of a stock input dist, or an all-to-all of its own
        (:meth:`_stock_input_dist_with_reports`). Either way it is read before the lookups. This
        rank never raises here (the others would wait in the step's collectives): a malformed
        batch is replaced by an empty one, bad ids by ids in range and bad weights by 0
        meanwhile, so the dists stay in step.
        """
        check = IdCheck(report=self._no_report, carried=self._carry_id_check)
        problem = problem or self._structure_problem(features)
        if problem is not None:
            check.report = torch.tensor(problem, dtype=torch.int64)
            features = self._placeholder(features)
        else:
            check.batch = features  # as it came: where the error path looks for what was wrong
            features, negative = self._check_lengths(features)
            features = self._check_values(features, check, negative)
        return features, check

    def _check_lengths(self, features: KeyedJaggedTensor) -> Tuple[KeyedJaggedTensor, Optional[torch.Tensor]]:
        """Every bag length at least 0 (the structure check compares only their sum with the values;
        a negative length makes a dist or a lookup read another bag's ids, past the batch's end, which
        FBGEMM's own bounds check - off while this check is on, :func:`without_redundant_bounds_check`
        - used to correct in the TBE). One reduction on the device, no host sync and no search (which
        length it was is looked for only when a rank reports one, :meth:`_first_value_problem`).
        Returns ``(features, negative)``: ``negative`` a bool scalar on the device (None: no lengths
        to check), and the batch with each key's ids in its last bag instead when a length is
        negative (valid for every dist; never looked up: every rank raises first), else as it is (a
        variable batch per key, which only stock dists move, goes on as it is)."""
        lengths = features.lengths()
        if lengths.numel() == 0:
            return features, None
        negative = lengths.min() < 0
        if features.variable_stride_per_key():  # no hybrid table (else expanded): stock dists only move ids
            return features, negative
        keys = tuple(features.keys())
        counts = tuple(features.length_per_key())
        cache_key = (keys, features.stride(), counts, lengths.dtype, lengths.device)
        if self._length_cache[0] != cache_key:
            fallback = torch.zeros(len(keys), features.stride(), dtype=lengths.dtype)
            if features.stride():
                fallback[:, -1] = torch.tensor(counts, dtype=lengths.dtype)  # set-up work, per keys and counts
            self._length_cache = (cache_key, fallback.view(-1).to(lengths.device))
        cached = self._length_cache[1]
        assert cached is not None
        safe = torch.where(negative, cached, lengths)
        return KeyedJaggedTensor(keys=list(keys), values=features.values(), weights=features.weights_or_none(),
                                 lengths=safe, stride=features.stride(), length_per_key=list(counts),
                                 offset_per_key=features.offset_per_key()), negative

    def _check_values(self, features: KeyedJaggedTensor, check: IdCheck,
                      negative: Optional[torch.Tensor] = None) -> KeyedJaggedTensor:
        """Every id against its table's size, every weight finite: vectorised and without a
        host sync, one clamp and one reduction and no search (which id it was is looked for only when a rank
        reports one, :meth:`_value_problems`). The verdict, with ``negative`` (whether a bag length
        is negative, :meth:`_check_lengths`: reported first), becomes ``check.report`` (on the
        device: ``[_NEGATIVE_LENGTH, 0, 0]``, ``[_BAD_ID, 0, 0]``, ``[_BAD_WEIGHT, 0, 0]`` or
        zeros). Where this module's input dists index by id (row-wise bucketing, the hybrid's
        hot/cold split) bad ids are clamped into range and bad weights replaced by 0, so the step
        runs on in step with the other ranks until the verdicts are read, before any lookup;
        table-wise, column-wise and data-parallel dists only move ids, so there the batch goes on
        as it is (no copy)."""
        values = features.values()
        if values.numel() == 0:
            if negative is not None:
                check.report = _bare_report(negative * _NEGATIVE_LENGTH)
            return features
        weights = features.weights_or_none()
        checked_weights = self._validate_weights and weights is not None and weights.is_floating_point()
        if fused.fused_on(values) and (not checked_weights or weights.dtype == torch.float32):
            # one pass, no copy unless some id or weight is out of range (fused.check_ids)
            limit, feature_of_key, _ = self._key_limits(features)
            code, checked, weights = fused.check_ids(values, limit, features.length_per_key(), feature_of_key,
                                                     weights, checked_weights)
        else:
            code, checked, weights = self._composed_check(features, checked_weights)
        if negative is not None:  # a malformed batch is reported before its ids
            code = torch.where(negative, _NEGATIVE_LENGTH, code)
        check.report = _bare_report(code)
        if not self._ids_index_rows or (checked is values and weights is features.weights_or_none()):
            return features
        return KeyedJaggedTensor(keys=list(features.keys()), values=checked, weights=weights,
                                 lengths=features.lengths(), offsets=features.offsets_or_none(),
                                 stride=features.stride(), length_per_key=features.length_per_key(),
                                 offset_per_key=features.offset_per_key())

    def _composed_check(self, features: KeyedJaggedTensor, checked_weights: bool):
        """:meth:`_check_values`' verdict from torch ops (the fused op's reference, and its path on other
        devices): ``(code, ids, weights)``, every id clamped into its table (a new tensor: the batch is the
        user's; an id it changed was outside) and, checked, every non-finite weight zeroed."""
        values, weights = features.values(), features.weights_or_none()
        limits, _, _, known = self._id_limits(features)
        checked = torch.clamp(values, cached_tensor(0, values.dtype, values.device), limits)
        if known is not None:  # ids of keys that are no feature are not checked and stay as they are
            checked = torch.where(known, checked, values)
        code = checked.ne(values).any() * _BAD_ID  # int64
        if checked_weights:
            assert weights is not None
            bad_weight = self._bad_weights(weights, known)
            code = torch.where(code != 0, code, bad_weight.any() * _BAD_WEIGHT)
            weights = torch.where(bad_weight, 0, weights)
        return code, checked, weights

    def _first_value_problem(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """This rank's first negative bag length (or, without one, first bad id, or first bad
        weight) as a report ``[code, feature, value]``: the error path's search (:meth:`_value_problems`)."""
        lengths = features.lengths()
        limits, feature_of_key, ends, known = self._id_limits(features)
        bags = features.stride_per_key() if features.variable_stride_per_key() else \
            [features.stride()] * len(features.keys())
        report = self._first_problem(lengths < 0, _NEGATIVE_LENGTH, lengths.to(torch.int64), feature_of_key,
                                     torch.tensor(bags, dtype=torch.int64, device=lengths.device).cumsum(0))
        if report[0] != 0:
            return report
        values = features.values()
        bad = (values > limits) | (values < 0)
        if known is not None:
            bad &= known
        report = self._first_problem(bad, _BAD_ID, values.to(torch.int64), feature_of_key, ends)
        weights = features.weights_or_none()
        if report[0] == 0 and weights is not None and weights.is_floating_point():
            bad_weight = self._bad_weights(weights, known)
            bits = weights.to(torch.float32).view(torch.int32).to(torch.int64)
            report = self._first_problem(bad_weight, _BAD_WEIGHT, bits, feature_of_key, ends)
        return report

    @staticmethod
    def _bad_weights(weights: torch.Tensor, known: Optional[torch.Tensor]) -> torch.Tensor:
        """Per weight, whether it is NaN or infinite (weights of keys that are no feature: never)."""
        bad = ~torch.isfinite(weights)
        return bad if known is None else bad & known

    @staticmethod
    def _first_problem(bad: torch.Tensor, code: int, value: torch.Tensor, feature_of_key: torch.Tensor,
                       ends: torch.Tensor) -> torch.Tensor:
        """``[code, feature, value]`` of the first True of ``bad`` (int64), or zeros when there
        is none; ``ends``: where each key's values end."""
        found, first = bad.max(0)  # the first True (documented), and whether there is one
        i = first.view(1)
        feature = feature_of_key.index_select(0, torch.searchsorted(ends, i, right=True))
        return torch.cat([torch.full_like(feature, code), feature, value.index_select(0, i)]) * found

    def _value_problems(self, check: IdCheck, reports: List[List[int]]) -> List[List[int]]:
        """Every rank's report with its bad id or weight found: each rank that reported one
        searches its batch, then one all-to-all on the group the reports came from gives every
        rank every rank's (collective: every rank of that group read the same verdicts, so every
        one comes here; a failed search sends the bare report rather than skip the exchange)."""
        # carried reports came with the hybrid cold exchange, on its group (2D: the sharding
        # sub-group); ridden or gathered ones on the module's group
        pg = self._hybrid_shardings()[0].hybrid_pg if check.carried else self._check_pg
        rank = dist.get_rank(pg) if pg is not None and dist.is_initialized() else 0
        mine = torch.tensor(reports[rank], dtype=torch.int64)
        if reports[rank][0] in _SEARCHED and check.batch is not None:
            try:
                mine = self._first_value_problem(check.batch)
            except Exception:  # e.g. a pipeline freed the batch's storage: the others still wait for ours
                logger.exception("searching this rank's batch for its bad id or weight failed")
        if pg is None or len(reports) == 1:
            return [mine.tolist()]
        gathered, work = exchange_reports(mine, pg)
        work.wait()
        return gathered.view(-1, 3).tolist()

    def _key_limits(self, features: KeyedJaggedTensor) -> Tuple[torch.Tensor, torch.Tensor, bool]:
        """Per key of ``features``, the largest valid id of its table (the ids' dtype) and its feature's index
        (-1: a key that is no feature), and whether every key is a feature; built once per keys, dtype, device."""
        keys, values = tuple(features.keys()), features.values()
        cache_key = (keys, values.dtype, values.device)
        cached = self._limit_cache.get(cache_key)
        if cached is None:
            top = torch.iinfo(values.dtype).max
            limit = torch.tensor([min(self._rows_by_feature.get(k, top + 1) - 1, top) for k in keys],
                                 dtype=values.dtype, device=values.device)
            features_of_keys = [self._feature_index.get(k, -1) for k in keys]
            feature_of_key = torch.tensor(features_of_keys, dtype=torch.int64, device=values.device)
            all_known = min(features_of_keys, default=0) >= 0
            cached = self._limit_cache[cache_key] = ((limit, feature_of_key, all_known), None, None)
        return cached[0]

    def _id_limits(self, features: KeyedJaggedTensor
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Per id of ``features``, the largest valid id of its table; per key, its feature's
        index (-1: a key that is no feature); where each key's ids end; per id, whether its key
        is a feature (None: all are). Per keys, dtype and device the per-key tensors are built
        once; the per-id ones are kept for the last lengths per key (fixed bag sizes, as one-hot
        and MLPerf's multi-hot batches have, expand them once)."""
        keys, values = tuple(features.keys()), features.values()
        counts = tuple(features.length_per_key())
        cache_key = (keys, values.dtype, values.device)
        limit, feature_of_key, all_known = self._key_limits(features)
        _, last_counts, expanded = self._limit_cache[cache_key]
        if last_counts == counts:
            assert expanded is not None
            return expanded
        lengths = host_to_device(counts, values.device)  # pinned and asynchronous on CUDA: no sync
        n = values.numel()
        known = None if all_known else torch.repeat_interleave(feature_of_key >= 0, lengths, output_size=n)
        expanded = (torch.repeat_interleave(limit, lengths, output_size=n), feature_of_key, torch.cumsum(lengths, 0),
                    known)
        self._limit_cache[cache_key] = ((limit, feature_of_key, all_known), counts, expanded)
        return expanded

    def _structure_problem(self, features: KeyedJaggedTensor) -> Optional[List[int]]:
        """This rank's first structural problem as a report ``[code, index, value]``, or None.

        Costs O(features) host work per step (no tensor op beyond the lengths' sizes and the
        per-key sums the id check reads anyway).
        """
        keys = tuple(features.keys())
        if keys != self._reference_keys:
            problem = self._key_problem(keys)
            if problem is not None:
                return problem
        tensors = (features.values(), features.lengths(), features.weights_or_none())
        for part, t in enumerate(tensors):  # the dists and kernels read 1-D int ids and lengths, float weights
            if t is None:
                continue
            if t.dim() != 1:
                return [_TENSOR_SHAPE, part, t.dim()]
            ok = t.is_floating_point() if part == 2 else t.dtype in (torch.int32, torch.int64)
            if not ok:
                return [_TENSOR_DTYPE, part, _DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1]
        if features.variable_stride_per_key():  # no hybrid table (else expanded): stock dists check it
            return None
        lengths = features.lengths()
        stride = features.stride()
        if lengths.numel() != len(keys) * stride:
            return [_LENGTHS_SIZE, stride, lengths.numel()]
        values = features.values()
        total = sum(features.length_per_key())
        if total != values.numel():
            return [_VALUES_SIZE, total, values.numel()]
        weights = features.weights_or_none()
        if (weights is not None) != self._module_weighted:
            return [_WEIGHTS_UNEXPECTED if weights is not None else _WEIGHTS_MISSING, 0, 0]
        if weights is not None and weights.numel() != values.numel():
            return [_WEIGHTS_SIZE, values.numel(), weights.numel()]
        return None

    def _key_problem(self, keys: Tuple[str, ...]) -> Optional[List[int]]:
        """Keys that differ from the first batch's (or, for the first batch, that miss a
        feature or repeat one). Only runs when the keys are not the first batch's."""
        idx, ref = self._feature_index, self._reference_keys
        if ref is not None:
            known_ref = set(ref)
            for p, k in enumerate(keys):
                if k not in idx and k not in known_ref:
                    return [_UNKNOWN_KEY, -(p + 1), _pack_name(k)]
        present = set(keys)
        for f in self._feature_names:
            if f not in present:
                return [_MISSING_KEY, idx[f], 0]
        if len(present) != len(keys):
            seen: set = set()
            for p, k in enumerate(keys):
                if k in seen:
                    return [_DUPLICATE_KEY, idx.get(k, -(p + 1)), _pack_name(k)]
                seen.add(k)
        if ref is None:
            return None
        found = [k for k in keys if k in idx]
        expected = [k for k in ref if k in idx]
        for a, b in zip(found, expected):
            if a != b:
                return [_KEY_ORDER, idx[a], idx[b]]
        p = next((i for i, (a, b) in enumerate(zip(keys, ref)) if a != b), min(len(keys), len(ref)))
        return [_KEYS_CHANGED, p, 0]

    def _placeholder(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The empty batch a rank with a malformed one sends meanwhile (every collective of the
        step completes, then every rank raises). Keys as the first batch's, dtypes kept."""
        keys = list(self._reference_keys or self._feature_names)
        values = features.values()
        lengths = features.lengths_or_none()
        if lengths is None:
            lengths = features.offsets_or_none()
        vdt = values.dtype if values.dtype in (torch.int32, torch.int64) else torch.int64
        ldt = lengths.dtype if lengths is not None and lengths.dtype in (torch.int32, torch.int64) else torch.int64
        return KeyedJaggedTensor(
            keys=keys, values=torch.empty(0, dtype=vdt, device=values.device),
            lengths=torch.empty(0, dtype=ldt, device=values.device), stride=0,
            weights=torch.empty(0, device=values.device) if self._module_weighted else None)

    def _describe(self, code: int, index: int, value: int) -> str:
        """A report ``[code, index, value]`` in words (only on the error path)."""
        names = self._feature_names

        def feature(i: int) -> str:
            if 0 <= i < len(names):
                return f"feature '{names[i]}' (table '{self._table_by_feature[names[i]]}')"
            return f"feature #{i}"

        rows = self._rows_by_feature.get(names[index], "?") if 0 <= index < len(names) else "?"
        weight = struct.unpack("<f", (value & 0xFFFFFFFF).to_bytes(4, "little"))[0]
        duplicate = feature(index) if index >= 0 else f"key {_unpack_name(value)}"
        other = names[value] if 0 <= value < len(names) else "?"
        template = _MESSAGES.get(code, "unknown problem code {code}")
        part = _PARTS[index] if 0 <= index < len(_PARTS) else "?"
        return template.format(code=code, index=index, value=value, feature=feature(index), rows=rows,
                               weight=weight, name=_unpack_name(value), position=-index - 1,
                               duplicate=duplicate, other=other, part=part,
                               dtype=str(_DTYPES[value]).replace("torch.", "") if 0 <= value < len(_DTYPES)
                               else "of another dtype",
                               allowed=_ALLOWED[index] if 0 <= index < len(_ALLOWED) else "?")

    def _finish_id_check(self, ctx: HybridEmbeddingBagCollectionContext, input) -> None:
        if ctx.rejected is not None:
            raise ctx.rejected
        check, ctx.id_check = ctx.id_check, None
        if check is None:
            return
        reports = check.reports(input)
        if not any(code for code, _, _ in reports):
            return
        if any(code in _SEARCHED for code, _, _ in reports):  # which length, id or weight it was
            reports = self._value_problems(check, reports)
        msgs = [f"rank {r}: {self._describe(code, index, value)}"  # only on the error path
                for r, (code, index, value) in enumerate(reports) if code]
        present = {code for code, _, _ in reports}
        if present - {_OK, _BAD_ID, _BAD_WEIGHT}:
            cls: type = MalformedBatchError
            what = "malformed batch"
        elif _BAD_ID in present:
            cls, what = InvalidIdError, "invalid embedding ids"
        else:
            cls, what = InvalidWeightError, "non-finite per-sample weights"
        ctx.rejected = cls(f"{what}; the batch was rejected on every rank before any lookup or update: "
                           + "; ".join(msgs))
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
