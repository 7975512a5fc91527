"""Suite-wide settings."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """The suite runs many tiny kernels: on a shared 2-core machine intra-op threading makes them
    up to ~100x slower (OpenMP threads spin against other load) and adds nothing at these sizes."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
