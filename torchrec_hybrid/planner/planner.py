"""``HybridEmbeddingShardingPlanner``: TorchRec's planner, aware of ``frequency_hybrid``.

Same constructor arguments and methods as ``EmbeddingShardingPlanner`` (``plan``,
``collective_plan``), plus frequency statistics and hot-set options. Per table the search
space holds the stock options and, where it pays (see ``enumerator.py``), one
``frequency_hybrid`` option whose hot set H minimises the estimated step cost within the
per-rank hot-row budget. The stock proposers/partitioner then choose among them by the
estimated perf. Hybrid tables come out of ``plan`` as :class:`HybridParameterSharding` with
their hot ids, so the plan alone reproduces the sharding on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import pickle
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torchrec.distributed.comm import get_local_size, get_topology_domain_multiple
from torchrec.distributed.planner.constants import POOLING_FACTOR
from torchrec.distributed.planner.planners import EmbeddingShardingPlanner
from torchrec.distributed.planner.types import (ParameterConstraints, PlannerError, PlannerErrorType,
                                              ShardingOption, Stats, Topology)
from torchrec.distributed.planner.utils import placement
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import EnumerableShardingSpec, ShardingPlan, ShardMetadata
from torchrec.distributed.utils import get_device_type

from torchrec_hybrid import _compat
from torchrec_hybrid.planner import cost_model as cm
from torchrec_hybrid.planner.compute_costs import default_compute_costs, finite_nonnegative
from torchrec_hybrid.planner.enumerator import DEFAULT_MAX_HOT_ROWS, HybridEnumerator, _StockOnly, without_hybrid
from torchrec_hybrid.planner.estimators import StepPerfModel, on_device, sharder_comms, sharder_vectorised_backward
from torchrec_hybrid.planner.network import NetworkMeasurement, measure_network
from torchrec_hybrid.planner.stats import HybridEmbeddingStats
from torchrec_hybrid.sharding_plan import check_hot_ids, embedding_table_names
from torchrec_hybrid.types import FREQUENCY_HYBRID, HybridParameterSharding

logger = logging.getLogger(__name__)

# what another rank raises for an error planning on rank 0: the first of these its class derives from
_BROADCAST_ERRORS = (ValueError, TypeError, KeyError, RuntimeError, Exception)
_BROADCAST_ERRORS_BY_NAME = {c.__name__: c for c in _BROADCAST_ERRORS}


def _is_frequency_stats(obj: Any) -> bool:
    return hasattr(obj, "top_counts") and hasattr(obj, "lookups") and hasattr(obj, "table_names")


def constraints_with_measured_pooling(constraints: Optional[Dict[str, ParameterConstraints]],
                                      frequency_stats: Any) -> Optional[Dict[str, ParameterConstraints]]:
    """Pooling factors per feature from the statistics where the constraints leave the default.

    All estimators (stock and hybrid) then price the same, measured, ids per bag.
    """
    if frequency_stats is None or not frequency_stats.num_samples:
        return constraints
    out = dict(constraints or {})
    for cfg in frequency_stats.tables:
        feats = max(1, len(cfg.feature_names))
        mean = frequency_stats.lookups(cfg.name) / (frequency_stats.num_samples * feats)
        c = out.get(cfg.name)
        if c is None:
            out[cfg.name] = ParameterConstraints(pooling_factors=[mean] * feats)
        elif list(c.pooling_factors) == [POOLING_FACTOR]:
            # one entry per feature, as the pooling factors now have: a single batch size or poolings
            # count given for a shared table is each of its features' (TorchRec asserts equal lengths)
            per_feature = {k: list(v) * feats for k in ("batch_sizes", "num_poolings")
                           if (v := getattr(c, k)) is not None and len(v) == 1}
            out[cfg.name] = dataclasses.replace(c, pooling_factors=[mean] * feats, **per_feature)
    return out


def choose_plan(allowed: List["PlanCandidate"], stock: Optional["PlanCandidate"], tie_ms: float,
                min_saving: float, tie_rel: float = 0.0, stock_margin: float = 0.0) -> "PlanCandidate":
    """Of the plans that pay for themselves (``stock``, or one saving ``min_saving`` of the
    stock plan's cost or of its busiest-rank bytes, and, with a ``stock_margin``, costing less than
    ``1 - stock_margin`` of the stock plan: beating it by more than the prices can tell), the fewest
    busiest-rank bytes among those costed at most ``tie_ms + tie_rel * cheapest`` above the cheapest
    (cost breaks a tie in bytes)."""
    keep = 1 - min_saving
    paying = [c for c in allowed if stock is None or c is stock
              or ((c.cost["cost_ms"] <= keep * stock.cost["cost_ms"]
                   or c.cost["busiest_bytes"] <= keep * stock.cost["busiest_bytes"])
                  and (stock_margin <= 0 or c.cost["cost_ms"] <= (1 - stock_margin) * stock.cost["cost_ms"]))]
    cheapest = min(c.cost["cost_ms"] for c in paying)
    tied = [c for c in paying if c.cost["cost_ms"] <= cheapest * (1 + tie_rel) + tie_ms]
    return min(tied, key=lambda c: (c.cost["busiest_bytes"], c.cost["cost_ms"]))


@dataclasses.dataclass
class PlanCandidate:
    """One plan the hybrid planner considered, priced by ``cost_model.plan_cost``; ``stats_call``: the arguments
    its planner called its ``Stats`` loggers with (:class:`_RecordedStats`), for the plan returned."""

    name: str
    plan: ShardingPlan
    options: List[ShardingOption]
    cost: Dict[str, float]
    rank_bytes: List[float]
    stats_call: Optional[Dict[str, Any]] = None


class _RecordedStats(Stats):
    """A ``Stats`` logger that keeps each call's arguments instead of logging: every candidate's
    planner logs into one, and only the plan returned is logged, to the user's loggers (TorchRec's
    planner logs its partitioner's best plan before the candidates are compared)."""

    def __init__(self) -> None:
        self.calls: List[Dict[str, Any]] = []

    def log(self, sharding_plan, topology, batch_size, storage_reservation, num_proposals, num_plans, run_time,
            best_plan, constraints=None, sharders=None, enumerator=None, debug=False, debug_stats=None) -> None:
        self.calls.append(dict(sharding_plan=sharding_plan, topology=topology, batch_size=batch_size,
                               storage_reservation=storage_reservation, num_proposals=num_proposals,
                               num_plans=num_plans, run_time=run_time, best_plan=best_plan, constraints=constraints,
                               sharders=sharders, enumerator=enumerator, debug=debug, debug_stats=debug_stats))

    def last(self) -> Optional[Dict[str, Any]]:
        return self.calls[-1] if self.calls else None


