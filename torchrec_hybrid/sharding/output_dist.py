"""Output dist of the frequency-hybrid sharding: a sparse all-to-all of cold partial sums.

Only the partial pooled vectors of bags that had cold ids on an owner go back to the sample's
rank, and the same all-to-all carries each owner's hot rows to every replica (hot_replica.py);
split sizes come from what both sides already hold. The backward runs it in reverse and, like
TorchRec's pooled all-to-all, divides by W; both directions follow TorchRec's request/wait
pattern. MEAN features are pooled as SUM and divided by the full bag length here.

Quantized comms: the ``POOLED_EMBEDDINGS_ALL_TO_ALL`` codecs of a ``qcomm_codecs_registry``
encode this all-to-all where TorchRec's pooled all-to-all applies them; only element-wise
codecs (FP16, BF16) fit, the rest are refused at shard time (:func:`codec_problems`).
docs/architecture.md §2 (steps 4-5, Quantized comms) has the details."""

from typing import Any, List, Mapping, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embedding_sharding import BaseEmbeddingDist, EmbeddingShardingContext
from torchrec.distributed.types import CommOp, QuantizedCommCodec, QuantizedCommCodecs

from torchrec_hybrid import _compat
from torchrec_hybrid.sharding import fused
from torchrec_hybrid.sharding.cells import CellPositions
from torchrec_hybrid.sharding.composed import Received
from torchrec_hybrid.sharding.hot_replica import HotRowLayout
from torchrec_hybrid.sharding.input_dist import HybridLookupInput
from torchrec_hybrid.sharding.lookup import HybridLookupOutput
from torchrec_hybrid.sharding.segments import segment_positions


# (replica_dst, units per owner, order, units per owner as host ints)
ReceivePlan = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[int]]

# -- quantized comms ---------------------------------------------------------------------------

# The registry entry whose codecs this all-to-all takes (TorchRec's pooled all-to-all's).
OUTPUT_COMM_OP = CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name
# Entries for traffic a frequency_hybrid table never takes (stock types in its module may).
NOT_HYBRID_COMM_OPS = (CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.name, CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL.name)
# Quantized dtypes of the element-wise codecs this all-to-all honours (float32: no codec).
ELEMENTWISE_CODEC_DTYPES = (torch.float16, torch.bfloat16)
_SIZE_PROBES = (1, 3, 64, 1000)  # element counts a supported codec must keep (variable splits)


def codec_dtype(codec: Any) -> torch.dtype:
    """A codec's ``quantized_dtype`` (a property on FBGEMM's codec, a method on TorchRec's no-op)."""
    dtype = codec.quantized_dtype
    return dtype() if callable(dtype) else dtype


class OutputCodecs(NamedTuple):
    """The codecs the output all-to-all applies, per direction (None: fp32, no codec)."""

    forward: Optional[QuantizedCommCodec] = None
    backward: Optional[QuantizedCommCodec] = None


# why a codec that is neither fp32 nor element-wise FP16 / BF16 cannot encode this all-to-all
CODEC_REFUSAL_REASON = (
    "the hybrid output all-to-all sends each destination a variable-length run of rows of mixed widths "
    "(cold partial sums, then hot rows) and adds them up on arrival; row-wise and block codecs (INT8, FP8 "
    "rowwise, MX4) quantize fixed groups of that buffer, which straddle the runs, and element-wise FP8 clamps "
    "each partial sum and hot row at +-0.94 instead of the pooled sum stock sends. Only element-wise FP16 and "
    "BF16 codecs (or FP32) are supported")


def _unsupported(codec: Any) -> Optional[str]:
    """``codec`` described if this all-to-all cannot honour it (None: it can, or it is fp32)."""
    dtype = codec_dtype(codec)
    if dtype == torch.float32:
        return None
    if dtype in ELEMENTWISE_CODEC_DTYPES:
        try:
            ctx = codec.create_context()
            if all(codec.calc_quantized_size(n, ctx) == n for n in _SIZE_PROBES):
                return None
        except Exception:  # noqa: BLE001 - a codec that cannot size any split does not fit
            pass
    setting = _compat.qcomm_codec_setting(codec)
    return f"{setting} ({dtype})" if setting else f"{type(codec).__name__} with quantized dtype {dtype}"


