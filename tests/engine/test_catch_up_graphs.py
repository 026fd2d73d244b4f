"""The drafter's first draft step made uniform for a catch-up graph (``_uniform_catch_up``):
which query length it picks, and that it never rewinds into a graph that does not exist."""

from types import SimpleNamespace

import pytest

from verifypd.config import SpecConfig
from verifypd.engine.speculative import _uniform_catch_up


def _views(*lags, tokens=100):
    return [SimpleNamespace(num_tokens=tokens, num_computed_tokens=tokens - lag) for lag in lags]


def _graphs(*qs, max_batch=64):
    return {q: SimpleNamespace(max_batch=max_batch) for q in qs}


@pytest.mark.parametrize(
    ("lags", "qs", "want"),
    [
        ((1, 1, 1), (1, 2, 4, 8), 1),  # all caught up: the decode graph as is
        ((1, 2, 1), (1, 2, 4, 8), 2),  # all drafts accepted somewhere: q = 2
        ((1, 3, 2), (1, 2, 4, 8), 4),  # three plain steps: the q = 4 graph
        ((5, 1, 8), (1, 2, 4, 8), 8),
        ((5, 1, 9), (1, 2, 4, 8), None),  # beyond every graph: eager, nothing rewound
        ((1, 3, 2), (1, 2), None),  # no catch-up graphs (SpecConfig.catch_up_graphs=())
    ],
)
def test_every_view_feeds_the_smallest_covering_graph(lags, qs, want):
    views = _views(*lags)
    _uniform_catch_up(views, _graphs(*qs))
    fed = [v.num_tokens - v.num_computed_tokens for v in views]
    assert fed == ([want] * len(lags) if want else list(lags))


def test_no_rewind_past_a_graphs_batch_or_a_short_context():
    views = _views(3, 1)
    _uniform_catch_up(views, _graphs(1, 2, 4, max_batch=1))  # two rows, graphs hold one
    assert [v.num_tokens - v.num_computed_tokens for v in views] == [3, 1]
    views = _views(3, 1, tokens=3)  # a 3-token context cannot feed 4
    _uniform_catch_up(views, _graphs(1, 2, 4))
    assert [v.num_tokens - v.num_computed_tokens for v in views] == [3, 1]


@pytest.mark.parametrize("bad", [(2,), (8, 4), (4, 4), (65,), [4, 8]])
def test_catch_up_graphs_are_validated(bad):
    with pytest.raises(ValueError, match="catch_up_graphs"):
        SpecConfig(catch_up_graphs=bad)