class HybridEmbeddingShardingPlanner(EmbeddingShardingPlanner):
    """``EmbeddingShardingPlanner`` that also plans ``frequency_hybrid`` tables.

    Args: those of ``EmbeddingShardingPlanner`` - the search settings (``storage_reservation``,
    ``proposer``, ``partitioner``, ``performance_model``, ``callbacks``, ``timeout_seconds``)
    apply to every candidate plan below, TorchRec's included (so callbacks see each candidate,
    and each candidate's search may take ``timeout_seconds``); ``enumerator`` must be a
    :class:`HybridEnumerator`; ``plan_loader`` needs ``compare_plans=False`` (the loaded plan
    is not compared); constraints naming no table of the module raise - and
        stats: as in TorchRec (``Stats`` loggers), or a ``FrequencyStats`` (then taken as
            ``frequency_stats`` and the default :class:`HybridEmbeddingStats` logs).
        frequency_stats: per-row lookup counts of the tables (``torchrec_hybrid.stats``).
            Without them a table can only go hybrid when forced by constraints, with the
            sharder's hot ids (or none).
        hot_budget_bytes: per-rank memory for all hot replicas incl. optimizer state
            (default: a quarter of a rank's memory).
        max_hot_rows: cap on hot rows per table. min_saving: relative saving a hybrid
            option must show in cost over the table's cheapest stock option to be offered,
            and a plan other than the stock plan in cost or in busiest-rank bytes over it
            to be returned.
        collective_ms: fixed cost of one collective in the plan comparison (cost_model.py);
            None: the compute prices' own (fitted from measured steps), else 0.2 ms.
        compute_costs: prices of each rank's compute work (``cost_model.ComputeCosts``, fitted
            by ``benchmarks/calibrate.py``); "default": the fit for the topology's compute
            device (``compute_costs.py``); None: bytes and collectives only.
        compare_plans: also plan with TorchRec's own planner and with every eligible table
            hybrid and choose among the three priced with the same model (default), as below.
        tie_ms: plans whose costs lie within this many ms of the cheapest are a tie, broken
            by the fewest busiest-rank bytes; ``"fit_error"``: the prices' own RMS error per
            rank (``ComputeCosts.rms_ms``): plans the fit cannot tell apart go to the one whose
            bytes are surely fewer; ``"auto"`` (default): no band (the cheapest wins).
        stock_margin: the share of TorchRec's plan's cost another plan must save to replace it;
            ``"auto"`` (default): the compute prices' relative error (``ComputeCosts.rms_rel``,
            which ``benchmarks/calibrate.py`` writes) where they carry one - a plan the fit cannot
            tell from TorchRec's loses to it, so a near-tie never costs a step slower than stock -,
            else 0 (bytes and collectives are priced exactly).
        network: the bandwidths to plan for. None: the topology's as given. ``"measure"``:
            ``collective_plan`` measures its process group first (``network.measure_network``,
            about a second, every rank) and plans as if built with that measurement (``plan``
            without a group raises until then). A :class:`NetworkMeasurement`: plan with it (one
            measurement shared by several planners): the topology (TorchRec's default one where
            none is given) with its bandwidths (``NetworkMeasurement.apply_to``, every other field
            kept; a :class:`HybridEnumerator` given is rebuilt for it too), and its fixed cost per
            collective as ``collective_ms`` unless that is given or the compute prices carry one (fitted
            from whole steps with them). Kept as :attr:`network`.

    ``plan`` compares TorchRec's own plan (stock types only), the partitioner's plan over stock and
    hybrid options and the plan with every eligible table hybrid, and returns one by
    :func:`choose_plan` among those that fit every rank's memory with the hot replicas counted and
    send no more busiest-rank bytes than stock (the others are in :attr:`left_out`, logged; none
    left is a ``PlannerError``). docs/architecture.md §6 has the rules. The ``stats`` loggers
    describe the plan returned, once.
    """

    def __init__(self, topology=None, batch_size=None, enumerator=None, storage_reservation=None,
                 proposer=None, partitioner=None, performance_model=None, stats=None, constraints=None,
                 debug: bool = True, callbacks=None, timeout_seconds=None, plan_loader=None, *,
                 frequency_stats: Any = None, hot_budget_bytes: Optional[int] = None,
                 max_hot_rows: int = DEFAULT_MAX_HOT_ROWS, min_saving: float = 0.05,
                 collective_ms: Optional[float] = None, compare_plans: bool = True,
                 compute_costs: Any = "default", tie_ms: Any = "auto", network: Any = None,
                 stock_margin: Any = "auto") -> None:
        measure = isinstance(network, str) and network == "measure"
        if network is not None and not isinstance(network, NetworkMeasurement) and not measure:
            raise (ValueError if isinstance(network, str) else TypeError)(
                f"network must be None, 'measure' or a NetworkMeasurement, got {network!r}")
        # every argument as given: collective_plan sets the planner up again for the network it measures
        self._given = dict(topology=topology, batch_size=batch_size, enumerator=enumerator,
                           storage_reservation=storage_reservation, proposer=proposer, partitioner=partitioner,
                           performance_model=performance_model, stats=stats, constraints=constraints, debug=debug,
                           callbacks=callbacks, timeout_seconds=timeout_seconds, plan_loader=plan_loader,
                           frequency_stats=frequency_stats, hot_budget_bytes=hot_budget_bytes,
                           max_hot_rows=max_hot_rows, min_saving=min_saving, collective_ms=collective_ms,
                           compare_plans=compare_plans, compute_costs=compute_costs, tie_ms=tie_ms,
                           stock_margin=stock_margin)
        self._measure = measure
        self.network: Optional[NetworkMeasurement] = network if isinstance(network, NetworkMeasurement) else None
        if stats is not None and _is_frequency_stats(stats):
            if frequency_stats is not None and frequency_stats is not stats:
                raise ValueError("stats is a FrequencyStats and frequency_stats is another one: pass the "
                                 "statistics once (frequency_stats=...)")
            frequency_stats, stats = stats, None
        if enumerator is not None and not isinstance(enumerator, HybridEnumerator):
            raise TypeError(f"enumerator must be a HybridEnumerator (it adds the {FREQUENCY_HYBRID} options), not "
                            f"{type(enumerator).__name__}: TorchRec's EmbeddingEnumerator raises for "
                            f"{FREQUENCY_HYBRID}; its stock options come from HybridEnumerator's own base class")
        if enumerator is not None and enumerator.frequency_stats is not None:
            if frequency_stats is not None and frequency_stats is not enumerator.frequency_stats:
                raise ValueError("frequency_stats and the enumerator's frequency_stats are two different "
                                 "FrequencyStats: pass the statistics once (the enumerator sizes the hybrid "
                                 "options from its own)")
            frequency_stats = enumerator.frequency_stats  # the enumerator's sizes every candidate's hybrid options
        if plan_loader is not None and compare_plans:
            raise ValueError("plan_loader with compare_plans=True: the comparison with TorchRec's plan and the "
                             "all-hybrid plan could return another plan than the loaded one; pass "
                             "compare_plans=False to plan with the loader")
        _check_planner_numbers(max_hot_rows=max_hot_rows, min_saving=min_saving, hot_budget_bytes=hot_budget_bytes,
                               collective_ms=collective_ms)
        self._user_constraints = constraints
        if isinstance(compute_costs, str):
            if compute_costs != "default":
                raise ValueError(f"compute_costs={compute_costs!r}: pass a ComputeCosts, None or 'default'")
            compute_costs = default_compute_costs(topology.compute_device if topology is not None else "cuda")
        elif compute_costs is not None and not isinstance(compute_costs, cm.ComputeCosts):
            raise TypeError(f"compute_costs must be a ComputeCosts, None or 'default', not {type(compute_costs)}")
        if self.network is not None:  # as if the user had passed the measured topology
            topology = self.network.apply_to(topology if topology is not None else _default_topology())
            if enumerator is not None:
                enumerator = enumerator.with_topology(topology)
        # a collective's fixed cost: the user's; else the compute prices' own (fitted with them from whole steps,
        # where part of a collective's latency hides behind other ranks' work); else the measured network's
        # (a collective alone); else a default
        fitted = compute_costs.collective_ms if compute_costs is not None else None
        if collective_ms is None:
            collective_ms = fitted if fitted is not None else (
                self.network.collective_ms if self.network is not None else cm.DEFAULT_COLLECTIVE_MS)
        if self.network is not None:
            logger.info("planning for the measured %s; collective_ms %.3f", self.network, collective_ms)
        what = "tie_ms"
        tie_rel = 0.0
        if tie_ms == "auto":
            tie_ms = 0.0
        if isinstance(stock_margin, str) and stock_margin == "auto":
            rel = compute_costs.rms_rel if compute_costs is not None else None
            if rel is not None and not finite_nonnegative(rel):
                raise ValueError(f"compute_costs.rms_rel (from {compute_costs.source}) must be a finite share >= 0, "
                                 f"got {rel!r}")
            stock_margin = float(rel or 0.0)  # an error of 100% or more: TorchRec's plan always wins
        elif not finite_nonnegative(stock_margin) or stock_margin >= 1:
            raise ValueError(f"stock_margin must be 'auto' or a share of a cost in [0, 1), got {stock_margin!r}")
        if tie_ms == "fit_error":  # the prices' own fit error
            if compute_costs is None or compute_costs.rms_ms is None:
                raise ValueError("tie_ms='fit_error' needs compute prices that carry their fit's error (rms_ms, "
                                 "a calibration file of benchmarks/calibrate.py), got "
                                 f"{None if compute_costs is None else compute_costs.source}")
            tie_ms, what = compute_costs.rms_ms, f"compute_costs.rms_ms (from {compute_costs.source})"
        if not finite_nonnegative(tie_ms):
            raise ValueError(f"{what} must be a finite number of ms >= 0, got {tie_ms!r}")
        self._args = dict(topology=topology, batch_size=batch_size, frequency_stats=frequency_stats,
                          hot_budget_bytes=hot_budget_bytes, max_hot_rows=max_hot_rows, min_saving=min_saving,
                          collective_ms=collective_ms, compute_costs=compute_costs, tie_ms=tie_ms)
        # the user's search settings, for every candidate plan (TorchRec's and the all-hybrid one too)
        self._search = dict(storage_reservation=storage_reservation, proposer=proposer, partitioner=partitioner,
                            performance_model=performance_model, callbacks=callbacks, timeout_seconds=timeout_seconds)
        constraints = constraints_with_measured_pooling(constraints, frequency_stats)
        # the loggers log the plan returned, once (_RecordedStats): every candidate's planner records
        self._report_stats: List[Any] = ([HybridEmbeddingStats()] if stats is None
                                         else list(stats) if isinstance(stats, list) else [stats])
        self._recorded = _RecordedStats()
        self._stats_debug = debug  # the stats of the plan returned are logged with this planner's debug
        super().__init__(topology=topology, batch_size=batch_size, enumerator=enumerator,
                         storage_reservation=storage_reservation, proposer=proposer, partitioner=partitioner,
                         performance_model=performance_model, stats=[self._recorded],
                         constraints=constraints, debug=debug, callbacks=callbacks,
                         timeout_seconds=timeout_seconds, plan_loader=plan_loader)
        self._user_enumerator = enumerator is not None
        self._hybrid_enumerator = enumerator or HybridEnumerator(
            _compat.planner_topology(self), _compat.planner_batch_size(self), constraints,
            frequency_stats=frequency_stats, hot_budget_bytes=hot_budget_bytes, max_hot_rows=max_hot_rows,
            min_saving=min_saving, compute_costs=compute_costs)
        _compat.set_planner_enumerator(self, self._hybrid_enumerator)
        if performance_model is None and compute_costs is not None and compute_costs.busiest_share is not None:
            # ranks sharing cores (a fitted blend): proposals rated by the same blend of each
            # rank's summed shard perf (for the topology TorchRec resolved, given or not)
            _compat.set_planner_perf_model(self, StepPerfModel(_compat.planner_topology(self), compute_costs))
        self.frequency_stats = frequency_stats
        self._min_saving = min_saving
        self._collective_ms = collective_ms
        self.tie_ms, self.tie_rel = float(tie_ms), tie_rel
        self.stock_margin = float(stock_margin)
        self.compute_costs: Optional[cm.ComputeCosts] = compute_costs
        self._compare = compare_plans
        self.candidates: List[PlanCandidate] = []
        # candidates not compared, by name: why (no plan found, over a rank's memory, more bytes than stock)
        self.left_out: Dict[str, str] = {}
        self._chosen: Optional[PlanCandidate] = None
        self._traffic_table: Optional[cm.TrafficTable] = None
        self._comms: Dict[str, cm.CommElems] = {}  # quantized comms per module type (the sharders')
        self._vectorised: Dict[str, bool] = {}  # FBGEMM's vectorised CPU backward per module type (the sharders')

    # -- planning ----------------------------------------------------------------------------
    def collective_plan(self, module, sharders=None, pg=None) -> ShardingPlan:
        """``plan`` on rank 0, its result broadcast (TorchRec's); an error planning there is
        broadcast instead and raised on every rank (TorchRec's would leave the others waiting
        in the broadcast until the group's timeout)."""
        _check_sharder_hot_ids(module, sharders)  # the checks every rank can make: before the broadcast
        _check_constraint_tables(module, self._user_constraints, sharders)
        if pg is None:
            if not dist.is_initialized():
                raise RuntimeError("collective_plan needs an initialised default process group (or pg); "
                                   "plan() plans without one")
            pg = dist.GroupMember.WORLD
        if self._measure:  # every rank measures, and plans (rank 0) or waits for the plan with it
            self._use_network(measure_network(pg))
        if sharders is None:
            sharders = get_default_sharders()
        result: List[Any] = [None]
        error: Optional[BaseException] = None
        if pg.rank() == 0:
            try:
                result = [("plan", self.plan(module, sharders))]
            except Exception as e:  # noqa: BLE001 - sent to every rank, re-raised here below
                error = e
                base = next(c for c in type(e).__mro__ if c in _BROADCAST_ERRORS)
                cls: Any = type(e)
                try:  # sent by reference; a class the others cannot import is not sent
                    pickle.dumps(cls)
                except Exception:  # noqa: BLE001
                    cls = base
                result = [("error", base.__name__, cls, f"planning on rank 0 failed: {type(e).__name__}: {e}",
                           getattr(e, "error_type", None))]  # PlannerError's kind (e.g. insufficient storage)
        if pg.size() > 1:
            dist.broadcast_object_list(result, dist.get_global_rank(pg, 0), group=pg)  # pg's rank 0, by global rank
        if error is not None:
            raise error
        if result[0][0] == "error":
            _, base_name, cls, message, error_type = result[0]
            try:  # the same class as rank 0's where it takes a message alone, else its nearest listed base
                exc = cls(message)
            except Exception:  # noqa: BLE001 - a class with other arguments
                exc = _BROADCAST_ERRORS_BY_NAME[base_name](message)
            if error_type is not None:
                exc.error_type = error_type
            raise exc
        return result[0][1]

    def _use_network(self, measurement: NetworkMeasurement) -> None:
        """This planner set up again as if built with ``network=measurement`` and its other arguments
        as given (topology, enumerator, perf model, every candidate's arguments: all from there); it
        keeps ``network="measure"`` for the next ``collective_plan``."""
        given = self._given
        HybridEmbeddingShardingPlanner.__init__(self, **given, network=measurement)
        self._given, self._measure = given, True

    def plan(self, module, sharders) -> ShardingPlan:
        if self._measure and self.network is None:
            raise ValueError("network='measure': the network is measured on the process group in collective_plan; "
                             "call collective_plan(module, sharders, pg), or pass network=measure_network(pg) "
                             "(a NetworkMeasurement) to plan without a group")
        _check_sharder_hot_ids(module, sharders)
        _check_constraint_tables(module, self._user_constraints, sharders)
        self._traffic_table = None  # this module's workload, not a previous call's
        self._comms = sharder_comms(sharders or [])
        self._vectorised = sharder_vectorised_backward(sharders or [])
        self._recorded.calls.clear()
        self.left_out = {}
        try:
            partitioned = super().plan(module, sharders)
        except Exception:
            self._log_stats(self._recorded.last())  # TorchRec's stats of the proposal that failed
            raise
        mixed = self._candidate("hybrid planner: stock + hybrid options", partitioned,
                                _compat.planner_best_plan(self), self._recorded.last())
        self.candidates = [mixed]
        if self._compare:
            self.candidates += self._pure_candidates(module, sharders, mixed)
        try:
            fitting = self._fitting_memory(self.candidates, module, sharders)
        except PlannerError:
            self._log_stats(mixed.stats_call)
            raise
        stock = [c for c in fitting if c.name.startswith("stock")]
        # never more bytes on the busiest rank than the stock plan: a plan that trades bytes for
        # compute the model prices (e.g. table_wise tables placed for compute, not traffic)
        # would send more than stock on every network, where the promise is to send less
        allowed = [c for c in fitting
                   if not stock or c is stock[0] or c.cost["busiest_bytes"] <= stock[0].cost["busiest_bytes"]]
        for c in fitting:
            if c not in allowed:
                self.left_out[c.name] = "more busiest-rank bytes than the stock plan"
        self._chosen = choose_plan(allowed, stock[0] if stock else None, self.tie_ms, self._min_saving,
                                   self.tie_rel, self.stock_margin)
        best = self._chosen
        self._log_stats(best.stats_call)
        if len(self.candidates) > 1:  # one candidate (compare_plans=False, e.g. the inner all-hybrid planner
            for line in self.comparison_table():  # below): nothing compared, nothing to log under its name
                logger.info(line)
        if self._compare:  # the inner all-hybrid planner does not warn a second time
            _check_sharder_hot_ids(module, sharders, best.plan)
        return best.plan

    def _fitting_memory(self, candidates: List[PlanCandidate], module, sharders) -> List[PlanCandidate]:
        """The candidates whose every rank's memory fits what the partitioner may fill on its device
        (the caps after the storage reservation; ``cost_model.plan_rank_memory``: the partitioner counts
        a table-wise / column-wise cold table's hot replica on its owners alone, but every rank holds
        it); the others are left out, logged; PlannerError when none fits."""
        topo = _compat.planner_reserved_topology(self, module, sharders)
        hbm = on_device(topo)
        caps = torch.tensor([float(d.storage.hbm if hbm else d.storage.ddr) for d in topo.devices],
                            dtype=torch.float64)
        over: Dict[str, str] = {}
        for c in candidates:
            mem = cm.plan_rank_memory(c.options, topo.world_size, hbm)
            r = int(torch.argmax(mem - caps))
            if mem[r] > caps[r]:
                over[c.name] = (
                    f"rank {r} would hold {mem[r] / 1e6:.1f} MB, over the {caps[r] / 1e6:.1f} MB of its "
                    f"{'HBM' if hbm else 'DDR'} left after the storage reservation")
                logger.warning("%s left out: %s (every rank holds each frequency_hybrid table's hot replica)",
                               c.name, over[c.name])
        self.left_out.update(over)
        fitting = [c for c in candidates if c.name not in over]
        if not fitting:
            raise PlannerError(
                "no plan fits the ranks' memory: "  # a lone candidate's name (compare_plans=False) says nothing
                + ("; ".join(f"{n}: {why}" for n, why in over.items()) if len(over) > 1 else next(iter(over.values())))
                + ". Every rank holds each frequency_hybrid table's hot replica: give the ranks more memory, or "
                "the hybrid tables fewer hot rows (hot_budget_bytes, max_hot_rows, the sharder's hot_ids)",
                PlannerErrorType.INSUFFICIENT_STORAGE)
        return fitting

    def _log_stats(self, call: Optional[Dict[str, Any]]) -> None:
        """The user's ``Stats`` loggers (default :class:`HybridEmbeddingStats`) log one planner's call."""
        if call is not None:  # another candidate's planner had its own debug setting
            for stats in self._report_stats:
                stats.log(**{**call, "debug": self._stats_debug})

    def _candidate(self, name: str, plan: ShardingPlan, options: List[ShardingOption],
                   stats_call: Optional[Dict[str, Any]] = None) -> PlanCandidate:
        plan = self._attach_hot_ids(plan, options)
        traffic = self._traffic(options)
        cost, per_rank = cm.plan_cost(options, traffic, _compat.planner_topology(self), self._collective_ms,
                                      self.compute_costs)
        return PlanCandidate(name, plan, list(options), cost, per_rank.tolist(), stats_call)

    def _traffic(self, options: List[ShardingOption]) -> cm.TrafficTable:
        topo = _compat.planner_topology(self)
        src = self._traffic_table
        if src is None:  # the workload as the statistics measured it (first plan: the mixed one)
            src = cm.TrafficTable({so.name: cm.traffic_of(so, topo.world_size) for so in options},
                               gloo=topo.compute_device == "cpu")
            self._traffic_table = src
        src.comms, src.vectorised = self._comms, self._vectorised  # the sharders of this plan call
        return src

    def _pure_candidates(self, module, sharders, mixed: PlanCandidate) -> List[PlanCandidate]:
        out = []
        topo = _compat.planner_topology(self)
        dev = topo.compute_device
        # a table the constraints allow frequency_hybrid and no stock type the sharders offer here
        # (e.g. [frequency_hybrid, row_wise] on CPU): TorchRec's plan would break the constraint
        stock_types = {t for s in sharders or [] for t in s.sharding_types(dev)} - {FREQUENCY_HYBRID}
        forced = any(c.sharding_types and FREQUENCY_HYBRID in c.sharding_types
                     and not set(c.sharding_types) & stock_types for c in (self._user_constraints or {}).values())
        # TorchRec's own planner needs a stock type from every sharder (one offering only
        # frequency_hybrid leaves its tables without options there: no stock candidate then)
        if not forced and sharders and all(set(s.sharding_types(dev)) - {FREQUENCY_HYBRID} for s in sharders):
            recorded = _RecordedStats()
            stock = EmbeddingShardingPlanner(topology=topo, batch_size=_compat.planner_batch_size(self),
                                             constraints=without_hybrid(self._user_constraints), stats=[recorded],
                                             **self._search)
            name = "stock: TorchRec's EmbeddingShardingPlanner"
            plan = _or_none(name, lambda: stock.plan(
                module, [_StockOnly(s, add_template=False) for s in sharders]), self.left_out, no_option=True)
            if plan is not None:
                out.append(self._candidate(name, plan,
                                           _compat.planner_best_plan(stock), recorded.last()))
        # every table hybrid can take (a table that alone saves little may still pay once its
        # group's collectives are shared); the comparison with the stock plan decides
        # (tables with statistics or given hot ids: without them nothing says hybrid pays)
        eligible = {n for n, by_layout in self._hybrid_enumerator.choices.items()
                    if any(ch.source != "uniform" for ch in by_layout.values())}
        if eligible and any(so.sharding_type != FREQUENCY_HYBRID and so.name in eligible for so in mixed.options):
            all_hybrid = dict(self._user_constraints or {})
            for name in eligible:
                c = all_hybrid.get(name)
                all_hybrid[name] = (dataclasses.replace(c, sharding_types=[FREQUENCY_HYBRID]) if c is not None
                                    else ParameterConstraints(sharding_types=[FREQUENCY_HYBRID]))
            # a user's enumerator: its settings (statistics, budget, prices) for this candidate too
            enumerator = self._hybrid_enumerator.with_constraints(all_hybrid) if self._user_enumerator else None
            recorded = _RecordedStats()
            inner = HybridEmbeddingShardingPlanner(constraints=all_hybrid, compare_plans=False, enumerator=enumerator,
                                                   stats=[recorded], **self._args, **self._search)
            name = "every eligible table frequency_hybrid"
            plan = _or_none(name, lambda: inner.plan(module, sharders), self.left_out)
            if plan is not None:
                out.append(self._candidate(name, plan, inner.planned_options(),
                                           recorded.last()))
        return out

    def _attach_hot_ids(self, plan: ShardingPlan, options: List[ShardingOption]) -> ShardingPlan:
        """Hybrid tables' entries become ``HybridParameterSharding``: hot ids, and one row
        block per rank (a table-wise cold shard becomes its owner's block plus one row on
        each other rank, row_blocks.py)."""
        topo = _compat.planner_topology(self)
        for so in options:
            if so.sharding_type != FREQUENCY_HYBRID or not hasattr(so, "hybrid_choice"):
                continue
            module_plan = plan.plan[so.path]
            ps = module_plan[so.name]
            if isinstance(ps, HybridParameterSharding):
                continue
            choice = so.hybrid_choice
            ids = choice.hot_ids if choice.hot_ids is not None else torch.empty(0, dtype=torch.int64)
            if cm.HYBRID.column_sliced(so) or so.tensor.shape[0] < topo.world_size:
                # stock column_wise's spec: one shard per slice, on its rank (fewer rows than ranks,
                # table-wise cold: stock table_wise's, one shard of the whole table)
                spec = EnumerableShardingSpec([
                    ShardMetadata(shard_offsets=list(s.offset), shard_sizes=list(s.size),
                                  placement=placement(topo.compute_device, s.rank or 0, topo.local_world_size))
                    for s in so.shards])
            else:
                bounds, cols = cm.HYBRID.bounds(so, topo.world_size), so.tensor.shape[1]
                spec = EnumerableShardingSpec([
                    ShardMetadata(shard_offsets=[bounds[r], 0], shard_sizes=[bounds[r + 1] - bounds[r], cols],
                                  placement=placement(topo.compute_device, r, topo.local_world_size))
                    for r in range(topo.world_size)])
            module_plan[so.name] = HybridParameterSharding.from_stock(
                ps, sharding_spec=spec, ranks=list(range(topo.world_size)), hot_ids=ids.clone(),
                hot_rows=int(ids.numel()), cold_layout=choice.cold_layout,
                pooling_factor=max(so.input_lengths, default=None))
            logger.info("table %s: frequency_hybrid, %s cold, %d hot rows (coverage %.3f, %s)", so.name,
                        choice.cold_layout, ids.numel(), choice.coverage, choice.source)
        return plan

    # -- what the last plan looked like --------------------------------------------------------
    def comparison_table(self) -> List[str]:
        """Lines comparing the candidate plans (logged by ``plan``): ``*`` marks the one returned; a
        candidate left out of the choice (:attr:`left_out`) ends with why, and one that found no plan
        is a line of its own."""
        cheapest = min((c.cost["cost_ms"] for c in self.candidates), default=0.0)
        band = self.tie_ms + self.tie_rel * cheapest
        ties = (f"ties within {band:.2f} ms go to the fewest bytes" if band > 0 else
                "no tie band: the cheapest wins")
        if self.stock_margin > 0:
            ties += f"; TorchRec's plan wins unless another costs {self.stock_margin:.1%} less"
        lines = [f"plan candidates (busiest-rank / mean bytes per step, collectives, cost; {ties}):"]
        for c in self.candidates:
            types: Dict[str, int] = {}
            for so in c.options:
                key = so.sharding_type
                if key == FREQUENCY_HYBRID:
                    key += "/" + so.hybrid_choice.cold_layout + "-cold"
                types[key] = types.get(key, 0) + 1
            mark = "*" if c is self._chosen else " "
            why = f"; left out: {self.left_out[c.name]}" if c.name in self.left_out else ""
            lines.append(f"{mark} {c.name}: {c.cost['busiest_bytes'] / 1e6:.3f} / {c.cost['mean_bytes'] / 1e6:.3f} MB, "
                         f"{int(c.cost['collectives'])} collectives, {c.cost['cost_ms']:.3f} ms; {types}{why}")
        compared = {c.name for c in self.candidates}
        lines += [f"  {name}: no plan; left out: {why}" for name, why in self.left_out.items() if name not in compared]
        return lines

    def traffic_table(self) -> Optional[cm.TrafficTable]:
        """The workload the last plan was priced on (per table: rows, dim, pooling, batch)."""
        return self._traffic_table

    @property
    def chosen(self) -> Optional[PlanCandidate]:
        """The candidate the last ``plan`` returned (one of :attr:`candidates`)."""
        return self._chosen

    def estimated_rank_bytes(self) -> List[float]:
        """The model's bytes sent per rank per step under the last returned plan."""
        return list(self._chosen.rank_bytes) if self._chosen else []

    def hybrid_choices(self) -> Dict[str, Any]:
        """The hot-set choice of every hybrid table of the last plan (its cold layout's)."""
        return {so.name: so.hybrid_choice for so in self.planned_options() if so.sharding_type == FREQUENCY_HYBRID}

    def planned_options(self) -> List[Any]:
        """The sharding options of the last returned plan (``hybrid_choice`` on hybrid ones)."""
        return list(self._chosen.options) if self._chosen else list(_compat.planner_best_plan(self) or [])


