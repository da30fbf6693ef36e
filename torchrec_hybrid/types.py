"""Names shared by every part of the package: the sharding type string, its plan entry, hot-set checks.

TorchRec's ``ShardingType`` is a closed Enum, so the new type is a plain string that the
sharder offers next to the stock values. ``hot_ids[table]`` is the set of rows replicated on
every rank; it must be identical everywhere, so it is validated collectively at shard time.
A ``HybridParameterSharding`` is a stock ``ParameterSharding`` plus the table's hot ids, so
a plan (pickled, broadcast by ``collective_plan``, saved to disk) reproduces the same hot
set on every rank; the sharded module reads ``parameter_sharding.hot_ids`` and prefers it
over the sharder's.
"""

from dataclasses import dataclass, fields
from typing import Any, Dict, List, Mapping, Optional

import torch
import torch.distributed as dist
from torchrec.distributed.types import ParameterSharding
from torchrec.modules.embedding_configs import EmbeddingBagConfig

FREQUENCY_HYBRID = "frequency_hybrid"

HotIds = Mapping[str, torch.Tensor]

# The cold exchange's rooms (sharding/cold_all_to_all.py), which the cost model prices: a pair's room
# for the next exchange is ROOM_SLACK times its run plus ROOM_PAD int32 words, when (re)sized.
ROOM_SLACK = 1.15
ROOM_PAD = 128


class HotSetError(ValueError):
    """A ``hot_ids`` entry is malformed or differs between ranks."""


@dataclass(eq=False)
class HybridParameterSharding(ParameterSharding):
    """``ParameterSharding`` of a ``frequency_hybrid`` table.

    hot_ids: sorted distinct int64 row ids replicated on every rank (None: the sharder's).
    hot_rows: number of hot rows the planner priced (== hot_ids.numel() when ids are known).
    cold_layout: where the cold rows live (row_blocks.py).
    pooling_factor: ids per sample of the table's bags, the largest over its features of its
        sharding option's ``input_lengths`` (the constraints', else measured from the
        statistics, else TorchRec's default 1.0); None in a hand-written plan that gives none.
        A rank holding most of a multi-hot table's cold rows looks it up in a TBE call of its
        own (lookup.py: ``own_lane_pays``).
    """

    hot_ids: Optional[torch.Tensor] = None
    hot_rows: int = 0
    cold_layout: str = "row_wise"
    pooling_factor: Optional[float] = None

    @classmethod
    def from_stock(cls, ps: ParameterSharding, **changes: Any) -> "HybridParameterSharding":
        """A stock entry's fields (those of ``ParameterSharding``) with ``changes`` applied."""
        base = {f.name: getattr(ps, f.name) for f in fields(ParameterSharding)}
        return cls(**{**base, **changes})

    def __eq__(self, other: object) -> bool:  # dataclass eq would call bool() on a tensor
        if not isinstance(other, HybridParameterSharding):
            return False
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)):
                    return False
            elif a != b:
                return False
        return True

    # unhashable (mutable), like ParameterSharding; typeshed types object.__hash__ as a method only
    __hash__ = None  # type: ignore[assignment]


def _local_hot_problem(name: str, ids: torch.Tensor, num_embeddings: int) -> Optional[str]:
    if ids.dim() != 1:
        return f"table '{name}': hot_ids must be 1-D, got shape {tuple(ids.shape)}"
    if ids.dtype not in (torch.int64, torch.int32):
        return f"table '{name}': hot_ids must be an integer tensor, got {ids.dtype}"
    if ids.numel() == 0:
        return None
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_embeddings:
        bad = lo if lo < 0 else hi
        return f"table '{name}': hot id {bad} is outside [0, {num_embeddings})"
    uniq = torch.unique(ids)
    if uniq.numel() != ids.numel():
        srt = torch.sort(ids.to(torch.int64)).values
        dup = int(srt[1:][srt[1:] == srt[:-1]][0])
        return f"table '{name}': hot id {dup} appears more than once"
    return None


