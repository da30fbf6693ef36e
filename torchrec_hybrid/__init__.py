"""torchrec-hybrid: a frequency-hybrid embedding sharding type for TorchRec.

Hot rows of each table are replicated on every rank, cold rows are row-sharded; only cold
lookups cross the network.
"""

from torchrec_hybrid.types import FREQUENCY_HYBRID, HotSetError  # noqa: F401
from torchrec_hybrid.input_check import (  # noqa: F401
    InvalidIdError,
    InvalidInputError,
    InvalidWeightError,
    MalformedBatchError,
)
from torchrec_hybrid.sharded_ebc import HybridShardedEmbeddingBagCollection, refresh_hot_sets  # noqa: F401
from torchrec_hybrid.sharder import HybridEmbeddingBagCollectionSharder  # noqa: F401
from torchrec_hybrid.sharding_plan import frequency_hybrid  # noqa: F401
from torchrec_hybrid.planner import (  # noqa: F401
    HybridEmbeddingShardingPlanner,
    NetworkMeasurement,
    load_planner_config,
    measure_network,
)

__all__ = [
    "FREQUENCY_HYBRID",
    "HotSetError",
    "InvalidIdError",
    "InvalidInputError",
    "InvalidWeightError",
    "MalformedBatchError",
    "NetworkMeasurement",
    "HybridEmbeddingBagCollectionSharder",
    "HybridEmbeddingShardingPlanner",
    "HybridShardedEmbeddingBagCollection",
    "frequency_hybrid",
    "load_planner_config",
    "measure_network",
    "refresh_hot_sets",
]