def _default_topology() -> Topology:
    """The topology TorchRec's ``EmbeddingShardingPlanner`` plans for when given none (its constructor's,
    torchrec 1.8.0): a network measurement is applied to it before that constructor runs."""
    return Topology(local_world_size=get_local_size(), world_size=dist.get_world_size(),
                    compute_device=get_device_type(), pod_size=get_topology_domain_multiple())


_NO_OPTION = "No available sharding type"  # how TorchRec's enumerator says a table has no option (RuntimeError)


def _or_none(what: str, plan: Any, left_out: Dict[str, str], no_option: bool = False) -> Optional[ShardingPlan]:
    """``plan()``, or None where that comparison candidate has no plan (TorchRec's ``PlannerError``:
    e.g. its shards fit no rank's memory where the hybrid's do; with ``no_option``, also its
    enumerator finding a table no stock option under the constraints without frequency_hybrid, e.g.
    [frequency_hybrid, data_parallel] with compute_kernels [fused]): the comparison goes on without
    it, and says so (logged, and in ``left_out``), instead of failing the plan the partitioner found."""
    try:
        return plan()
    except (PlannerError, RuntimeError) as e:
        if not isinstance(e, PlannerError) and not (no_option and str(e).startswith(_NO_OPTION)):
            raise
        left_out[what] = "found no plan: " + str(e).strip().splitlines()[-1]
        logger.warning("%s %s; compared without it", what, left_out[what])
        return None