def _problems(qcomm_codecs_registry: Optional[Mapping[str, QuantizedCommCodecs]]) -> Tuple[List[str], List[str]]:
    """(output all-to-all codecs this all-to-all cannot honour, entries for unknown comm ops), described."""
    codecs, ops = [], []
    for op, entry in (qcomm_codecs_registry or {}).items():
        if op in NOT_HYBRID_COMM_OPS or entry is None:
            continue
        if op != OUTPUT_COMM_OP:
            ops.append(f"qcomm_codecs_registry[{op!r}] (not a TorchRec comm op; the hybrid's cold id "
                       "all-to-alls carry int32 ids, lengths and weight bits and take no codec)")
            continue
        for direction in ("forward", "backward"):
            what = _unsupported(getattr(entry, direction))
            if what is not None:
                codecs.append(f"qcomm_codecs_registry[{op!r}] {direction} codec {what}")
    return codecs, ops


def codec_problems(qcomm_codecs_registry: Optional[Mapping[str, QuantizedCommCodecs]]) -> List[str]:
    """What of ``qcomm_codecs_registry`` a frequency_hybrid table cannot honour, each described
    (``"qcomm_codecs_registry['POOLED_EMBEDDINGS_ALL_TO_ALL'] forward codec FP8 rowwise (row_dim
    32) (torch.uint8)"``; why: :data:`CODEC_REFUSAL_REASON`): a codec other than FP16 / BF16 /
    FP32 for the output all-to-all, and any entry for a comm op TorchRec does not define (the
    hybrid's other collectives, the cold id all-to-alls, carry int32 and take no codec).
    Entries for comm ops the hybrid never uses (reduce-scatter, sequence all-to-all) are left
    to the stock tables that use them."""
    codecs, ops = _problems(qcomm_codecs_registry)
    return codecs + ops


def describe_codec_problems(qcomm_codecs_registry: Optional[Mapping[str, QuantizedCommCodecs]]) -> Optional[str]:
    """:func:`codec_problems` as one sentence, with the reason (None: nothing to refuse)."""
    codecs, ops = _problems(qcomm_codecs_registry)
    parts = (["; ".join(codecs) + f": {CODEC_REFUSAL_REASON}"] if codecs else []) + ops
    return "; ".join(parts) if parts else None


def output_codecs(codecs: Optional[QuantizedCommCodecs]) -> OutputCodecs:
    """The codecs of a ``POOLED_EMBEDDINGS_ALL_TO_ALL`` entry this all-to-all applies (fp32
    codecs: none); raises ``ValueError`` for one it cannot honour (:func:`codec_problems`)."""
    if codecs is None:
        return OutputCodecs()
    problem = describe_codec_problems({OUTPUT_COMM_OP: codecs})
    if problem is not None:
        raise ValueError(f"frequency_hybrid cannot honour {problem}")
    return OutputCodecs(*(None if codec_dtype(c) == torch.float32 else c for c in (codecs.forward, codecs.backward)))


def _quantized_splits(codec: Optional[QuantizedCommCodec], splits: List[int], qctx: Any) -> List[int]:
    return splits if codec is None else [codec.calc_quantized_size(n, qctx) for n in splits]


class _Request:
    """One variable all-to-all in flight, shared by its request and wait nodes (and their
    backward: the reverse all-to-all starts in the wait's backward, ends in the request's).
    ``send`` / ``recv``: split sizes in fp32 elements; ``codecs``: what encodes each direction
    (``qctx`` / ``grad_qctx``: their contexts for the step, TorchRec's ``qcomm_ctx``)."""

    def __init__(self, pg: dist.ProcessGroup, send_splits: List[int], recv_splits: List[int],
                 codecs: OutputCodecs = OutputCodecs()) -> None:
        self.pg, self.send, self.recv, self.codecs = pg, send_splits, recv_splits, codecs
        self.work: Optional[dist.Work] = None
        self.out: Optional[torch.Tensor] = None
        self.qctx: Any = None
        self.grad_work: Optional[dist.Work] = None
        self.grad_out: Optional[torch.Tensor] = None
        self.grad_qctx: Any = None


def _start_all_to_all(pg: dist.ProcessGroup, values: torch.Tensor, codec, send_splits: List[int],
                      recv_splits: List[int]):
    """Encodes ``values`` with ``codec`` (None: as is) and starts the variable all-to-all of
    it, every split its quantized size: ``(receive buffer, work, codec context)``."""
    send = values.contiguous()
    qctx = None
    if codec is not None:
        qctx = codec.create_context()
        send = codec.encode(send, qctx)
    recv = _quantized_splits(codec, recv_splits, qctx)
    out = send.new_empty(sum(recv))
    work = dist.all_to_all_single(out, send, recv, _quantized_splits(codec, send_splits, qctx), group=pg,
                                  async_op=True)
    return out, work, qctx


