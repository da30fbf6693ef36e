"""The replicated hot rows of one table group: a fused FBGEMM TBE kept identical on all ranks.

Forward pools the local hot lookups through FBGEMM's dense TBE kernel on a leaf that shares
storage with the fused TBE's weights, so autograd yields the local row gradients instead of
updating. In backward a hook starts an async all-reduce of ``[row gradients | lookup
counts]`` (dense, one collective) that overlaps the rest of the backward pass; at the end of
the pass a queued callback divides by W like TorchRec's all-to-all backward and *replays*
the reduced gradient through the fused TBE (one bag per touched row): FBGEMM then applies
exactly the update it would have applied to the global batch, with its own optimizer state.
Every rank replays the same bytes, so replicas stay bit-identical.

After each update the rows this rank owns in the row-wise layout are copied, with their
optimizer state, into the cold TBE's "shadow rows", so the cold shard is always the complete
logical table (state_dict, checkpoints and ``fused_optimizer`` read it). ``refresh()`` copies
the other way (after a load), collectively.
"""

from typing import List

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
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


class HotReplica:
    """Hot rows of the tables of one ``GroupedEmbeddingConfig``.

    Deliberately not an ``nn.Module``: its TBE must stay invisible to SEBC's fused-optimizer
    discovery and to state_dict (the cold shard is the logical table).

    Args:
        config: the cold group's config (tables in group order, fused_params as used cold).
        hot_ids: sorted hot row ids per table of the group.
        cold_tbe: the group's cold fused TBE (shadow rows live there).
        pg: process group; device: compute device.
    """

    def __init__(self, config: GroupedEmbeddingConfig, hot_ids: List[torch.Tensor],
                 cold_tbe: torch.nn.Module, pg: dist.ProcessGroup, device: torch.device) -> None:
        self._pg, self._world = pg, pg.size()
        tables = config.embedding_tables
        self.dims = [t.local_cols for t in tables]
        self.total_dim = sum(t.embedding_dim * t.num_features() for t in tables)
        rows_eff = [max(1, h.numel()) for h in hot_ids]  # a TBE table needs >= 1 row
        on_cuda = device.type == "cuda"
        loc = EmbeddingLocation.DEVICE if on_cuda else EmbeddingLocation.HOST
        cdev = ComputeDevice.CUDA if on_cuda else ComputeDevice.CPU
        fused_params = {k: v for k, v in (config.fused_params or {}).items()
                        if k not in ("enable_raw_embedding_streaming",)}
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(r, d, loc, cdev) for r, d in zip(rows_eff, self.dims)],
            feature_table_map=list(range(len(tables))),
            pooling_mode=PoolingMode.SUM,
            weights_precision=data_type_to_sparse_type(config.data_type),
            device=device,
            **fused_params,
        )
        feature_table_map = [i for i, t in enumerate(tables) for _ in range(t.num_features())]
        self._dense = DenseTableBatchedEmbeddingBagsCodegen(
            [(r, d) for r, d in zip(rows_eff, self.dims)],
            feature_table_map=feature_table_map,
            pooling_mode=PoolingMode.SUM,
            use_cpu=not on_cuda,
        ).to(device)
        self._dense.weights = torch.nn.Parameter(torch.empty(0, device=device))  # storage is the fused TBE's
        self._weights = _compat.tbe_weight_base(self.tbe)

        # Slot (hot row across the group's tables, in id order) -> table, row, flat position.
        sizes = torch.tensor([h.numel() for h in hot_ids], dtype=torch.int64)
        self.num_slots = int(sizes.sum())
        self._slot_table = torch.repeat_interleave(torch.arange(len(tables)), sizes)
        self._slot_row = segment_arange(sizes)
        dims = torch.tensor(self.dims, dtype=torch.int64)
        self._dims, self._dim_offsets = dims, torch.cumsum(dims, 0) - dims
        w_views = self.tbe.split_embedding_weights()
        self._slot_weight_base = torch.tensor(
            [v.storage_offset() - self._weights.storage_offset() for v in w_views], dtype=torch.int64
        )[self._slot_table] + self._slot_row * dims[self._slot_table]
        self._build_shadow_map(config, hot_ids, cold_tbe)
        for name in ("_slot_table", "_slot_row", "_dims", "_dim_offsets", "_slot_weight_base"):
            setattr(self, name, getattr(self, name).to(device))

    def _build_shadow_map(self, config, hot_ids, cold_tbe) -> None:
        """Flat (hot, cold) index pairs for the owned hot rows: weights and each optimizer state."""
        hot_states, cold_states = _compat.tbe_state_views(self.tbe), _compat.tbe_state_views(cold_tbe)
        pairs = [(self.tbe.split_embedding_weights(), cold_tbe.split_embedding_weights(),
                  self._weights, _compat.tbe_weight_base(cold_tbe))]
        for hv, cv in zip(hot_states, cold_states):
            pairs.append((hv, cv, _compat.tbe_state_base(self.tbe, hv[0]), _compat.tbe_state_base(cold_tbe, cv[0])))
        self._shadow = []
        for hot_views, cold_views, hot_base, cold_base in pairs:
            hot_idx, cold_idx = [], []
            for t, ids in enumerate(hot_ids):  # set-up time loop over tables
                table = config.embedding_tables[t]
                start = table.local_metadata.shard_offsets[0]
                own = (ids >= start) & (ids < start + table.local_rows)
                rows = own.nonzero().view(-1)
                hot_idx.append(_compat.flat_positions(hot_base, hot_views[t], rows))
                cold_idx.append(_compat.flat_positions(cold_base, cold_views[t], ids[own] - start))
            self._shadow.append((hot_base, torch.cat(hot_idx).to(hot_base.device),
                                 cold_base, torch.cat(cold_idx).to(cold_base.device)))

    # -- forward ---------------------------------------------------------------------------
    def pool(self, indices, offsets, weights, counts: torch.Tensor, batch: int) -> torch.Tensor:
        """Pooled hot embeddings ``[batch, total_dim]`` of the local hot lookups (SUM)."""
        d = self._dense
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
        return out if out.shape == (batch, self.total_dim) else out.view(batch, self.total_dim)

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
        grad, touched = buf[:n], buf[n:] > 0
        if get_gradient_division():
            grad = grad / self._world
        slots = touched.nonzero().view(-1)
        if slots.numel() == 0:
            return
        table = self._slot_table[slots]
        per_table = torch.bincount(table, minlength=len(self.dims))
        bags = int(per_table.max())
        first = torch.cumsum(per_table, 0) - per_table
        pos = torch.arange(slots.numel(), device=slots.device) - first[table]
        lengths = (torch.arange(bags, device=slots.device)[None, :] < per_table[:, None]).reshape(-1)
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths.to(torch.int64))
        grad_out = torch.zeros(bags * sum(self.dims), dtype=grad.dtype, device=grad.device)
        if len(set(self.dims)) == 1:  # one width: move whole rows
            D = self.dims[0]
            grad_out.view(-1, D)[pos * len(self.dims) + table] = grad.view(-1, D)[self._slot_weight_base[slots] // D]
        else:
            width = self._dims[table]
            within = segment_arange(width)
            dst = torch.repeat_interleave(pos * sum(self.dims) + self._dim_offsets[table], width) + within
            src = torch.repeat_interleave(self._slot_weight_base[slots], width) + within
            grad_out[dst] = grad[src]
        with torch.enable_grad():
            out = self.tbe(self._slot_row[slots], offsets)
            torch.autograd.backward(out, grad_out.view(bags, -1))
        self.to_shadow()

    @torch.no_grad()
    def to_shadow(self) -> None:
        """Owned hot rows (weights + optimizer state) -> the cold shard's shadow rows."""
        # `.data`: don't bump the version counter the cold TBE's pending backward checks; the
        # shadow rows are never touched by cold lookups (a hot id never goes cold).
        for hot_base, hot_idx, cold_base, cold_idx in self._shadow:
            cold_base.data[cold_idx] = hot_base[hot_idx]

    @torch.no_grad()
    def refresh(self) -> None:
        """Cold shadow rows -> every replica (collective; after a load or at start-up)."""
        for hot_base, hot_idx, cold_base, cold_idx in self._shadow:
            buf = torch.zeros_like(hot_base)
            buf[hot_idx] = cold_base[cold_idx]
            dist.all_reduce(buf, group=self._pg)
            hot_base.data.copy_(buf)
