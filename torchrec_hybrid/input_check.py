"""The sharded module's per-step input check: a bad batch fails on every rank at once.

Each rank checks its batch before any collective (structure against the first batch, bag
lengths, ids against table sizes, optionally weights for NaN / inf; on the device without a
host sync) and never raises on its own: it records its first problem in its report and goes
on with a harmless batch, so the step's collectives complete. The reports ride the hybrid
cold ids' header (else one small all-to-all of their own) and every rank raises the same
:class:`InvalidInputError` before any lookup or update (:meth:`InputCheck.finish`).
docs/architecture.md §2 (step 1) has the details."""

import logging
import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import ParameterSharding, ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_hybrid.sharding import fused, variable_batch
from torchrec_hybrid.sharding.input_dist import HybridLookupInput, id_reports_from_words
from torchrec_hybrid.sharding.segments import cached_tensor, host_to_device
from torchrec_hybrid.types import FREQUENCY_HYBRID, collective_device

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
                      variable_batch.INVERSE_RANGE: _INVERSE_RANGE, variable_batch.BAGS_SIZE: _BAGS_SIZE,
                      variable_batch.VALUES_SIZE: _VALUES_SIZE, variable_batch.WEIGHTS_SIZE: _WEIGHTS_SIZE,
                      variable_batch.NEGATIVE_LENGTH: _NEGATIVE_LENGTH}
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


