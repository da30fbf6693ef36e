import logging
import warnings

logging.getLogger("torchrec").setLevel(logging.ERROR)
warnings.filterwarnings("ignore")

from tests.torchrec_harness import install as _install_torchrec_harness  # noqa: E402

_install_torchrec_harness()  # torchrec.distributed.test_utils.test_sharding imports from it


def pytest_collection_modifyitems(config, items):
    """The whole TorchRec harness grid runs only with ``-m torchrec_harness_grid``."""
    import pytest

    if "torchrec_harness_grid" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="the full TorchRec harness grid: run with -m torchrec_harness_grid")
    for item in items:
        if "torchrec_harness_grid" in item.keywords:
            item.add_marker(skip)
