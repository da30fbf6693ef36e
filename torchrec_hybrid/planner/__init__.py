"""Planner support for the frequency-hybrid sharding type.

- ``cost_model``: one model per sharding type (bytes, work, collectives, memory), options and plans priced;
- ``hot_set``: hot-set sizing per table under a per-rank memory budget;
- ``estimators``: TorchRec's estimators from the cost model (perf of every option, hybrid storage);
- ``enumerator``: an EmbeddingEnumerator that offers ``frequency_hybrid`` per cold layout;
- ``stats``: the planner's stats table, hybrid tables included;
- ``planner``: ``HybridEmbeddingShardingPlanner``; ``config``: ``load_planner_config``;
- ``topology``: a uniform-bandwidth (gloo) topology;
- ``network``: ``measure_network``, the bandwidths of a process group, measured.
"""

from torchrec_hybrid.planner.compute_costs import load_calibration
from torchrec_hybrid.planner.config import PlannerConfigError, load_planner_config, planner_from_config
from torchrec_hybrid.planner.enumerator import HybridEnumerator
from torchrec_hybrid.planner.estimators import BytesPerfEstimator, HybridStorageEstimator
from torchrec_hybrid.planner.network import MeasuredCommsBandwidth, NetworkMeasurement, measure_network
from torchrec_hybrid.planner.planner import HybridEmbeddingShardingPlanner
from torchrec_hybrid.planner.stats import HybridEmbeddingStats
from torchrec_hybrid.planner.topology import UniformCommsBandwidth, gloo_topology
from torchrec_hybrid.planner.types import HotSetChoice, HybridParameterSharding

__all__ = [
    "HotSetChoice",
    "HybridEmbeddingShardingPlanner",
    "HybridEmbeddingStats",
    "HybridEnumerator",
    "HybridParameterSharding",
    "BytesPerfEstimator",
    "HybridStorageEstimator",
    "MeasuredCommsBandwidth",
    "NetworkMeasurement",
    "PlannerConfigError",
    "UniformCommsBandwidth",
    "gloo_topology",
    "load_calibration",
    "load_planner_config",
    "measure_network",
    "planner_from_config",
]
