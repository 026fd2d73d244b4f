"""CUDA stream priorities per lane (``EngineConfig.lane_priorities``): CUDA serves a lower
number first, and torch's ``Stream.priority_range()`` is (least, greatest) = (0, -N)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from verifypd.config import EngineConfig, env_overrides
from verifypd.lanes.executor import LaneStreams, lane_priorities

# Served first .. last: a lower CUDA priority number is served first.
DECODE_FIRST = ("decode", "verify", "prefill", "follow")


def test_decode_first_on_the_h100_range() -> None:
    # torch caps the greatest priority at -3 (4 levels); an H100 reports (0, -5) to CUDA.
    assert lane_priorities(0, -3, "decode-first") == {
        "decode": -3, "verify": -2, "prefill": -1, "follow": 0, "feed": -3}  # fmt: skip


@given(st.integers(min_value=-5, max_value=-1))
def test_the_order_holds_on_any_range(greatest: int) -> None:
    prios = lane_priorities(0, greatest, "decode-first")
    assert prios["decode"] == greatest  # served before everything else
    served = [prios[n] for n in DECODE_FIRST]
    assert served == sorted(served) and prios["decode"] < prios["prefill"]
    mirror = lane_priorities(0, greatest, "prefill-first")
    assert mirror["prefill"] == greatest and mirror["decode"] > mirror["prefill"]
    assert mirror["follow"] == 0 and mirror["verify"] == prios["verify"]
    assert prios["feed"] == prios["decode"] and mirror["feed"] == mirror["decode"]
    assert set(lane_priorities(0, greatest, "equal").values()) == {0}


def test_the_order_is_validated_and_read_from_the_environment() -> None:
    with pytest.raises(ValueError, match="lane_priorities"):
        EngineConfig(lane_priorities="decode-last")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown lane priority order"):
        lane_priorities(0, -3, "decode-last")
    env = env_overrides({"VERIFYPD_LANE_PRIORITIES": " prefill-first "})
    assert EngineConfig(**env).lane_priorities == "prefill-first"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams exist on a GPU only")
def test_the_gpu_streams_serve_decode_first() -> None:
    streams = LaneStreams(torch.device("cuda"), ("decode", "prefill", "verify")).streams
    served = [streams[n].priority for n in DECODE_FIRST]
    assert served == sorted(served) and served[0] < served[-1], served
    assert set(LaneStreams(torch.device("cuda"), ("decode",)).streams) == {"decode"}
    lanes = ("decode", "prefill", "verify")
    fed = LaneStreams(torch.device("cuda"), lanes, feed="beside").streams
    assert fed["feed"].priority == fed["decode"].priority  # the feed beside decode steps
    fed = LaneStreams(torch.device("cuda"), lanes, feed="below").streams
    assert fed["feed"].priority == fed["follow"].priority > fed["prefill"].priority
