"""The hot rows: replicated on every rank for local lookups, kept in sync by their owners.

Every hot row stays in its owner's cold shard, so state_dict, checkpoints and the fused
optimizer state are exactly stock row-wise. Each owner looks its hot rows up as extra one-id
bags and sends them in the output all-to-all; every rank assembles its replica from them and
pools its hot lookups locally (:meth:`HotPooling.pool`); in backward the row gradients go
back to the owners, whose fused TBE applies the global-batch update. Only rows some rank
looked up travel unless a zero gradient is a no-op (:func:`zero_grad_is_noop`)."""

import warnings
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import DenseTableBatchedEmbeddingBagsCodegen
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig

from torchrec_hybrid import row_blocks
from torchrec_hybrid.sharding.segments import exclusive_cumsum

# FBGEMM registers no kernel for the dense TBE op under PyTorch's Autograd key: its kernel builds
# the autograd node itself (FBGEMM's dense backward runs under it), so PyTorch's fallback warns
# on every first backward that the gradient "may" be wrong. It is not: the equivalence tests check
# every hot row's gradient and update against stock table_wise. Only that one message is silenced.
warnings.filterwarnings("ignore", message=r"fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel "
                        r"was not registered")

# Optimizers whose update with a zero gradient leaves the row and its state unchanged
# (w -= lr * 0; Adagrad states += 0), provided there is no weight decay and eps > 0.
_NOOP_ON_ZERO_GRAD = {EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD, EmbOptimType.EXACT_ROWWISE_ADAGRAD}


def zero_grad_is_noop(fused_params: Optional[Dict[str, Any]]) -> bool:
    """Whether updating a row with a zero gradient is exactly a no-op for these fused params."""
    p = fused_params or {}
    opt = p.get("optimizer", EmbOptimType.EXACT_SGD)
    if opt not in _NOOP_ON_ZERO_GRAD:
        return False
    if float(p.get("weight_decay", 0.0) or 0.0) != 0.0:
        return False
    return opt == EmbOptimType.EXACT_SGD or float(p.get("eps", 1e-8)) > 0.0


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


class HotPooling:
    """Local pooling of one ``GroupedEmbeddingConfig``'s hot lookups from the replica.

    Holds no weights: the replica is a flat buffer the output dist assembles every step from
    the owners' rows (see the module docstring). This class knows its layout - a dense TBE
    over one table per width ("bucket") - and pools from it (:meth:`pool`).

    Args:
        config: the cold group's config (tables in group order).
        hot_ids: sorted hot row ids per table of the group.
        device: compute device.
        slot_base: the group's first slot among the hot slots of the whole sharding.
    """

    def __init__(self, config: GroupedEmbeddingConfig, hot_ids: List[torch.Tensor], device: torch.device,
                 slot_base: int = 0) -> None:
        tables = config.embedding_tables
        dims = [t.local_cols for t in tables]
        self.total_dim = sum(t.local_cols * t.num_features() for t in tables)
        sizes = [h.numel() for h in hot_ids]
        self.table_sizes, self.table_dims = sizes, dims
        self.table_features = [t.num_features() for t in tables]
        self.num_features = sum(self.table_features)
        self.num_slots, self.slot_base = sum(sizes), slot_base
        bucket, self.table_slot_start, bucket_start = hot_slot_layout(dims, sizes)
        widths = list(dict.fromkeys(dims))  # per bucket, in the layout's order
        bucket_rows = [end - start for start, end in zip(bucket_start, bucket_start[1:] + [self.num_slots])]
        rows_eff = [max(r, 1) for r in bucket_rows]  # FBGEMM's CPU TBE takes no table of 0 rows (never read)
        feature_bucket = [bucket[t] for t, tb in enumerate(tables) for _ in range(tb.num_features())]
        self._dense = DenseTableBatchedEmbeddingBagsCodegen(
            [(r, d) for r, d in zip(rows_eff, widths)],
            feature_table_map=feature_bucket,
            pooling_mode=PoolingMode.SUM,
            use_cpu=device.type != "cuda",
        ).to(device)
        self._dense.weights = torch.nn.Parameter(torch.empty(0, device=device))  # the replica is the weights
        self.flat_size = sum(r * d for r, d in zip(rows_eff, widths))
        # per slot: its width and where its row starts in the flat replica
        sizes_flat = torch.tensor([r * d for r, d in zip(rows_eff, widths)], dtype=torch.int64)
        starts = exclusive_cumsum(sizes_flat)  # the dense TBE's tables, back to back
        slot_bucket = torch.repeat_interleave(torch.arange(len(widths)), torch.tensor(bucket_rows))
        slot_row = torch.arange(self.num_slots) - torch.tensor(bucket_start, dtype=torch.int64)[slot_bucket]
        w = torch.tensor(widths, dtype=torch.int64)
        self.slot_width = w[slot_bucket]
        self.slot_flat = starts[slot_bucket] + slot_row * self.slot_width
        # per feature: the slot of row 0 of its bucket (slot - shift = the row the TBE reads)
        self.feature_shift = torch.tensor(bucket_start, dtype=torch.int64)[feature_bucket] + slot_base

    @property
    def tbe(self) -> DenseTableBatchedEmbeddingBagsCodegen:
        """The dense TBE whose layout the replica has (its per-feature ``weights_offsets``, ``D_offsets``)."""
        return self._dense

    def pool(self, replica: torch.Tensor, rows, offsets, weights: Optional[torch.Tensor],
             batch: int) -> torch.Tensor:
        """Pooled hot embeddings ``[batch, total_dim]`` (SUM) of this group's lookups.

        ``replica`` is this group's flat replica; ``rows`` are rows of the features' replica
        tables (hot slot - :attr:`feature_shift`), jagged by (feature, sample) per ``offsets``,
        which may start past 0 and leave a head unread (input_dist.py). The gradient flows to
        ``replica``.
        """
        d = self._dense
        out = torch.ops.fbgemm.dense_embedding_codegen_lookup_function(
            dev_weights=replica, weights_offsets=d.weights_offsets, D_offsets=d.D_offsets,
            total_D=d.total_D, max_D=d.max_D, hash_size_cumsum=d.hash_size_cumsum,
            total_hash_size_bits=d.total_hash_size_bits, indices=rows,  # int32 or int64, offsets alike
            offsets=offsets.to(rows.dtype), pooling_mode=d.pooling_mode,
            indice_weights=None if weights is None else weights.float(), feature_requires_grad=None,
            output_dtype=d.output_dtype,
        )
        # FBGEMM already returns [batch, total_dim]; never hand out a view: the output dist
        # adds the cold partials into this tensor in place, and an in-place op on a view makes
        # autograd clone the whole gradient (CopySlices), ~15% of a step on the headline run.
        return out if out.shape == (batch, self.total_dim) else out.reshape(batch, self.total_dim).clone()


