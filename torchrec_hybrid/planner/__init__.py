"""Planner support for the frequency-hybrid sharding type.

- ``cost_model``: bytes per rank per step of every sharding type (pure functions);
- ``hot_set``: hot-set sizing per table under a per-rank memory budget;
- ``estimators``: perf / storage ShardEstimators for ``frequency_hybrid`` options;
- ``enumerator``: an EmbeddingEnumerator that offers ``frequency_hybrid`` with a chosen hot set;
- ``stats``: the planner's stats table, hybrid tables included;
- ``planner``: ``HybridEmbeddingShardingPlanner``; ``config``: ``load_planner_config``;
- ``topology``: a uniform-bandwidth (gloo) topology; ``validate``: estimate vs measurement.
"""

from torchrec_hybrid.planner.config import PlannerConfigError, load_planner_config, planner_from_config
from torchrec_hybrid.planner.enumerator import HybridEnumerator
from torchrec_hybrid.planner.estimators import HybridPerfEstimator, HybridStorageEstimator
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
    "HybridPerfEstimator",
    "HybridStorageEstimator",
    "PlannerConfigError",
    "UniformCommsBandwidth",
    "gloo_topology",
    "load_planner_config",
    "planner_from_config",
]
