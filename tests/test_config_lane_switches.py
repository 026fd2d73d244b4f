"""The two lane switches are config fields; only entry points map the old environment
variables onto them (``config.env_overrides``)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from verifypd.config import EngineConfig, SpecConfig, env_overrides, spec_env_overrides

PACKAGE = Path(__file__).resolve().parents[1] / "verifypd"


def test_env_overrides_maps_the_old_variables() -> None:
    assert env_overrides({}) == {}
    assert env_overrides({"VERIFYPD_LANE_STREAMS": "decode, verify"}) == {
        "lane_streams": ("decode", "verify")
    }
    assert env_overrides({"VERIFYPD_LANE_STREAMS": "0"}) == {"lane_streams": ()}
    assert env_overrides({"VERIFYPD_EMIT_AFTER_LAUNCH": "0"}) == {"emit_after_launch": False}
    assert env_overrides({"VERIFYPD_EMIT_AFTER_LAUNCH": "1"}) == {"emit_after_launch": True}
    assert env_overrides({"VERIFYPD_DELIVER_BEFORE_DRAFTING": "0"}) == {
        "deliver_before_drafting": False
    }
    assert env_overrides({"VERIFYPD_DECODE_AHEAD": "0"}) == {"decode_ahead": False}
    assert env_overrides({"VERIFYPD_DECODE_AHEAD": "1"}) == {"decode_ahead": True}
    assert env_overrides({"VERIFYPD_GC_FREEZE": "0"}) == {"gc_freeze": False}
    assert env_overrides({"VERIFYPD_PREFILL_SLICE_LAYERS": "0"}) == {"prefill_slice_layers": 0}
    assert env_overrides({"VERIFYPD_PREFILL_SLICE_LAYERS": " 2"}) == {"prefill_slice_layers": 2}
    with pytest.raises(ValueError, match="VERIFYPD_PREFILL_SLICE_LAYERS"):
        env_overrides({"VERIFYPD_PREFILL_SLICE_LAYERS": "-1"})
    assert env_overrides({"VERIFYPD_PROMPT_TOKEN_BUCKET": "0"}) == {"prompt_token_bucket": 0}
    with pytest.raises(ValueError, match="VERIFYPD_PROMPT_TOKEN_BUCKET"):
        env_overrides({"VERIFYPD_PROMPT_TOKEN_BUCKET": "sixty-four"})


def test_spec_env_overrides_map_the_policy_knobs() -> None:
    assert spec_env_overrides({}) == {}
    assert spec_env_overrides({"VERIFYPD_FOLLOW_PREFILL": "1"}) == {"follow_prefill": True}
    assert spec_env_overrides({"VERIFYPD_FOLLOW_PREFILL": "0"}) == {"follow_prefill": False}
    assert spec_env_overrides({"VERIFYPD_YIELD_TO_PREFILL": "1"}) == {"yield_to_prefill": True}
    assert spec_env_overrides({"VERIFYPD_YIELD_TO_PREFILL": "0"}) == {"yield_to_prefill": False}
    assert spec_env_overrides({"VERIFYPD_TAIL_TOLERANCE": " 0.1"}) == {"tail_tolerance": 0.1}
    rows = {"VERIFYPD_FOLLOW_PREFILL_MAX_ROWS": " 4"}
    assert spec_env_overrides(rows) == {"follow_prefill_max_rows": 4}
    decode = {"VERIFYPD_FOLLOW_DECODE_MAX_ROWS": "8"}
    assert spec_env_overrides(decode) == {"follow_decode_max_rows": 8}
    feed = {"VERIFYPD_FOLLOW_DECODE_TOKENS": "64"}
    assert spec_env_overrides(feed) == {"follow_decode_tokens": 64}
    for name in ("VERIFYPD_FOLLOW_PREFILL_MAX_ROWS", "VERIFYPD_FOLLOW_DECODE_MAX_ROWS",
                 "VERIFYPD_FOLLOW_DECODE_TOKENS"):  # fmt: skip
        for bad in ("-1", "1.5", "four", ""):
            with pytest.raises(ValueError, match=name):
                spec_env_overrides({name: bad})
    with pytest.raises(ValueError, match="VERIFYPD_TAIL_TOLERANCE"):
        spec_env_overrides({"VERIFYPD_TAIL_TOLERANCE": "ten percent"})
    with pytest.raises(ValueError, match="tail_tolerance"):  # SpecConfig checks the range
        SpecConfig(**spec_env_overrides({"VERIFYPD_TAIL_TOLERANCE": "1.5"}))


def test_decode_ahead_is_decided_by_the_device_by_default() -> None:
    assert EngineConfig().decode_ahead is None


def test_lane_streams_are_validated() -> None:
    assert EngineConfig().lane_streams == ("decode", "prefill", "verify")
    with pytest.raises(ValueError, match="lane_streams"):
        EngineConfig(lane_streams=("decode", "draft"))


def test_no_behaviour_is_read_from_the_environment_inside_the_package() -> None:
    """Only the entry points (config, CLI) may look at os.environ / getenv; thread counts,
    cache directories and the Triton interpreter switch are not behaviour."""
    allowed = {"config.py", "__main__.py", "serve/cli.py"}
    harmless = ("OMP_NUM_THREADS", "_CACHE", "TRITON_INTERPRET")
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"os\.environ|getenv", line) and rel not in allowed:
                if not any(h in line for h in harmless):
                    offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, offenders


@pytest.mark.parametrize(("gc_freeze", "frozen"), [(None, False), (True, True), (False, False)])
def test_gc_freeze_moves_the_start_up_heap_out_of_collection(gc_freeze, frozen) -> None:
    """None = only on CUDA (this CPU run: off); True freezes the heap start-up left, and
    stopping the engine thaws it (frozen objects in cycles are never freed: a stopped engine's
    memory would leak, which is how a 7B engine built after another ran out of GPU memory)."""
    import asyncio
    import gc
    import weakref

    from helpers import tiny_config

    from verifypd.lanes.async_engine import AsyncEngine

    gc.unfreeze()
    try:
        engine = AsyncEngine(replace(tiny_config(), gc_freeze=gc_freeze))
        assert (gc.get_freeze_count() > 1000) is frozen
        core = weakref.ref(engine.core)
        asyncio.run(engine.stop())
        assert gc.get_freeze_count() == 0
        del engine
        gc.collect()
        assert core() is None  # the stopped engine is collectable again
    finally:
        gc.unfreeze()
