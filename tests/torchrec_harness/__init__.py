"""Stand-in for ``torchrec.distributed.tests.test_sequence_model``, which the torchrec wheel
lacks but ``torchrec.distributed.test_utils.test_sharding`` imports one name from
(``TestEmbeddingCollectionSharder``, used only by its 2D-parallel EmbeddingCollection path).

``install()`` registers it in ``sys.modules`` (tests/conftest.py calls it)."""

import sys
import types
from typing import Any, Dict, List, Optional

from torchrec.distributed.embedding import EmbeddingCollectionSharder


class TestEmbeddingCollectionSharder(EmbeddingCollectionSharder):
    """An ``EmbeddingCollectionSharder`` offering one sharding type and one kernel (as TorchRec's own)."""

    __test__ = False  # not a pytest test class

    def __init__(self, sharding_type: str, kernel_type: str = "fused",
                 fused_params: Optional[Dict[str, Any]] = None, qcomm_codecs_registry: Any = None) -> None:
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)
        self._sharding_type, self._kernel_type = sharding_type, kernel_type

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return [self._sharding_type]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return [self._kernel_type]


def install() -> None:
    name = "torchrec.distributed.tests.test_sequence_model"
    if name in sys.modules:
        return
    try:
        __import__(name)
        return
    except ImportError:
        pass
    pkg = sys.modules.get("torchrec.distributed.tests")
    if pkg is None:
        pkg = types.ModuleType("torchrec.distributed.tests")
        pkg.__path__ = []  # a namespace: only the stand-in below lives in it
        sys.modules["torchrec.distributed.tests"] = pkg
    mod = types.ModuleType(name)
    mod.TestEmbeddingCollectionSharder = TestEmbeddingCollectionSharder  # type: ignore[attr-defined]
    sys.modules[name] = mod
    pkg.test_sequence_model = mod  # type: ignore[attr-defined]
