"""Fixtures of the benchmark tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny matmuls on a shared 2-core box: one intra-op thread is ~100x faster than two."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)
