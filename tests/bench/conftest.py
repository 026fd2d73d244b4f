"""Fixtures of the benchmark tests."""

from __future__ import annotations

import pytest
import torch

# sweep_helpers.py and smoke_helpers.py are not test modules: rewrite their asserts as pytest
# does in test files.
pytest.register_assert_rewrite("sweep_helpers", "smoke_helpers")


@pytest.fixture
def one_thread():
    """Tiny matmuls on a shared 2-core box: one intra-op thread is ~100x faster than two."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)
