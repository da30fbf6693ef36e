"""``TrainPipelineSparseDist`` for models with frequency-hybrid tables.

TorchRec's pipeline fuses the splits all-to-all of every input dist: on its first batch it
replaces the ``forward`` of each input dist's ``_dist`` (a ``KJTAllToAll``) with
``KJTAllToAllForward``, which returns a ``KJTSplitsAllToAllMeta`` instead of an awaitable.
The hybrid input dist (``torchrec_hybrid.sharding.input_dist.HybridSparseFeaturesDist``)
wraps its KJT all-to-all together with the local hot lookups, so it must keep the stock
two-stage awaitable: with the override, the first step fails with
``'KJTSplitsAllToAllMeta' object has no attribute 'wait'``.

This subclass undoes that override for hybrid input dists only (their splits all-to-all is
then issued on its own instead of fused with the other modules'; stock tables keep the
fused path). Everything else is the stock pipeline.

TODO: drop this shim once torchrec_hybrid's input dist handles the pipeline's override
itself (reported to the sharding developers).
"""

from __future__ import annotations

from typing import Any

from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from torchrec_hybrid.sharding.input_dist import HybridSparseFeaturesDist


def restore_hybrid_input_dists(modules) -> int:
    """Give every hybrid input dist its own KJTAllToAll.forward back; returns how many."""
    restored = 0
    for module in modules:
        for child in module.modules():
            for input_dist in getattr(child, "_input_dists", []) or []:
                if isinstance(input_dist, HybridSparseFeaturesDist) and "forward" in vars(input_dist._dist):
                    del input_dist._dist.forward  # the class's forward again
                    restored += 1
    return restored


class HybridTrainPipelineSparseDist(TrainPipelineSparseDist):
    """``TrainPipelineSparseDist`` that leaves the hybrid input dists' all-to-all alone."""

    def _pipeline_model(self, *args: Any, **kwargs: Any) -> None:
        super()._pipeline_model(*args, **kwargs)
        restore_hybrid_input_dists(self._pipelined_modules)