class _AllToAllRequest(torch.autograd.Function):
    """Starts ``all_to_all_single`` (async) and returns a token for :class:`_AllToAllWait`;
    backward waits for the reverse all-to-all the wait's backward started (TorchRec's
    ``All2Allv_Req`` pattern), decodes it and, like TorchRec's pooled all-to-all, divides by W.
    With a forward codec the send buffer is encoded and every split is its quantized size
    (TorchRec's ``All2All_Pooled_Req``)."""

    @staticmethod
    def forward(ctx, values, req: _Request):
        ctx.req = req
        req.out, req.work, req.qctx = _start_all_to_all(req.pg, values, req.codecs.forward, req.send, req.recv)
        return values.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad):
        req = ctx.req
        assert req.grad_work is not None and req.grad_out is not None  # started by _AllToAllWait.backward
        req.grad_work.wait()
        grad = req.grad_out
        if req.codecs.backward is not None:
            grad = req.codecs.backward.decode(grad, req.grad_qctx)
        req.grad_work = req.grad_out = req.grad_qctx = None  # nothing kept on the graph's context (a cycle)
        if get_gradient_division():
            grad.div_(req.pg.size())
        return grad, None


class _AllToAllWait(torch.autograd.Function):
    """Waits for the request's all-to-all and unpacks what arrived (decoded) as ``[units, unit]``:
    returns ``(received, replica)``, the received buffer with its hot-row units zeroed once the
    assembled hot replica has copied them, so that :func:`fused.hot_pool_add` adds the whole buffer
    in where it arrived (its partial sums, and zeros: no gather of the partials first).
    ``replica_src`` names, for every replica position, the received unit it copies (any unit
    where no owner sent one: rows nobody looked up, never read; None when no row was sent at
    all). The sums are a gather-then-add's, in the same order (only a -0.0 where a hot unit
    adds its zeros becomes +0.0). Backward: the buffer's gradient is the partials' as
    :func:`fused.hot_pool_add` gathered it for every unit, the hot-row units overwritten by the
    replica's; then starts the reverse all-to-all of it (async; encoded by the backward codec,
    TorchRec's ``All2All_Pooled_Wait``) and hands the token its (empty) gradient."""

    @staticmethod
    def forward(ctx, token, req: _Request, unit: int, row_src, row_dst, replica_src, replica_size: int):
        ctx.req = req
        assert req.work is not None and req.out is not None
        req.work.wait()
        out = req.out
        if req.codecs.forward is not None:
            out = req.codecs.forward.decode(out, req.qctx)
        req.work = req.out = req.qctx = None  # the output must not stay reachable from its own grad_fn (a cycle)
        recv = out.view(-1, unit)
        ctx.save_for_backward(row_src, row_dst)
        if replica_src is None:
            replica = recv.new_zeros((replica_size, unit))
        else:
            replica = recv.index_select(0, replica_src)
        recv.index_fill_(0, row_src, 0)  # the hot rows are in the replica now: they add nothing below
        return recv, replica

    @staticmethod
    def backward(ctx, grad_recv, grad_replica):
        req = ctx.req
        row_src, row_dst = ctx.saved_tensors
        # autograd materialises unused gradients as zeros (never None); grad_recv is this node's alone
        # (_AddPartials.backward's fresh gather, or those zeros), so the hot rows' go in in place
        grad_recv.index_copy_(0, row_src, grad_replica.index_select(0, row_dst))
        grad = grad_recv.reshape(-1)
        req.grad_out, req.grad_work, req.grad_qctx = _start_all_to_all(req.pg, grad, req.codecs.backward, req.recv,
                                                                       req.send)
        return grad.new_empty(0), None, None, None, None, None, None


