"""Hand-written plans: a ``frequency_hybrid()`` generator for ``construct_module_sharding_plan``."""

from typing import List, Optional

from torchrec.distributed.sharding_plan import row_wise
from torchrec.distributed.types import ParameterSharding

from torchrec_hybrid.types import FREQUENCY_HYBRID


def frequency_hybrid(compute_kernel: str = "fused"):
    """Like TorchRec's ``row_wise()``: the cold shard uses the row-wise layout on all ranks."""
    stock = row_wise(compute_kernel=compute_kernel)

    def _generator(param, local_size, world_size, device_type, sharder, placements: Optional[List] = None
                   ) -> ParameterSharding:
        ps = stock(param, local_size, world_size, device_type, sharder)
        ps.sharding_type = FREQUENCY_HYBRID
        return ps

    return _generator