def _check_sharder_hot_ids(module, sharders, plan: Optional[ShardingPlan] = None) -> None:
    """Sharders' hot ids naming no table of ``module`` raise; with ``plan``, those of tables
    it does not make frequency_hybrid get one warning (sharding_plan.check_hot_ids)."""
    tables = embedding_table_names(module)
    for s in sharders or []:
        if getattr(s, "hot_ids", None):
            check_hot_ids(s.hot_ids, plan, tables=tables)


def _check_planner_numbers(max_hot_rows: Any, min_saving: Any, hot_budget_bytes: Any, collective_ms: Any) -> None:
    """The planner's own numeric arguments, each in its range (ValueError naming it and its value)."""
    if isinstance(max_hot_rows, bool) or not isinstance(max_hot_rows, numbers.Integral) or max_hot_rows < 0:
        raise ValueError(f"max_hot_rows must be an int >= 0, got {max_hot_rows!r}")
    if isinstance(min_saving, bool) or not isinstance(min_saving, (int, float)) or not 0 <= min_saving < 1:
        raise ValueError(f"min_saving must be a share in [0, 1), got {min_saving!r}")
    if hot_budget_bytes is not None and not finite_nonnegative(hot_budget_bytes):
        raise ValueError(f"hot_budget_bytes must be None or a finite number of bytes >= 0, got {hot_budget_bytes!r}")
    if collective_ms is not None and not finite_nonnegative(collective_ms):
        raise ValueError(f"collective_ms must be None or a finite number of ms >= 0, got {collective_ms!r}")


