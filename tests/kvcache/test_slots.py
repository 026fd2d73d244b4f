"""KV slots of a step's rows (``kvcache.slots``): the array path and the loop path give each
position's slot from its block table, and a position past the table is an error."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verifypd.kvcache.slots import LOOPED_ROWS, block_slots, positions_and_slots

BS = 4


def _tables(block_tables: list[list[int]]) -> np.ndarray:
    out = np.zeros((len(block_tables), max(len(t) for t in block_tables) + 2), np.int32)
    for i, t in enumerate(block_tables):
        out[i, : len(t)] = t
    return out


@st.composite
def steps(draw):
    """Entries of 1-40 rows each from some computed prefix, each with its own shuffled
    blocks; more than ``LOOPED_ROWS`` rows in all or not."""
    blocks = iter(draw(st.permutations(range(400))))
    tables, starts, qsl = [], [], [0]
    for _ in range(draw(st.integers(1, 6))):
        start, n = draw(st.integers(0, 50)), draw(st.integers(1, 40))
        tables.append([next(blocks) for _ in range(-(-(start + n) // BS))])
        starts.append(start)
        qsl.append(qsl[-1] + n)
    return tables, starts, qsl


@settings(max_examples=150, deadline=None)
@given(steps())
def test_every_row_gets_its_positions_block_slot(step):
    tables, starts, qsl = step
    pos, slots = positions_and_slots(tables, _tables(tables), starts, qsl, BS)
    want_pos = [p for e, a in enumerate(starts) for p in range(a, a + qsl[e + 1] - qsl[e])]
    want = [s for e, a in enumerate(starts)
            for s in block_slots(tables[e], a, a + qsl[e + 1] - qsl[e], BS)]  # fmt: skip
    assert list(pos) == want_pos and list(slots) == want
    assert isinstance(slots, np.ndarray) == (qsl[-1] > LOOPED_ROWS)
    assert want == [tables[e][p // BS] * BS + p % BS for e, a in enumerate(starts)
                    for p in range(a, a + qsl[e + 1] - qsl[e])]  # fmt: skip


@pytest.mark.parametrize("rows", [3, LOOPED_ROWS + 8])
def test_a_position_past_the_block_table_is_an_error(rows):
    """The second entry's last row one position past its blocks: an error, on either path
    (a padded table would hand it block 0's slot); one row earlier it is served."""
    k = rows // BS + 1  # the second entry's blocks: positions 0 .. k * BS - 1
    tables = [[5, 6], list(range(10, 10 + k))]
    qsl = [0, 1, 1 + rows]
    past = [0, k * BS - rows + 1]  # its last row at position k * BS
    with pytest.raises(ValueError, match=f"entry 1 has no KV block for position {k * BS}"):
        positions_and_slots(tables, _tables(tables), past, qsl, BS)
    pos, slots = positions_and_slots(tables, _tables(tables), [0, past[1] - 1], qsl, BS)
    assert list(pos)[-1] == k * BS - 1 and list(slots)[-1] == (10 + k - 1) * BS + BS - 1
