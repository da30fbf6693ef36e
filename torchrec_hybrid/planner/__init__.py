"""Planner support for the frequency-hybrid sharding type.

- ``cost_model``: bytes per rank per step of every sharding type (pure functions);
- ``estimators``: perf / storage ShardEstimators for ``frequency_hybrid`` options;
- ``enumerator``: an EmbeddingEnumerator that offers ``frequency_hybrid`` with a chosen hot set;
- ``hot_set``: hot-set sizing per table under a per-rank memory budget;
- ``stats``: the planner's stats table, hybrid tables included;
- ``planner``: ``HybridEmbeddingShardingPlanner``; ``config``: ``load_planner_config``.
"""
