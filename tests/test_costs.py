"""``costs.CostTable``: the interpolation the speculation policy reads its prior through, on a
hand-built table (exact values)."""

from __future__ import annotations

import pytest

from verifypd.costs import MIXED, CostTable, piecewise_linear

MS = 1e-3
TABLE = CostTable(
    target={
        (1, 1): 10 * MS, (4, 1): 13 * MS, (16, 1): 25 * MS,  # decode
        (1, 3): 12 * MS, (16, 3): 42 * MS,  # verify of 2 drafts
        (8, MIXED): 30 * MS, (32, MIXED): 70 * MS,  # eager mixed
    },
    prefill={128: 8 * MS, 512: 20 * MS, 2048: 80 * MS},
    draft={1: 2 * MS, 8: 3.4 * MS},
    context_len=512,
    mixed_draft_len=2,
)  # fmt: skip


def test_target_time_is_linear_in_rows_between_points_of_one_query_len() -> None:
    assert TABLE.target_time(4, 1) == pytest.approx(13 * MS)  # a measured point
    assert TABLE.target_time(2, 1) == pytest.approx(11 * MS)  # 1/3 of the way from 1 to 4
    assert TABLE.target_time(10, 1) == pytest.approx(19 * MS)  # halfway from 4 to 16
    assert TABLE.target_time(28, 1) == pytest.approx(37 * MS)  # the last segment, extended
    assert TABLE.target_time(6, 3) == pytest.approx(22 * MS)


def test_an_unmeasured_query_len_takes_the_next_one_above_or_the_largest_scaled() -> None:
    assert TABLE.target_time(6, 2) == pytest.approx(22 * MS)  # q = 3's curve, unscaled
    assert TABLE.target_time(6, 6) == pytest.approx(44 * MS)  # q = 3's, x 6 / 3 tokens


def test_mixed_uses_only_its_own_points() -> None:
    assert TABLE.target_time(16, MIXED) == pytest.approx(30 * MS + 8 / 24 * 40 * MS)
    no_mixed = CostTable({(1, 1): MS}, {}, {})
    assert no_mixed.target_time(8, MIXED) is None
    assert no_mixed.target_time(8, 1) == pytest.approx(8 * MS)  # one point: scales with rows


def test_prefill_is_piecewise_linear_and_extrapolates_linearly() -> None:
    assert TABLE.prefill_time(512) == pytest.approx(20 * MS)
    assert TABLE.prefill_time(1024) == pytest.approx(40 * MS)
    assert TABLE.prefill_time(4096) == pytest.approx(160 * MS)  # 2048 -> 4096 on the last slope
    assert TABLE.prefill_time(64) == pytest.approx(6 * MS)  # the first segment, extended down
    assert TABLE.prefill_time(1) == pytest.approx((8 - 127 * 12 / 384) * MS)


def test_draft_time_and_empty_tables() -> None:
    assert TABLE.draft_time(4) == pytest.approx(2.6 * MS)
    empty = CostTable({}, {}, {})
    assert empty.target_time(1, 1) is None
    assert empty.prefill_time(128) is None
    assert empty.draft_time(1) is None


def test_piecewise_linear_never_goes_negative() -> None:
    steep = [(10.0, 1.0), (20.0, 11.0)]
    assert piecewise_linear(steep, 5.0) == pytest.approx(0.5)  # proportional floor
    assert piecewise_linear([(1.0, 5.0), (2.0, 1.0)], 10.0) == 0.0


def test_to_dict_round_trips_and_is_json_ready() -> None:
    import json

    data = json.loads(json.dumps(TABLE.to_dict()))
    assert data["target"][0] == {"rows": 1, "query_len": 1, "seconds": 10 * MS}
    assert CostTable.from_dict(data) == TABLE
    assert "decode 1-16 rows 10.00-25.00 ms" in TABLE.summary()
    assert "mixed 8-32 rows" in TABLE.summary()