def _cat(parts: List[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


class HotSelection(NamedTuple):
    """The hot slots that travel one step (:meth:`HotRowLayout.select`).

    mine: the slots this rank owns and sends, in sync order; slots: every sent slot in sync
    order (what each rank receives, owner after owner); per_owner: how many per owner ``[W]``;
    extra_features / extra_rows / extra_per_feature: ``mine`` as the extra one-id bags of the
    owner's cold lookup - their features (sorted), their rows there (int32), and per feature
    how many (host ints).
    """

    mine: torch.Tensor
    slots: torch.Tensor
    per_owner: torch.Tensor
    extra_features: torch.Tensor
    extra_rows: torch.Tensor
    extra_per_feature: List[int]


class HotRowLayout:
    """Where every hot slot of a sharding lives: owner, cold row, replica position, feature.

    Built once per sharding (set-up time loops over groups and tables). ``sync_order`` lists
    the slots in the order owners send them - by owner, then feature, then slot - so each
    owner's rows are one contiguous run, and each feature's extra bags are contiguous too.

    Args:
        replicas: the groups' replicas (slots numbered group after group).
        bounds: per group, per table, its row bounds (row_blocks.py: the owner blocks).
        hot_ids: sorted hot ids per table, per group.
        world / rank: the process group's size and this rank.
    """

    def __init__(self, replicas: List[HotPooling], bounds: List[List[List[int]]],
                 hot_ids: List[List[torch.Tensor]], world: int, rank: int) -> None:
        owner, row, feature, flat, width = [], [], [], [], []
        self.flat_bases, base, f = [], 0, 0  # f: first feature of the group (sharding order)
        for rep, group_bounds, ids in zip(replicas, bounds, hot_ids):
            self.flat_bases.append(base)
            slot_owner = torch.empty(rep.num_slots, dtype=torch.int64)
            slot_row, slot_feature = torch.empty_like(slot_owner), torch.empty_like(slot_owner)
            for t, (table_bounds, nf) in enumerate(zip(group_bounds, rep.table_features)):
                b = torch.tensor(table_bounds, dtype=torch.int64)
                s = slice(rep.table_slot_start[t], rep.table_slot_start[t] + ids[t].numel())
                slot_owner[s] = row_blocks.owners(ids[t], b)
                slot_row[s] = ids[t] - b[slot_owner[s]]
                slot_feature[s] = f  # the extra bags ride on the table's first feature
                f += nf
            owner.append(slot_owner)
            row.append(slot_row)
            feature.append(slot_feature)
            flat.append(rep.slot_flat + base)
            width.append(rep.slot_width)
            base += rep.flat_size
        self.owner, self.row, self.feature, self.flat, self.width = map(_cat, (owner, row, feature, flat, width))
        self.flat_size, self.world, self.rank = base, world, rank
        self.num_features = f
        self.num_slots = int(self.owner.numel())
        self.sync_order = torch.argsort(self.owner * max(f, 1) + self.feature, stable=True)
        self._all: Optional[HotSelection] = None

    def to(self, device: torch.device) -> "HotRowLayout":
        for name in ("owner", "row", "feature", "flat", "width", "sync_order"):
            setattr(self, name, getattr(self, name).to(device))
        self._all = None
        return self

    def _select(self, order: torch.Tensor) -> HotSelection:
        mine = order[self.owner[order] == self.rank]
        features = self.feature[mine]
        return HotSelection(mine, order, torch.bincount(self.owner[order], minlength=self.world), features,
                            self.row[mine].to(torch.int32),
                            torch.bincount(features, minlength=self.num_features).tolist())

    def select(self, touched: Optional[torch.Tensor]) -> HotSelection:
        """The hot slots that travel this step (:class:`HotSelection`). ``touched`` (bool
        ``[num_slots]``, the global union of this step's hot lookups) restricts them to looked-up
        rows; None sends every hot row (worked out once)."""
        if touched is None:
            if self._all is None:
                self._all = self._select(self.sync_order)
            return self._all
        return self._select(self.sync_order[touched[self.sync_order]])
