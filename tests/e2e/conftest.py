"""Fixtures of the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers import ServerProcess, smollm_server

# serve_real_helpers.py is not a test module: rewrite its asserts as pytest does in test files.
pytest.register_assert_rewrite("serve_real_helpers")


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """The real server of tests/e2e/test_serve_real_*.py (``MAIN_ARGS``), one per test module
    that asks for it; modules with a ``server`` of their own use theirs."""
    from serve_real_helpers import MAIN_ARGS

    with smollm_server(*MAIN_ARGS) as proc:
        yield proc
        assert proc.stop(timeout=30) == 0