def _canonical(features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """The batch with int64 ids, int32 lengths and float32 weights (a copy only of a part of another dtype).
    The step's all-to-alls send each rank's tensors as they are, so ranks whose batches differ in
    dtype (int32 ids on one, int64 on another: both valid) would send mismatched messages (gloo aborts
    the process). int32 lengths as TorchRec's Criteo and DLRM pipelines make them (no copy there); the
    TBEs pool in float32 whatever the weights' dtype."""
    values, lengths, weights = features.values(), features.lengths(), features.weights_or_none()
    if values.dtype == torch.int64 and lengths.dtype == torch.int32 and (weights is None or
                                                                        weights.dtype == torch.float32):
        return features
    values, lengths = values.to(torch.int64), lengths.to(torch.int32)
    weights = None if weights is None else weights.to(torch.float32)
    if features.variable_stride_per_key():
        return KeyedJaggedTensor(keys=features.keys(), values=values, lengths=lengths, weights=weights,
                                 stride_per_key_per_rank=features.stride_per_key_per_rank(),
                                 inverse_indices=features.inverse_indices_or_none())
    return KeyedJaggedTensor(keys=features.keys(), values=values, lengths=lengths, weights=weights,
                             stride=features.stride(), length_per_key=features.length_per_key(),
                             offset_per_key=features.offset_per_key())  # host lists the check read already


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


class InputCheck:
    """The per-step input check of one sharded EBC (see the module docstring).

    Args:
        configs: the module's tables; plan: its plan entries per table (which dists index by id);
        pg: the module's process group (a verdict not carried by a hybrid exchange goes there);
        carried: the verdicts ride the hybrid cold ids' headers; module_weighted: the module takes
        per-sample weights; validate_weights: check them for NaN / inf.
    """

    def __init__(self, configs: List[Any], plan: Mapping[str, ParameterSharding], pg: Optional[dist.ProcessGroup],
                 carried: bool, module_weighted: bool, validate_weights: bool) -> None:
        self._check_pg = pg
        self._carried = carried
        self._module_weighted = module_weighted
        self._validate_weights = validate_weights
        self._rows_by_feature = {f: c.num_embeddings for c in configs for f in c.feature_names}
        self._table_by_feature = {f: c.name for c in configs for f in c.feature_names}
        self._feature_names = tuple(f for c in configs for f in c.feature_names)
        self.feature_index = {f: i for i, f in enumerate(self._feature_names)}
        # the keys of the first batch: the stock input dist fixes its feature permutation then
        self.reference_keys: Optional[Tuple[str, ...]] = None
        # per (keys, dtype, device): the id limits per key, and per id for the last lengths per key
        self._limit_cache: Dict[tuple, Tuple[tuple, Optional[Tuple[int, ...]], Optional[tuple]]] = {}
        # per (keys, batch size, ids per key, dtype, device): lengths that put each key's ids in its
        # last bag (what a batch with a negative length goes on with)
        self._length_cache: Tuple[tuple, Optional[torch.Tensor]] = ((), None)
        # input dists that index by id (row-wise bucketing, the hybrid's hot/cold split) and
        # caching kernels (a prefetch pipeline fills their caches before the verdict is read)
        # need ids in range even in a batch the check will reject; the others only move them
        self._ids_index_rows = any(ps.sharding_type == FREQUENCY_HYBRID or ps.sharding_type not in _ID_MOVING_TYPES
                                   or ps.compute_kernel not in _PLAIN_KERNELS for ps in plan.values())
        self._no_report = torch.zeros(3, dtype=torch.int64)

    def variable_batch_problem(self, keys: List[str], found: Tuple[str, int, int]) -> List[int]:
        """A variable batch's problem (``variable_batch.expand_variable_batch``) as a report."""
        kind, index, value = found
        if kind in (variable_batch.INVERSE_RANGE, variable_batch.NEGATIVE_LENGTH):  # key position -> feature
            index = self.feature_index.get(keys[index], -1)
        return [_VARIABLE_PROBLEMS[kind], index, value]

    @record_function("## hybrid:id_check ##")
    def start(self, features: KeyedJaggedTensor, problem: Optional[List[int]] = None
              ) -> Tuple[KeyedJaggedTensor, IdCheck]:
        """Checks the batch locally; the sharded module sends the verdict to every rank (in the hybrid
        cold ids' headers, else in an all-to-all of its own) and reads it before the lookups
        (:meth:`finish`). This rank never raises here (the others would wait in the step's
        collectives): a malformed batch is replaced by an empty one, bad ids by ids in range and bad
        weights by 0 meanwhile, so the dists stay in step. ``problem``: one found before (a variable
        batch's)."""
        check = IdCheck(report=self._no_report, carried=self._carried)
        problem = problem or self._structure_problem(features)
        if problem is not None:
            check.report = torch.tensor(problem, dtype=torch.int64)
            features = self._placeholder(features)
        else:
            features = _canonical(features)
            check.batch = features  # where the error path looks for what was wrong
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

    def _value_problems(self, check: IdCheck, reports: List[List[int]], pg: Optional[dist.ProcessGroup]
                        ) -> List[List[int]]:
        """Every rank's report with its bad id or weight found: each rank that reported one
        searches its batch, then one all-to-all on the group the reports came from gives every
        rank every rank's (collective: every rank of that group read the same verdicts, so every
        one comes here; a failed search sends the bare report rather than skip the exchange)."""
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
            features_of_keys = [self.feature_index.get(k, -1) for k in keys]
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
        if keys != self.reference_keys:
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
        per_key = features.length_per_key()
        total = sum(per_key)
        if total != values.numel():
            return [_VALUES_SIZE, total, values.numel()]
        if min(per_key, default=0) < 0:  # a key's bags add up to less than 0 (the device check's fallback,
            # each key's ids in its last bag, would be negative too): which length, found here (a host sync,
            # on this error path only)
            k = next(i for i, n in enumerate(per_key) if n < 0)
            bags = lengths[k * stride:(k + 1) * stride]
            return [_NEGATIVE_LENGTH, self.feature_index.get(keys[k], -1), int(bags.min())]
        weights = features.weights_or_none()
        if (weights is not None) != self._module_weighted:
            return [_WEIGHTS_UNEXPECTED if weights is not None else _WEIGHTS_MISSING, 0, 0]
        if weights is not None and weights.numel() != values.numel():
            return [_WEIGHTS_SIZE, values.numel(), weights.numel()]
        return None

    def _key_problem(self, keys: Tuple[str, ...]) -> Optional[List[int]]:
        """Keys that differ from the first batch's (or, for the first batch, that miss a
        feature or repeat one). Only runs when the keys are not the first batch's."""
        idx, ref = self.feature_index, self.reference_keys
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
        step completes, then every rank raises). Keys as the first batch's, dtypes :func:`_canonical`'s."""
        keys = list(self.reference_keys or self._feature_names)
        values = features.values()
        return KeyedJaggedTensor(
            keys=keys, values=torch.empty(0, dtype=torch.int64, device=values.device),
            lengths=torch.empty(0, dtype=torch.int32, device=values.device), stride=0,
            weights=torch.empty(0, device=values.device) if self._module_weighted else None)

    def describe(self, code: int, index: int, value: int) -> str:
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

    def finish(self, check: IdCheck, dist_input: List[Any], hybrid_pg: Optional[dist.ProcessGroup]
               ) -> Optional[InvalidInputError]:
        """Every rank's verdict on this step's batch (waits for them if they are still on the way): None
        when every batch is fine, else the error every rank raises, naming each rank's first problem
        (searched on the ranks that report a bad length, id or weight: one more all-to-all, only on
        this error path). ``hybrid_pg``: the group a carried verdict came on (the hybrid sharding's)."""
        reports = check.reports(dist_input)
        if not any(code for code, _, _ in reports):
            return None
        if any(code in _SEARCHED for code, _, _ in reports):  # which length, id or weight it was
            reports = self._value_problems(check, reports, hybrid_pg if check.carried else self._check_pg)
        msgs = [f"rank {r}: {self.describe(code, index, value)}"  # only on the error path
                for r, (code, index, value) in enumerate(reports) if code]
        present = {code for code, _, _ in reports}
        if present - {_OK, _BAD_ID, _BAD_WEIGHT}:
            cls: type = MalformedBatchError
            what = "malformed batch"
        elif _BAD_ID in present:
            cls, what = InvalidIdError, "invalid embedding ids"
        else:
            cls, what = InvalidWeightError, "non-finite per-sample weights"
        return cls(f"{what}; the batch was rejected on every rank before any lookup or update: " + "; ".join(msgs))