def normalize_hot_ids(
    hot_ids: HotIds,
    configs: List[EmbeddingBagConfig],
    pg: Optional[dist.ProcessGroup] = None,
) -> Dict[str, torch.Tensor]:
    """Checks ``hot_ids`` for ``configs`` on every rank and returns sorted int64 CPU tensors.

    Local problems (out of range, duplicates, wrong shape) and cross-rank differences raise
    :class:`HotSetError` on *every* rank: verdicts are exchanged with two small all-gathers
    before anyone raises, so no rank is left waiting in a collective.
    """
    out, problems = _sorted_local_hot_ids(hot_ids, configs)
    if pg is None or dist.get_world_size(pg) == 1:
        if problems:
            raise HotSetError("; ".join(problems))
        return out
    dev = collective_device(pg)
    _check_verdicts_and_sizes(out, problems, configs, pg, dev)
    _check_same_ids(out, configs, pg, dev)
    return out


def _sorted_local_hot_ids(hot_ids: HotIds, configs: List[EmbeddingBagConfig]):
    """Each table's hot ids as a sorted int64 CPU tensor (empty for a table absent or malformed) and this
    rank's problems: a bad entry is replaced, not raised, so the ranks can still exchange verdicts."""
    problems: List[str] = []
    out: Dict[str, torch.Tensor] = {}
    for c in configs:
        ids = hot_ids.get(c.name, torch.empty(0, dtype=torch.int64))
        ids = torch.as_tensor(ids).detach().cpu()
        if ids.numel() == 0 and ids.dim() == 1:  # an empty list is no hot row (as_tensor makes it float32)
            ids = ids.to(torch.int64)
        msg = _local_hot_problem(c.name, ids, c.num_embeddings)
        if msg:
            problems.append(msg)
            ids = torch.empty(0, dtype=torch.int64)
        out[c.name] = torch.sort(ids.to(torch.int64)).values
    return out, problems


def _check_verdicts_and_sizes(out: Dict[str, torch.Tensor], problems: List[str], configs: List[EmbeddingBagConfig],
                              pg: dist.ProcessGroup, dev: torch.device) -> None:
    """First all-gather: every rank's problem count and hot-set sizes; raise on every rank if any rank has a
    problem or the sizes differ (then the ids' all-gather below would not line up)."""
    world = dist.get_world_size(pg)
    counts = torch.tensor([len(problems)] + [out[c.name].numel() for c in configs], dtype=torch.int64)
    gathered = [torch.zeros_like(counts, device=dev) for _ in range(world)]
    dist.all_gather(gathered, counts.to(dev), group=pg)
    gathered_cpu = torch.stack([g.cpu() for g in gathered])
    if int(gathered_cpu[:, 0].sum()) > 0:
        bad_ranks = [r for r in range(world) if int(gathered_cpu[r, 0]) > 0]
        mine = f" (this rank: {'; '.join(problems)})" if problems else ""
        raise HotSetError(f"invalid hot_ids on rank(s) {bad_ranks}{mine}")
    for i, c in enumerate(configs):
        col = gathered_cpu[:, i + 1]
        if not bool((col == col[0]).all()):
            raise HotSetError(
                f"table '{c.name}': hot_ids differ between ranks (sizes per rank {col.tolist()})"
            )


def _check_same_ids(out: Dict[str, torch.Tensor], configs: List[EmbeddingBagConfig], pg: dist.ProcessGroup,
                    dev: torch.device) -> None:
    """Second all-gather: every rank's hot ids, all tables in one tensor; raise naming the first table and rank
    whose ids differ from this rank's."""
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    flat = torch.cat([out[c.name] for c in configs]) if configs else torch.empty(0, dtype=torch.int64)
    all_flat = [torch.zeros_like(flat, device=dev) for _ in range(world)]
    dist.all_gather(all_flat, flat.to(dev), group=pg)
    pos = 0
    for c in configs:
        n = out[c.name].numel()
        for r in range(world):
            if not torch.equal(all_flat[r][pos : pos + n].cpu(), out[c.name]):
                raise HotSetError(f"table '{c.name}': hot_ids on rank {r} differ from rank {rank}'s")
        pos += n


def collective_device(pg: dist.ProcessGroup) -> torch.device:
    """Tensors for a collective must live where the backend wants them (NCCL: cuda)."""
    if dist.get_backend(pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
