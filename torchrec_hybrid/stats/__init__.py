"""Row-frequency statistics and hot-set selection for frequency-hybrid sharding.

Count lookups with `FrequencyStats` (exact, or a `CountMinTopK` sketch for huge tables),
combine them across ranks, save/load them, and turn them into hot ids per table with
`select_hot_ids` or a `HotSetRule`. For drifting data: decay (`FrequencyStats.decay_`),
merging on a schedule (`all_reduce_`, or `merged_top_ids`: only each rank's top candidates travel;
`AdaptiveHotSets`: the decay chosen from the data at each refresh),
per-batch coverage of a hot set (`HotSetCoverage`)
and a drifting synthetic stream (`SyntheticCriteo(drift=...)`).
"""

from torchrec_hybrid.stats.adaptive import AdaptiveHotSets
from torchrec_hybrid.stats.coverage import HotSetCoverage
from torchrec_hybrid.stats.frequency import FrequencyStats
from torchrec_hybrid.stats.persistence import StatsFileError
from torchrec_hybrid.stats.selection import (
    HotSetRule,
    coverage_curve,
    default_bytes_per_row,
    resolve_hot_ids,
    select_hot_ids,
)
from torchrec_hybrid.stats.sketch import CountMinTopK
from torchrec_hybrid.stats.synthetic import SyntheticCriteo, criteo_table_sizes, criteo_tables
from torchrec_hybrid.stats.top_merge import merged_top_ids
from torchrec_hybrid.stats.validation import FORMAT_VERSION

__all__ = [
    "AdaptiveHotSets",
    "FORMAT_VERSION",
    "CountMinTopK",
    "FrequencyStats",
    "HotSetCoverage",
    "HotSetRule",
    "StatsFileError",
    "SyntheticCriteo",
    "coverage_curve",
    "criteo_table_sizes",
    "criteo_tables",
    "default_bytes_per_row",
    "merged_top_ids",
    "resolve_hot_ids",
    "select_hot_ids",
]
