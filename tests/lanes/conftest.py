"""pytest set-up of the lane tests."""

from __future__ import annotations

import pytest

# decode_ahead_helpers.py is not a test module: rewrite its asserts as pytest does in test files.
pytest.register_assert_rewrite("decode_ahead_helpers")