class _Pack(torch.autograd.Function):
    """Owner side send buffer: per destination its bags' partial sums, then our hot rows.

    ``cold`` is the padded lookup output (rows or elements, the output dist's units) and
    ``index`` the unit each send position copies. The hot rows go to every destination, so
    their gradient sums the W copies (in rank order: deterministic). Backward gathers rather
    than scatters (a row gather is about 3x faster than ``index_copy_`` on CPU): ``source``
    names, per unit of ``cold``, the send position its gradient comes from - its bag's, or 0
    for padding bags (whose gradient the TBE never reads) and hot rows (written after).
    """

    @staticmethod
    def forward(ctx, cold, index, source, row_pos, row_dst, copies):
        ctx.save_for_backward(source, row_pos, row_dst)
        ctx.shape, ctx.copies = cold.shape, copies
        return cold.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        source, row_pos, row_dst = ctx.saved_tensors
        if grad.size(0) == 0:  # nothing was sent: every unit is a padding bag
            return grad.new_zeros(ctx.shape), None, None, None, None, None
        # every bag is sent once; each hot row W times: gather all, then put the sums in place
        out = grad.index_select(0, source)
        if row_pos.numel():
            rows = grad.index_select(0, row_dst)
            out.index_copy_(0, row_pos, rows.view((ctx.copies, -1) + tuple(rows.shape[1:])).sum(0))
        return out, None, None, None, None, None


