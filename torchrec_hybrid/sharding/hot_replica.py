"""The replicated hot rows of one table group: a fused FBGEMM TBE kept identical on all ranks.

Forward pools the local hot lookups through FBGEMM's dense TBE kernel on a leaf that shares
storage with the fused TBE's weights, so autograd yields the local row gradients instead of
updating. In backward a hook starts an async all-reduce of ``[row gradients | lookup
counts]`` (dense, one collective) that overlaps the rest of the backward pass; at the end of
the pass a queued callback divides by W like TorchRec's all-to-all backward and *replays*
the reduced gradient through the fused TBE (one bag per touched row): FBGEMM then applies
exactly the update it would have applied to the global batch, with its own optimizer state.
Every rank replays the same bytes, so replicas stay bit-identical.

The hot rows of all tables of one width share one TBE table (a "bucket"): the optimizers
are per row or per element, so this changes no update, and with one width (the usual case)
the replay is a single bag-per-row lookup with no padding.

After each update the rows this rank owns in the row-wise layout are copied, with their
optimizer state, into the cold TBE's "shadow rows", so the cold shard is always the complete
logical table (state_dict, checkpoints and ``fused_optimizer`` read it). ``refresh()`` copies
the other way (after a load), collectively.
"""

from typing import List, Tuple

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    DenseTableBatchedEmbeddingBagsCodegen,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.utils import data_type_to_sparse_type

from torchrec_hybrid import _compat
from torchrec_hybrid.sharding.segments import segment_arange


def hot_slot_layout(dims: List[int], sizes: List[int]) -> Tuple[List[int], List[int], List[int]]:
    """Where the hot rows of a group's tables live in its replica.

    Tables of one width share a bucket (buckets in order of first appearance); a bucket holds
    its tables' hot rows table after table, ids ascending. Slots number the replica's rows
    bucket after bucket. Returns, per table, its bucket and its first slot, and per bucket
    its first slot.
    """
    widths = list(dict.fromkeys(dims))
    bucket = [widths.index(d) for d in dims]
    table_start, bucket_start, n = [0] * len(dims), [], 0
    for b in range(len(widths)):  # set-up time loops over buckets / tables
        bucket_start.append(n)
        for t in range(len(dims)):
            if bucket[t] == b:
                table_start[t], n = n, n + sizes[t]
    return bucket, table_start, bucket_start


class _RowCopy:
    """Copies between matching rows of two flat TBE buffers (weights or one optimizer state).

    Holds flat element positions, or row positions when both sides are rows of one width
    laid out contiguously (then the copies move whole rows: several times cheaper).
    """

    def __init__(self, hot_base: torch.Tensor, hot_pos: torch.Tensor,
                 cold_base: torch.Tensor, cold_pos: torch.Tensor, width: int) -> None:
        self.hot_base, self.cold_base, self.width = hot_base, cold_base, 1
        if width > 1 and self._as_rows(hot_base, hot_pos, width) and self._as_rows(cold_base, cold_pos, width):
            self.width = width
            hot_pos, cold_pos = hot_pos[::width] // width, cold_pos[::width] // width
        self.hot_pos, self.cold_pos = hot_pos.to(hot_base.device), cold_pos.to(cold_base.device)

    @staticmethod
    def _as_rows(base: torch.Tensor, pos: torch.Tensor, width: int) -> bool:
        if base.numel() % width or pos.numel() % width:
            return False
        rows = pos.view(-1, width)
        return bool(((rows[:, :1] % width) == 0).all()) and bool(
            (rows - rows[:, :1] == torch.arange(width)).all())

    def _view(self, base: torch.Tensor) -> torch.Tensor:
        return base.view(-1, self.width) if self.width > 1 else base.view(-1)

    def hot_to_cold(self) -> None:
        # `.data`: don't bump the version counter the cold TBE's pending backward checks; the
        # shadow rows are never touched by cold lookups (a hot id never goes cold).
        src = self._view(self.hot_base).index_select(0, self.hot_pos)
        self._view(self.cold_base.data).index_copy_(0, self.cold_pos, src)

    def cold_into(self, buf: torch.Tensor) -> None:
        """Scatters the cold rows into ``buf`` (shaped like the hot buffer) at their hot rows."""
        self._view(buf).index_copy_(0, self.hot_pos, self._view(self.cold_base).index_select(0, self.cold_pos))


