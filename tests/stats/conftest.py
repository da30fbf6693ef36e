import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: the stats tests are small, and on a shared 2-core box
    OpenMP threads that spin against other processes make them many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