class HybridPooledEmbeddingDist(BaseEmbeddingDist[EmbeddingShardingContext, HybridLookupOutput, torch.Tensor]):
    """Sends cold partial sums home and hot rows to every replica; adds up ``[B, sum(dims)]``.

    One all-to-all each way per step: rank r gets from each owner the partial sums of r's
    bags that had cold ids there, then the owner's hot rows; backward returns their
    gradients the same way (the hot rows' gradients summed over ranks at the owner).

    Args:
        pg: process group.
        feature_dims: output width of each feature (sharding order).
        mean_features: which features use MEAN pooling.
        codecs: the ``POOLED_EMBEDDINGS_ALL_TO_ALL`` entry of a ``qcomm_codecs_registry``
            (None: fp32); FP16 / BF16 per direction, others raise (:func:`output_codecs`).
        column_order: output column ``j`` is column ``column_order[j]`` of the features
            side by side (column-wise cold slices put back together; None: as they are).

    The hot-row layout (replica positions of the hot slots) comes with each step's lookup
    output (``out.layout``), the version of the hot set its input was split by.
    """

    # buffers (register_buffer in __init__)
    _dims: torch.Tensor
    _mean_cols: torch.Tensor
    _column_order: Optional[torch.Tensor]

    def __init__(self, pg: dist.ProcessGroup, feature_dims: List[int], mean_features: List[bool],
                 device: torch.device, codecs: Optional[QuantizedCommCodecs] = None,
                 column_order: Optional[List[int]] = None) -> None:
        super().__init__()
        self._pg, self._world = pg, pg.size()
        self._codecs = output_codecs(codecs)
        dims = torch.tensor(feature_dims, dtype=torch.int64)
        self._total_dim = int(dims.sum())
        self.register_buffer("_dims", dims.to(device), persistent=False)
        self._cells = CellPositions(feature_dims, device)
        self._any_mean = any(mean_features)
        # data moves in the cells' units (cells.py): whole rows when all features have one
        # width, else runs of the widths' common divisor
        lanes = self._cells.layout
        self._unit, self._one_unit = lanes.unit, lanes.one_unit
        mean_cols = torch.repeat_interleave(torch.tensor(mean_features, dtype=torch.bool), dims)
        self.register_buffer("_mean_cols", mean_cols.to(device), persistent=False)
        order = None if column_order is None else torch.tensor(column_order, dtype=torch.int64, device=device)
        self.register_buffer("_column_order", order, persistent=False)
        # (hot slots, their receive plan) of the last step whose every hot row travelled
        self._replica_cache: Tuple[Optional[torch.Tensor], Optional[ReceivePlan]] = (None, None)

    def _replica_positions(self, layout: HotRowLayout, slots: torch.Tensor, per_owner: torch.Tensor):
        """Positions in the flat replica (units) of received hot slots, and units per owner."""
        first = torch.div(layout.flat[slots], self._unit, rounding_mode="floor")
        if self._one_unit:
            return first, per_owner
        width = torch.div(layout.width[slots], self._unit, rounding_mode="floor")
        units = torch.zeros(self._world, dtype=torch.int64, device=slots.device)
        units.index_add_(0, layout.owner[slots], width)
        return segment_positions(first, width), units

    def _receive_plan(self, layout: HotRowLayout, slots: torch.Tensor, per_owner: torch.Tensor) -> ReceivePlan:
        """``(replica_dst, units per owner, order, host units)``: where the received hot units
        go in the replica, and for every replica unit which received hot unit (back to back)
        it copies (0 where none: never read). Computed once when every hot row travels (its
        host copy then costs one sync per hot set; per step when only looked-up rows do)."""
        cached_slots, cached = self._replica_cache
        if cached_slots is slots and cached is not None:
            return cached
        dst, units = self._replica_positions(layout, slots, per_owner)
        order = torch.zeros(layout.flat_size // self._unit, dtype=torch.int64, device=dst.device)
        order[dst] = torch.arange(dst.numel(), device=dst.device)
        plan = (dst, units, order, units.tolist())
        self._replica_cache = (slots, plan)
        return plan

    @record_function("## hybrid:output_dist ##")
    def forward(self, local_embs: HybridLookupOutput, sharding_ctx=None) -> "HybridOutputAwaitable":
        W, unit = self._world, self._unit
        inp = local_embs.input
        send, sizes, selection = inp.send, inp.sizes, inp.selection
        n_rows = send.row_pos.numel()
        # owner side: per destination the bags it sent us (arrival order), then our hot rows (unpack_cold's plan)
        packed = _Pack.apply(local_embs.cold.reshape(-1, unit), send.send_index, send.source, send.row_pos,
                             send.row_dst, W)
        # sample side: from each owner the bags we sent it (same order), then its hot rows
        replica_dst, _, order, replica_units = self._receive_plan(inp.hot.layout, selection.slots,
                                                                  selection.per_owner)
        batch = inp.lengths.size(1)
        pooled_units = batch * self._total_dim // unit  # [B, sum(dims)] in units; 0: an empty batch
        sent = sum(sizes.sent_bags)
        cells = inp.pack.sent_cells
        plan = fused.receive_plan(cells if cells.numel() == sent else cells[:sent], self._cells, sizes.sent_units,
                                  replica_units, order, pooled_units)
        # split sizes from the host copies the cold exchange made (no sync of its own)
        send_splits = [(u + n_rows) * unit for u in sizes.return_units]
        recv_splits = [(u + r) * unit for u, r in zip(sizes.sent_units, replica_units)]
        req = _Request(self._pg, send_splits, recv_splits, self._codecs)
        token = _AllToAllRequest.apply(packed.reshape(-1), req)
        return HybridOutputAwaitable(self, inp, req, token, plan, replica_dst,
                                     inp.hot.layout.flat_size // unit, pooled_units)

    def finish(self, inp: HybridLookupInput, req: "_Request", token: torch.Tensor, plan: Received,
               replica_dst: torch.Tensor, replica_size: int, pooled_units: int) -> torch.Tensor:
        """Receives (the wait node), pools the hot lookups from the assembled replica, adds the partial sums in."""
        unit = self._unit
        recv, replica = _AllToAllWait.apply(token, req, unit, plan.row_src, replica_dst, plan.replica_src,
                                            replica_size)
        pack = inp.pack
        # the hot lookups pooled from the assembled replica, every received unit added in where it belongs (the
        # received hot rows' units are zeros now); with an empty batch no partial arrived and nothing adds in
        received = (recv.reshape(-1), plan.recv_pos) if pooled_units else (recv.new_zeros(0), plan.recv_pos[:0])
        pooled = fused.hot_pool_add(inp.hot, replica.reshape(-1), pack.hot_rows, pack.hot_offsets, pack.hot_weights,
                                    inp.lengths.size(1), *received, unit)
        if self._any_mean:
            per_col = torch.repeat_interleave(inp.lengths.t(), self._dims, dim=1, output_size=self._total_dim)
            divisor = torch.where(self._mean_cols[None, :], per_col.clamp(min=1), torch.ones_like(per_col))
            pooled = pooled / divisor.to(pooled.dtype)
        return pooled if self._column_order is None else pooled.index_select(1, self._column_order)


class HybridOutputAwaitable(_compat.HybridAwaitable[torch.Tensor]):
    """The output all-to-all in flight (the model's dense part runs meanwhile); ``wait`` receives, pools
    the hot lookups and adds the cold partial sums in: the pooled ``[B, sum(dims)]``."""

    def __init__(self, dist_: HybridPooledEmbeddingDist, inp: HybridLookupInput, req: "_Request",
                 token: torch.Tensor, plan: Received, replica_dst: torch.Tensor, replica_size: int,
                 pooled_units: int) -> None:
        super().__init__()
        self._args = (inp, req, token, plan, replica_dst, replica_size, pooled_units)
        self._dist = dist_

    @record_function("## hybrid:output_dist_wait ##")
    def result(self) -> torch.Tensor:
        return self._dist.finish(*self._args)
