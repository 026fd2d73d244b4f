"""Fixtures for server tests: a FakeEngine served in-process (see server_utils.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from fake_engine import FakeEngine
from server_utils import Harness, serve_engine


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    """A started FakeEngine behind build_app on a TestServer (max_queue=64)."""
    async with serve_engine(FakeEngine()) as h:
        yield h
