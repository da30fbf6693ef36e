"""An ``EmbeddingEnumerator`` that also offers ``frequency_hybrid`` options, one per cold layout.

The stock enumerator raises for an unknown sharding type and its estimators misprice it, so
the stock enumeration runs on sharders and constraints without ``frequency_hybrid``; then per
table up to three hybrid options are added (table-wise, row-wise and column-wise cold), each
with its hot set (``hot_set.choose_hot_rows``, carried as ``hybrid_choice``) and, unless the
constraints allow only ``frequency_hybrid``, offered only if it beats the table's cheapest
stock option by ``min_saving``. Every option is priced by the same cost model; docs/architecture.md
§6 describes the options."""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any, Dict, List, Optional, Tuple

import torch
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.types import ParameterConstraints, Shard, ShardingOption, Topology
from torchrec.distributed.types import ParameterSharding, ShardingType
from torchrec.distributed.utils import add_params_from_parameter_sharding

from torchrec_hybrid import _compat, row_blocks
from torchrec_hybrid.planner import cost_model as cm
from torchrec_hybrid.planner import hot_set
from torchrec_hybrid.planner.estimators import (BytesPerfEstimator, HybridStorageEstimator, comm_elems, on_device,
                                                optimizer_name)
from torchrec_hybrid.planner.types import HotSetChoice
from torchrec_hybrid.sharded_ebc import unsupported_fused_options
from torchrec_hybrid.sharding.output_dist import codec_problems
from torchrec_hybrid.types import FREQUENCY_HYBRID

logger = logging.getLogger(__name__)

_TEMPLATE = ShardingType.TABLE_WISE.value  # offered on every device; cloned for hybrid-only tables
DEFAULT_MAX_HOT_ROWS = 1 << 20
DEFAULT_HOT_BUDGET_FRACTION = 0.25
COLUMN_SLICE_DIM = 32  # default width of a column-wise cold slice


class _StockOnly:
    """A sharder as the stock enumerator (or TorchRec's own planner) may see it: frequency_hybrid
    hidden; ``add_template``: table_wise added if missing (hybrid options are cloned from it)."""

    def __init__(self, sharder: Any, add_template: bool = True) -> None:
        self._sharder = sharder
        self._add_template = add_template

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sharder, name)

    def sharding_types(self, compute_device_type: str) -> List[str]:
        types = [t for t in self._sharder.sharding_types(compute_device_type) if t != FREQUENCY_HYBRID]
        return types if _TEMPLATE in types or not self._add_template else types + [_TEMPLATE]


def without_hybrid(constraints: Optional[Dict[str, ParameterConstraints]], fallback: Optional[List[str]] = None
                   ) -> Optional[Dict[str, ParameterConstraints]]:
    """The constraints without ``frequency_hybrid`` (TorchRec's own planner and enumerator do
    not know it); a table it leaves with no type gets ``fallback`` (None: any type), one it leaves
    with stock types gets them and ``fallback`` (the enumerator's template of the hybrid options,
    dropped after: the types kept may be none the device offers, e.g. row_wise on CPU)."""
    if not constraints:
        return constraints
    out = {}
    for name, c in constraints.items():
        if c.sharding_types and FREQUENCY_HYBRID in c.sharding_types:
            kept = [t for t in c.sharding_types if t != FREQUENCY_HYBRID]
            if kept and fallback:
                c = dataclasses.replace(c, sharding_types=kept + [t for t in fallback if t not in kept])
            elif kept or not fallback:
                c = dataclasses.replace(c, sharding_types=kept or None)
            else:  # the fallback only templates the hybrid options: their kernels are checked apart
                c = dataclasses.replace(c, sharding_types=list(fallback), compute_kernels=None)
        out[name] = c
    return out


def _unsupported_codecs(sharder: Any) -> List[str]:
    """The sharder's quantized-comm codecs frequency_hybrid cannot honour (it refuses them at
    shard time; FP16 / BF16 on the pooled all-to-all it honours, and the cost model prices)."""
    return codec_problems(getattr(sharder, "qcomm_codecs_registry", None))


