"""The server's engine seam (``EngineClient``): the fake the server tests use implements it,
and an engine missing a member does not."""

from __future__ import annotations

from fake_engine import FakeEngine

from verifypd.serve.engine_client import EngineClient


def test_fake_engine_is_an_engine_client() -> None:
    assert isinstance(FakeEngine(), EngineClient)


def test_an_engine_missing_a_member_is_not() -> None:
    engine = FakeEngine()
    del engine.vocab_size
    assert not isinstance(engine, EngineClient)