class HotReplica:
    """Hot rows of the tables of one ``GroupedEmbeddingConfig``.

    Deliberately not an ``nn.Module``: its TBE must stay invisible to SEBC's fused-optimizer
    discovery and to state_dict (the cold shard is the logical table).

    Args:
        config: the cold group's config (tables in group order, fused_params as used cold).
        hot_ids: sorted hot row ids per table of the group.
        cold_tbe: the group's cold fused TBE (shadow rows live there).
        pg: process group; device: compute device.
        slot_base: the group's first slot among the hot slots of the whole sharding.
    """

    def __init__(self, config: GroupedEmbeddingConfig, hot_ids: List[torch.Tensor],
                 cold_tbe: torch.nn.Module, pg: dist.ProcessGroup, device: torch.device,
                 slot_base: int = 0) -> None:
        self._pg, self._world = pg, pg.size()
        tables = config.embedding_tables
        dims = [t.local_cols for t in tables]
        self.total_dim = sum(t.embedding_dim * t.num_features() for t in tables)
        sizes = [h.numel() for h in hot_ids]
        self.num_slots, self.slot_base = sum(sizes), slot_base
        bucket, table_start, bucket_start = hot_slot_layout(dims, sizes)
        self._widths = widths = list(dict.fromkeys(dims))  # per bucket, in the layout's order
        bucket_rows = [end - start for start, end in zip(bucket_start, bucket_start[1:] + [self.num_slots])]
        rows_eff = [max(1, r) for r in bucket_rows]  # a TBE table needs >= 1 row
        on_cuda = device.type == "cuda"
        loc = EmbeddingLocation.DEVICE if on_cuda else EmbeddingLocation.HOST
        cdev = ComputeDevice.CUDA if on_cuda else ComputeDevice.CPU
        fused_params = {k: v for k, v in (config.fused_params or {}).items()
                        if k not in ("enable_raw_embedding_streaming",)}
        # the replay's indices are built here, never user input
        fused_params["bounds_check_mode"] = BoundsCheckMode.NONE
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(r, d, loc, cdev) for r, d in zip(rows_eff, widths)],
            feature_table_map=list(range(len(widths))),
            pooling_mode=PoolingMode.SUM,
            weights_precision=data_type_to_sparse_type(config.data_type),
            device=device,
            **fused_params,
        )
        feature_bucket = [bucket[t] for t, tb in enumerate(tables) for _ in range(tb.num_features())]
        self._dense = DenseTableBatchedEmbeddingBagsCodegen(
            [(r, d) for r, d in zip(rows_eff, widths)],
            feature_table_map=feature_bucket,
            pooling_mode=PoolingMode.SUM,
            use_cpu=not on_cuda,
        ).to(device)
        self._dense.weights = torch.nn.Parameter(torch.empty(0, device=device))  # storage is the fused TBE's
        self._weights = _compat.tbe_weight_base(self.tbe)

        # Per slot: bucket and row in the bucket; per feature: first slot of its bucket.
        bstart = torch.tensor(bucket_start, dtype=torch.int64)
        self._slot_bucket = torch.repeat_interleave(torch.arange(len(widths)), torch.tensor(bucket_rows))
        self._slot_row = torch.arange(self.num_slots) - bstart[self._slot_bucket]
        self._feature_shift = (bstart[feature_bucket] + slot_base) if len(widths) > 1 else None
        offsets = [v.storage_offset() - self._weights.storage_offset() for v in self.tbe.split_embedding_weights()]
        w = torch.tensor(widths, dtype=torch.int64)
        self._bucket_widths = w
        self._slot_weight_base = torch.tensor(offsets, dtype=torch.int64)[self._slot_bucket] + self._slot_row * w[self._slot_bucket]
        self._build_shadow_map(config, hot_ids, cold_tbe, bucket, table_start, bucket_start)
        for name in ("_slot_bucket", "_slot_row", "_feature_shift", "_bucket_widths", "_slot_weight_base"):
            t = getattr(self, name)
            setattr(self, name, None if t is None else t.to(device))

    def _build_shadow_map(self, config, hot_ids, cold_tbe, bucket, table_start, bucket_start) -> None:
        """Row copies hot -> cold for the owned hot rows: weights and each optimizer state."""
        hot_states, cold_states = _compat.tbe_state_views(self.tbe), _compat.tbe_state_views(cold_tbe)
        pairs = [(self.tbe.split_embedding_weights(), cold_tbe.split_embedding_weights(),
                  self._weights, _compat.tbe_weight_base(cold_tbe))]
        for hv, cv in zip(hot_states, cold_states):
            pairs.append((hv, cv, _compat.tbe_state_base(self.tbe, hv[0]), _compat.tbe_state_base(cold_tbe, cv[0])))
        self._shadow: List[_RowCopy] = []
        for hot_views, cold_views, hot_base, cold_base in pairs:
            hot_pos, cold_pos, widths = [], [], set()
            for t, ids in enumerate(hot_ids):  # set-up time loop over tables
                table = config.embedding_tables[t]
                start = table.local_metadata.shard_offsets[0]
                own = (ids >= start) & (ids < start + table.local_rows)
                rows = own.nonzero().view(-1) + (table_start[t] - bucket_start[bucket[t]])
                hot_view, cold_view = hot_views[bucket[t]], cold_views[t]
                hot_pos.append(_compat.flat_positions(hot_base, hot_view, rows))
                cold_pos.append(_compat.flat_positions(cold_base, cold_view, ids[own] - start))
                widths.update({hot_view.size(1) if hot_view.dim() == 2 else 1,
                               cold_view.size(1) if cold_view.dim() == 2 else 1})
            width = widths.pop() if len(widths) == 1 else 1
            self._shadow.append(_RowCopy(hot_base, torch.cat(hot_pos), cold_base, torch.cat(cold_pos), width))

    # -- forward ---------------------------------------------------------------------------
    def pool(self, slots, offsets, weights, counts: torch.Tensor, batch: int) -> torch.Tensor:
        """Pooled hot embeddings ``[batch, total_dim]`` of the local hot lookups (SUM).

        ``slots`` are hot slots of the whole sharding, jagged by (feature, sample) per ``offsets``.
        """
        d = self._dense
        if self._feature_shift is not None:  # several widths: slot -> row of the feature's bucket
            per_feature = offsets[batch::batch] - offsets[:-1:batch]
            indices = slots - torch.repeat_interleave(self._feature_shift, per_feature, output_size=slots.numel())
        else:
            indices = slots - self.slot_base if self.slot_base else slots
        # `.data`: same storage, own version counter (the replay updates the storage in place
        # after this graph has used it; the weight gradient never reads the weights).
        leaf = self._weights.data.requires_grad_(torch.is_grad_enabled())
        out = torch.ops.fbgemm.dense_embedding_codegen_lookup_function(
            dev_weights=leaf, weights_offsets=d.weights_offsets, D_offsets=d.D_offsets,
            total_D=d.total_D, max_D=d.max_D, hash_size_cumsum=d.hash_size_cumsum,
            total_hash_size_bits=d.total_hash_size_bits, indices=indices.to(torch.int64),
            offsets=offsets.to(torch.int64), pooling_mode=d.pooling_mode,
            indice_weights=None if weights is None else weights.float(),
            feature_requires_grad=None, output_dtype=d.output_dtype,
        )
        if leaf.requires_grad and self.num_slots > 0:
            leaf.register_post_accumulate_grad_hook(lambda p: self._sync(p, counts))
        # FBGEMM already returns [batch, total_dim]; never hand out a view: the output dist
        # adds the cold partials into this tensor in place, and an in-place op on a view makes
        # autograd clone the whole gradient (CopySlices), ~15% of a step on the headline run.
        return out if out.shape == (batch, self.total_dim) else out.reshape(batch, self.total_dim).clone()

    # -- backward: reduce, replay, shadow --------------------------------------------------
    @torch.no_grad()
    def _sync(self, leaf: torch.Tensor, counts: torch.Tensor) -> None:
        """Starts the all-reduce; the replay runs once the whole backward pass is done."""
        grad = leaf.grad
        leaf.grad = None
        buf = torch.cat([grad.reshape(-1), counts.to(grad.dtype)])
        work = dist.all_reduce(buf, group=self._pg, async_op=True)
        _compat.queue_end_of_backward(lambda: self._apply(work, buf, grad.numel()))

    @torch.no_grad()
    @record_function("## hybrid:hot_replay ##")
    def _apply(self, work, buf: torch.Tensor, n: int) -> None:
        work.wait()
        grad = buf[:n]
        slots = (buf[n:] > 0).nonzero().view(-1)  # rows the global batch touched
        if slots.numel() == 0:
            return
        if len(self._widths) == 1:  # one bucket: one bag per touched row, no padding
            D = self._widths[0]
            indices, grad_out = slots, grad.view(-1, D).index_select(0, slots)
            offsets = torch.arange(slots.numel() + 1, device=slots.device)
        else:
            indices, offsets, grad_out = self._bags_per_bucket(grad, slots)
        if get_gradient_division():
            grad_out.div_(self._world)
        with torch.enable_grad():
            out = self.tbe(indices, offsets)
            torch.autograd.backward(out, grad_out)
        self.to_shadow()

    def _bags_per_bucket(self, grad: torch.Tensor, slots: torch.Tensor):
        """Replay input for several buckets: one bag per touched row, buckets padded to one batch."""
        bucket = self._slot_bucket[slots]
        per_bucket = torch.bincount(bucket, minlength=len(self._widths))
        bags = int(per_bucket.max())
        first = torch.cumsum(per_bucket, 0) - per_bucket
        pos = torch.arange(slots.numel(), device=slots.device) - first[bucket]
        lengths = (torch.arange(bags, device=slots.device)[None, :] < per_bucket[:, None]).reshape(-1)
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths.to(torch.int64))
        total = int(self._bucket_widths.sum())
        grad_out = torch.zeros(bags * total, dtype=grad.dtype, device=grad.device)
        width = self._bucket_widths[bucket]
        within = segment_arange(width)
        col = torch.cumsum(self._bucket_widths, 0) - self._bucket_widths
        dst = torch.repeat_interleave(pos * total + col[bucket], width) + within
        src = torch.repeat_interleave(self._slot_weight_base[slots], width) + within
        grad_out[dst] = grad[src]
        return self._slot_row[slots], offsets, grad_out.view(bags, total)

    @torch.no_grad()
    def to_shadow(self) -> None:
        """Owned hot rows (weights + optimizer state) -> the cold shard's shadow rows."""
        for copy in self._shadow:
            copy.hot_to_cold()

    @torch.no_grad()
    def refresh(self) -> None:
        """Cold shadow rows -> every replica (collective; after a load or at start-up)."""
        for copy in self._shadow:
            buf = torch.zeros_like(copy.hot_base)
            copy.cold_into(buf)
            dist.all_reduce(buf, group=self._pg)
            copy.hot_base.data.copy_(buf)