def _layout_shares(layout: str, world: int) -> torch.Tensor:
    """Owners' shares of a table's cold lookups assumed while sizing its hot set (each column
    slice of a column-wise cold table is laid out table-wise)."""
    if layout in (row_blocks.TABLE_WISE, row_blocks.COLUMN_WISE):
        return torch.nn.functional.one_hot(torch.tensor(0), world).to(torch.float64)
    return torch.full((world,), 1.0 / world, dtype=torch.float64)


def _unsupported_table_options(option: ShardingOption, sharder: Any) -> List[str]:
    """The fused options sharding would refuse for this table as frequency_hybrid
    (``sharded_ebc.check_hybrid_supported``): the sharder's fused params with the per-table ones the
    constraints put on its options (``output_dtype``, ``stochastic_rounding``, ...), merged as
    TorchRec merges them at sharding time, so the planner never plans what sharding refuses."""
    per_table = ParameterSharding(sharding_type=FREQUENCY_HYBRID, compute_kernel=option.compute_kernel,
                                  cache_params=option.cache_params, enforce_hbm=option.enforce_hbm,
                                  stochastic_rounding=option.stochastic_rounding,
                                  bounds_check_mode=option.bounds_check_mode, output_dtype=option.output_dtype,
                                  key_value_params=option.key_value_params)
    return unsupported_fused_options(add_params_from_parameter_sharding(dict(sharder.fused_params or {}), per_table))


