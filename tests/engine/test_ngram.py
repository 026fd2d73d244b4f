from hypothesis import given
from hypothesis import strategies as st

from verifypd.engine.ngram import NgramIndex, NgramProposer


def _naive(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Latest earlier occurrence of the longest suffix n-gram, scanning backwards."""
    for n in range(min(n_max, len(tokens)), n_min - 1, -1):
        suffix = tokens[-n:]
        for j in range(len(tokens) - 1, n - 1, -1):
            if tokens[j - n : j] == suffix:
                return tokens[j : j + k]
    return []


def test_repeats_a_phrase():
    tokens = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert NgramIndex(1, 3).propose(tokens, 3) == [8, 9, 1]


def test_no_match_gives_nothing():
    assert NgramIndex(1, 3).propose([1, 2, 3, 4], 4) == []


def test_prefers_longest_then_latest():
    # bigram (3, 4) occurred once, followed by 9; unigram 4 last occurred followed by 7
    tokens = [3, 4, 9, 4, 7, 3, 4]
    assert NgramIndex(1, 2).propose(tokens, 1) == [9]
    assert NgramIndex(1, 1).propose(tokens, 1) == [7]


@given(
    st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=12), min_size=1, max_size=6),
    st.integers(1, 5),
)
def test_incremental_equals_naive(chunks, k):
    prop = NgramProposer(1, 3)
    tokens: list[int] = []
    for chunk in chunks:
        tokens += chunk
        assert prop.propose(0, tokens, k) == _naive(tokens, k, 1, 3)