def _table_names(module: Any, sharders: Optional[List[Any]] = None) -> List[str]:
    """Every table of ``module`` a constraint may name: what the sharders declare shardable in
    the submodules they shard (TorchRec's own rule), and every EmbeddingBagCollection- and
    EmbeddingCollection-like part's tables."""
    names: Dict[str, None] = dict.fromkeys(embedding_table_names(module))
    for _, m in module.named_modules():
        configs = getattr(m, "embedding_configs", None)  # EmbeddingCollection-like parts
        if callable(configs):
            names.update((c.name, None) for c in configs())
        for s in sharders or []:
            if isinstance(m, getattr(s, "module_type", ())):
                names.update((n, None) for n in s.shardable_parameters(m))
    return list(names)


def _check_constraint_tables(module: Any, constraints: Optional[Dict[str, ParameterConstraints]],
                             sharders: Optional[List[Any]] = None) -> None:
    """Constraints that name no table of ``module`` raise (a misspelt name would constrain nothing)."""
    if not constraints:
        return
    tables = _table_names(module, sharders)
    unknown = sorted(set(constraints) - set(tables))
    if unknown:
        shown = tables if len(tables) <= 30 else tables[:30] + [f"... {len(tables) - 30} more"]
        raise ValueError(f"constraints name table(s) that do not exist: {unknown}; the tables are {shown}")
