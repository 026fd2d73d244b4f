"""Statistical helpers shared by the sampler and rejection-sampler tests."""

from __future__ import annotations

import math

import pytest
import torch

Z_1E4 = 3.719  # standard normal quantile for a one-sided p of 1e-4


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Many small ops: one intra-op thread is faster, and far faster on a shared 2-core box."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def chi_square_critical(df: int, z: float = Z_1E4) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0):
    """Pearson statistic and degrees of freedom; bins with expected < min_expected are pooled."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = probs * counts.sum()
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)])
    exp = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
    return stat, max(int(keep.sum()) - 1, 1)


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * (counts.double() / counts.sum() - probs.double()).abs().sum().item()