class HybridEnumerator(EmbeddingEnumerator):
    """``EmbeddingEnumerator`` + one ``frequency_hybrid`` option per eligible table.

    Args (beyond the stock ones):
        frequency_stats: a ``FrequencyStats`` of the tables (per-row lookup counts).
        hot_budget_bytes: per-rank memory for all hot replicas (weights + optimizer state);
            default ``DEFAULT_HOT_BUDGET_FRACTION`` of a rank's memory.
        max_hot_rows: cap on H per table (bounds the curves evaluated).
        min_saving: relative step-cost saving over the best stock type needed to offer hybrid.
        compute_costs: prices of compute work (cost_model.ComputeCosts; None: bytes only).
    """

    def __init__(self, topology: Topology, batch_size: int,
                 constraints: Optional[Dict[str, ParameterConstraints]] = None,
                 estimator=None, use_exact_enumerate_order: Optional[bool] = False,
                 frequency_stats: Any = None, hot_budget_bytes: Optional[int] = None,
                 max_hot_rows: int = DEFAULT_MAX_HOT_ROWS, min_saving: float = 0.05,
                 compute_costs: Optional[cm.ComputeCosts] = None) -> None:
        super().__init__(topology, batch_size, without_hybrid(constraints, [_TEMPLATE]), estimator,
                         use_exact_enumerate_order)
        self._topology = topology
        self._settings = dict(batch_size=batch_size, estimator=estimator,
                              use_exact_enumerate_order=use_exact_enumerate_order, frequency_stats=frequency_stats,
                              hot_budget_bytes=hot_budget_bytes, max_hot_rows=max_hot_rows, min_saving=min_saving,
                              compute_costs=compute_costs)
        self._all_constraints = constraints or {}
        self._frequency_stats = frequency_stats
        if hot_budget_bytes is None:
            dev = topology.devices[0].storage
            cap = dev.hbm if on_device(topology) else dev.ddr
            hot_budget_bytes = int(cap * DEFAULT_HOT_BUDGET_FRACTION)
        self._hot_budget = hot_budget_bytes
        self._max_hot_rows = max_hot_rows
        self._min_saving = min_saving
        self._hybrid_storage = HybridStorageEstimator(topology, constraints)
        self._compute = compute_costs
        self._perf = BytesPerfEstimator(topology, cm.TrafficTable({}, gloo=topology.compute_device == "cpu"),
                                        compute_costs)
        self.choices: Dict[str, Dict[str, HotSetChoice]] = {}
        self.offered: set = set()  # tables with a hybrid option left after the gate

    @property
    def frequency_stats(self) -> Any:
        """The statistics the hybrid options are sized from (None: none given)."""
        return self._frequency_stats

    def with_constraints(self, constraints: Optional[Dict[str, ParameterConstraints]]) -> "HybridEnumerator":
        """A fresh enumerator with this one's settings and ``constraints`` (the planner's all-hybrid
        candidate is planned with the same statistics, budget and prices as its mixed plan)."""
        return HybridEnumerator(self._topology, constraints=constraints, **self._settings)

    def with_topology(self, topology: Topology) -> "HybridEnumerator":
        """A fresh enumerator with this one's settings and constraints for ``topology`` (a planner given a
        measured network sizes hot sets at its bandwidths; an ``estimator`` given keeps its own)."""
        return HybridEnumerator(topology, constraints=self._all_constraints or None, **self._settings)

    # -- constraints -------------------------------------------------------------------------
    def _allowed(self, name: str, sharding_type: str) -> bool:
        c = self._all_constraints.get(name)
        return not (c and c.sharding_types) or sharding_type in c.sharding_types

    def _asked(self, name: str) -> bool:
        c = self._all_constraints.get(name)
        return bool(c and c.sharding_types and FREQUENCY_HYBRID in c.sharding_types)

    def _sharder_kernels(self, sharder: Any) -> List[str]:
        return list(sharder.compute_kernels(FREQUENCY_HYBRID, self._topology.compute_device))

    def _hybrid_kernels(self, name: str, sharder: Any) -> List[str]:
        """The compute kernels of a table's frequency_hybrid options: the sharder's, within the
        constraints' ``compute_kernels`` where they give some (as stock types are filtered)."""
        c = self._all_constraints.get(name)
        kernels = self._sharder_kernels(sharder)
        return [k for k in kernels if k in c.compute_kernels] if c and c.compute_kernels else kernels

    def _forced(self, name: str) -> bool:
        c = self._all_constraints.get(name)
        return bool(c and c.sharding_types and set(c.sharding_types) == {FREQUENCY_HYBRID})

    # -- enumeration -------------------------------------------------------------------------
    def enumerate(self, module, sharders) -> List[ShardingOption]:
        stock = super().enumerate(module, [_StockOnly(s) for s in sharders])
        for so in stock:  # each feature's batch and poolings, as the constraints give them
            cm.stamp_feature_batches(so, self._all_constraints)
        by_type = {s.module_type: s for s in sharders}
        by_table: Dict[Tuple[str, str], List[ShardingOption]] = {}
        for so in stock:
            by_table.setdefault((so.path, so.name), []).append(so)
        candidates, fixed, why_not = self._hybrid_candidates(by_table, by_type)
        offered = {s.module_type: set(s.sharding_types(self._topology.compute_device)) for s in sharders}
        out = [so for so in stock if self._allowed(so.name, so.sharding_type)
               and so.sharding_type in offered.get(type(so.module[1]), {so.sharding_type})]
        hybrid = self._hybrid_options(candidates, fixed, by_type)
        self.populate_estimates(out + hybrid)
        hybrid = self._gate(hybrid, out)
        self.offered = {so.name for so in hybrid}
        missing = {n for (_, n) in by_table} - {so.name for so in out + hybrid}
        if missing:
            detail = "; ".join(f"table '{n}': {FREQUENCY_HYBRID} is not possible: {why_not[n]}"
                               for n in sorted(missing) if n in why_not)
            raise ValueError(f"no sharding option left for tables {sorted(missing)} after the constraints and the "
                             f"sharding types the sharders offer" + (f" ({detail})" if detail else "")
                             + "; allow a stock sharding type for them (constraints or the sharder's "
                             "sharding_types)")
        return out + hybrid

    def _hybrid_candidates(
        self, by_table: Dict[Tuple[str, str], List[ShardingOption]], by_type: Dict[Any, Any]
    ) -> Tuple[Dict[str, Tuple[ShardingOption, cm.TableProfile]], Dict[str, int], Dict[str, str]]:
        """The tables that may be frequency_hybrid: ``(name -> (a stock option as template,
        profile), name -> fixed hot rows, name -> why not)`` for the ones that cannot."""
        candidates: Dict[str, Tuple[ShardingOption, cm.TableProfile]] = {}
        fixed: Dict[str, int] = {}
        why_not: Dict[str, str] = {}  # tables the constraints or the sharder ask hybrid for, but cannot have it
        for (_, name), opts in by_table.items():
            sharder = by_type.get(type(opts[0].module[1]))
            if sharder is None or FREQUENCY_HYBRID not in sharder.sharding_types(self._topology.compute_device):
                if self._asked(name):
                    self._refuse_unoffered(name, opts[0], sharder)
                continue
            if not self._allowed(name, FREQUENCY_HYBRID):
                continue
            why = None
            if not self._hybrid_kernels(name, sharder):
                kernels = list(self._all_constraints[name].compute_kernels or [])
                why = f"its constraints allow compute kernels {kernels}, but {FREQUENCY_HYBRID} runs on " \
                      f"{self._sharder_kernels(sharder)}"
            elif codecs := _unsupported_codecs(sharder):
                why = (f"its sharder has quantized comms {FREQUENCY_HYBRID} cannot honour "
                       f"({', '.join(codecs)}; only FP16 / BF16 / FP32 codecs)")
            elif refused := _unsupported_table_options(opts[0], sharder):
                why = f"its fused options are not supported by {FREQUENCY_HYBRID}: {'; '.join(refused)}"
            if why is not None:
                why_not[name] = why
                logger.info("table %s: frequency_hybrid not offered: %s", name, why)
                continue
            profile, n_fixed = self._profile(opts[0], sharder)
            candidates[name] = (opts[0], profile)
            if n_fixed is not None:
                fixed[name] = n_fixed
        return candidates, fixed, why_not

    @staticmethod
    def _refuse_unoffered(name: str, option: ShardingOption, sharder) -> None:
        """The constraints ask for frequency_hybrid where the table's sharder does not offer it."""
        module_type = type(option.module[1]).__name__
        raise ValueError(
            f"table '{name}' ({module_type} '{option.path}'): the constraints ask for "
            f"{FREQUENCY_HYBRID}, but its sharder ({type(sharder).__name__}) does not offer it. "
            f"{FREQUENCY_HYBRID} is only for pooled EmbeddingBagCollection tables sharded by "
            "HybridEmbeddingBagCollectionSharder (not EmbeddingCollection, not "
            "FeatureProcessedEmbeddingBagCollection); give this table a stock sharding type")

    def _hybrid_options(self, candidates, fixed, by_type) -> List[ShardingOption]:
        """Per candidate table and cold layout, its hot set (sized jointly for all tables of a
        layout) and one option per compute kernel; records ``self.choices``."""
        world = self._topology.world_size
        hybrid: List[ShardingOption] = []
        self.choices = {}
        bw = cm.a2a_bandwidth(self._topology)
        for layout in row_blocks.COLD_LAYOUTS:
            profiles = {
                n: dataclasses.replace(p, shares=_layout_shares(layout, world),
                                       virtual=self._sizing_virtual(template, by_type, p, layout))
                for n, (template, p) in candidates.items()
            }
            hot_rows = hot_set.choose_hot_rows(profiles, self._hot_budget, bw, fixed, self._compute)
            # column slices only for a table too hot for one rank: table-wise cold, its bytes exceed a
            # rank's even share of every candidate's (the cut costs its ids once per slice, and mixed
            # widths move partial sums in smaller units)
            tw = {n: by_layout[row_blocks.TABLE_WISE].bytes_per_step for n, by_layout in self.choices.items()
                  if row_blocks.TABLE_WISE in by_layout}
            for name, (template, _) in candidates.items():
                if template.tensor.shape[0] < world and layout != row_blocks.TABLE_WISE:
                    continue  # fewer rows than ranks: only every row on one owner (no empty block to hold)
                too_hot = tw.get(name, 0.0) * world > sum(tw.values())
                widths = self._widths(template, layout, too_hot)
                if not widths:
                    continue
                choice = self._choice(name, profiles[name], hot_rows[name], layout, widths)
                self.choices.setdefault(name, {})[layout] = choice
                sharder = by_type[type(template.module[1])]
                for kernel in self._hybrid_kernels(name, sharder):
                    hybrid.append(self._hybrid_option(template, kernel, choice))
        return hybrid

    def _sizing_virtual(self, template: ShardingOption, by_type: Dict[Any, Any], profile: cm.TableProfile,
                        layout: str) -> Optional[torch.Tensor]:
        """The owners the hot-set sizing of ``layout`` prices on FBGEMM's scalar CPU backward, as placement
        does (``FrequencyHybrid.virtual_owners``): a table-wise (or column-slice) owner - rank 0 of the sizing's
        shares - where the table's lookups would take that path; row-wise blocks are sized as even ones,
        which no owner holds most of."""
        if layout == row_blocks.ROW_WISE:
            return None
        sharder = by_type.get(type(template.module[1]))
        params = getattr(sharder, "fused_params", None)
        scalar = self._topology.compute_device == "cpu" and cm.vectorised_cpu_backward(params)
        t = profile.traffic
        return cm.HYBRID.virtual_owners(t, row_blocks.single_owner_bounds(t.rows, t.world, 0), scalar, template)

    def _gate(self, hybrid: List[ShardingOption], stock: List[ShardingOption]) -> List[ShardingOption]:
        """Hybrid options that beat the table's cheapest stock option by ``min_saving`` (by
        the same cost model), or that the constraints force."""
        best: Dict[str, ShardingOption] = {}
        world = self._topology.world_size
        for so in stock:
            if so.name not in best or so.total_perf < best[so.name].total_perf:
                best[so.name] = so
        kept = []
        for so in hybrid:
            ch = so.hybrid_choice
            ch.step_cost = so.total_perf
            cheapest = best.get(so.name)
            ch.best_stock_cost = None if cheapest is None else cheapest.total_perf
            ch.best_stock_type = None if cheapest is None else cheapest.sharding_type
            ch.best_stock_bytes = None if cheapest is None else cm.option_mean_bytes(cheapest, world)
            if (
                ch.forced
                or ch.best_stock_cost is None
                or so.total_perf <= (1.0 - self._min_saving) * ch.best_stock_cost
            ):
                kept.append(so)
            else:
                logger.info("table %s: frequency_hybrid (%s cold, H=%d) not offered: %.3g vs stock %.3g", so.name,
                            ch.cold_layout, ch.hot_rows, so.total_perf, ch.best_stock_cost)
        return kept

    def _profile(self, so: ShardingOption, sharder: Any) -> Tuple[cm.TableProfile, Optional[int]]:
        """The table's coverage curve: statistics, else the sharder's hot ids, else uniform
        (its traffic priced with the sharder's quantized comms, so H is sized for them too)."""
        w = self._topology.world_size
        data_map = _compat.enumerator_sharder_data_map(self)
        tr = cm.traffic_of(so, w, comm_elems(data_map, so) or cm.FP32_COMMS)
        per_row = tr.dim * so.tensor.element_size() + cm.optimizer_state_bytes_per_row(
            optimizer_name(data_map, so), tr.dim)
        cap = min(self._max_hot_rows, tr.rows)
        st = self._frequency_stats
        if st is not None and so.name in getattr(st, "table_names", []):
            return hot_set.profile_from_stats(st, so.name, tr, per_row, cap), None
        given = (getattr(sharder, "hot_ids", None) or {}).get(so.name)
        if given is not None and torch.as_tensor(given).numel() > 0:
            ids = torch.as_tensor(given).to(torch.int64)
            if ids.numel() > self._max_hot_rows:  # a fixed set is the user's: refused, not cut or kept silently
                raise ValueError(f"table '{so.name}': the sharder's hot_ids hold {ids.numel()} rows, more than "
                                 f"max_hot_rows={self._max_hot_rows}: pass a larger max_hot_rows or fewer hot_ids")
            return hot_set.profile_uniform(tr, per_row, cap, ids, source="sharder"), ids.numel()
        return hot_set.profile_uniform(tr, per_row, 0), None  # no ids known: no hot rows

    def _widths(self, template: ShardingOption, layout: str, too_hot: bool = False) -> List[int]:
        """The column slices' widths of a layout: the full width for row layouts; for
        column-wise cold of a table ``too_hot`` for one rank (or with a ``min_partition``) up to
        ``min(W, cols // COLUMN_SLICE_DIM)`` slices of one width, a multiple of 4 (the
        constraint's ``min_partition`` sets the width instead), none under two."""
        cols = int(template.tensor.shape[1])
        if layout != row_blocks.COLUMN_WISE:
            return [cols]
        c = self._all_constraints.get(template.name)
        if not (too_hot or (c is not None and c.min_partition)):  # asked for by a min_partition, or too hot
            return []
        width = c.min_partition if c is not None and c.min_partition else COLUMN_SLICE_DIM
        for k in range(min(self._topology.world_size, cols // max(1, width)), 1, -1):  # equal widths (two
            if cols % k == 0 and (cols // k) % 4 == 0:  # slices may share a rank, so one TBE)
                return [cols // k] * k
        return []

    def _choice(self, name: str, p: cm.TableProfile, h: int, layout: str, widths: List[int]) -> HotSetChoice:
        cov = p.coverage_at(h)
        parts = {k: float(v) for k, v in cm.HYBRID.parts(p.traffic, cov, h).items()}
        assert p.shares is not None  # every profile here has its cold layout's shares
        sent = sum(float(cm.HYBRID.layout_bytes(dataclasses.replace(p.traffic, dim=w), cov, h, p.shares))
                   for w in widths)
        return HotSetChoice(
            table=name, hot_rows=h, coverage=cov, hot_ids=p.hot_ids(h), widths=widths,
            bytes_per_step=sent, comm_bytes=parts,
            source=p.source, forced=self._forced(name), cold_layout=layout, profile=p,
        )

    def _hybrid_option(self, template: ShardingOption, kernel: str, choice: HotSetChoice) -> ShardingOption:
        """A hybrid option: table-wise cold is one shard the partitioner places like a
        table_wise table; row-wise cold is one row block per rank, of equal lookup cost."""
        so = copy.deepcopy(template)
        so.sharding_type, so.compute_kernel = FREQUENCY_HYBRID, kernel
        rows, cols = template.tensor.shape[0], template.tensor.shape[1]
        w = self._topology.world_size
        if choice.cold_layout == row_blocks.TABLE_WISE:
            so.partition_by = "device"
            so.shards = [Shard(size=[rows, cols], offset=[0, 0])]
        elif choice.cold_layout == row_blocks.COLUMN_WISE:  # one shard per slice, placed like stock column_wise's
            so.partition_by = "device"
            so.shards = [Shard(size=[rows, w], offset=[0, sum(choice.widths[:i])]) for i, w in enumerate(choice.widths)]
        else:
            so.partition_by = "uniform"
            p = choice.profile
            bounds = (p.balanced_bounds(choice.hot_rows, w) if p.source == "stats"
                      else row_blocks.even_bounds(rows, w))
            so.shards = [Shard(size=[b1 - b0, cols], offset=[b0, 0]) for b0, b1 in zip(bounds, bounds[1:])]
        so.hybrid_choice = choice
        return so

    def populate_estimates(self, sharding_options: List[ShardingOption]) -> None:
        """Storage: TorchRec's estimator for stock options, ours for hybrid ones. Perf: one
        cost model for every option (cost_model.py), so the partitioner compares like with like."""
        stock = [so for so in sharding_options if so.sharding_type != FREQUENCY_HYBRID]
        hybrid = [so for so in sharding_options if so.sharding_type == FREQUENCY_HYBRID]
        if stock:
            super().populate_estimates(stock)
        sharder_data_map = _compat.enumerator_sharder_data_map(self)
        if hybrid:
            self._hybrid_storage.estimate(hybrid, sharder_data_map=sharder_data_map)
        self._perf.estimate(sharding_options, sharder_data_map=sharder_data_map)
