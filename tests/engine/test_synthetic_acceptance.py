"""Per-request synthetic acceptance (benchmark only): ``SamplingParams.synthetic_acceptance``
overrides the engine's global ``SpecConfig.synthetic_acceptance`` row by row, and an engine not
in synthetic mode refuses it (ParamError naming the field; a 400 over HTTP)."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch
from helpers import tiny_config, tiny_draft_spec

from verifypd.config import CacheConfig
from verifypd.engine.core import EngineCore
from verifypd.engine.rejection import synthetic_num_accepted
from verifypd.llm import LLM
from verifypd.types import ParamError, SamplingParams


def _truncated_geometric(alpha: float, length: int) -> tuple[float, float]:
    """Mean and standard deviation of min(G, L), P(G >= n) = alpha^n."""
    pmf = [alpha**n * (1 - alpha) for n in range(length)] + [alpha**length]
    mean = sum(n * p for n, p in enumerate(pmf))
    return mean, math.sqrt(sum((n - mean) ** 2 * p for n, p in enumerate(pmf)))


def test_each_row_draws_with_its_own_alpha() -> None:
    rows, length = 4000, 4
    alphas = [0.9 if i % 2 == 0 else 0.2 for i in range(rows)]  # interleaved in one batch
    got = synthetic_num_accepted(alphas, [length] * rows, list(range(rows)), [23] * rows)
    for alpha in (0.9, 0.2):
        counts = [k for k, a in zip(got, alphas, strict=True) if a == alpha]
        mean, sd = _truncated_geometric(alpha, length)
        # 5 standard errors: 0.9 expects 3.10, 0.2 expects 0.25 (any shared alpha fails one).
        assert abs(sum(counts) / len(counts) - mean) <= 5 * sd / math.sqrt(len(counts)), alpha
        assert all(0 <= k <= length for k in counts)


def test_params_check_the_range() -> None:
    assert SamplingParams(synthetic_acceptance=0.0).synthetic_acceptance == 0.0
    assert SamplingParams(synthetic_acceptance=1.0).synthetic_acceptance == 1.0
    for bad in (-0.1, 1.5):
        with pytest.raises(ParamError) as err:
            SamplingParams(synthetic_acceptance=bad)
        assert err.value.param == "synthetic_acceptance"


def test_an_engine_without_synthetic_mode_refuses_it() -> None:
    core = EngineCore(tiny_config(cache=CacheConfig(num_blocks=64)))
    with pytest.raises(ParamError) as err:
        core.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4, synthetic_acceptance=0.5))
    assert err.value.param == "synthetic_acceptance"
    assert "synthetic" in str(err.value)
    assert not core.has_unfinished() and core.kv.usage == 0
    core.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0))


def _accepted_by_request(llm: LLM) -> dict[str, list[int]]:
    """Wraps the speculator's bookkeeping: (drafted, accepted) totals per request id."""
    spec, totals = llm.core.spec, defaultdict(lambda: [0, 0])
    inner = spec.record

    def record(entry, new_ids):
        accepted = inner(entry, new_ids)
        total = totals[entry.seq.request_id]
        total[0] += len(entry.draft_token_ids)
        total[1] += accepted
        return accepted

    spec.record = record
    return totals


def test_a_batch_mixing_alphas_honours_each_request() -> None:
    spec = tiny_draft_spec(max_draft_len=3, initial_draft_len=3, synthetic_acceptance=1.0)
    llm = LLM(config=tiny_config(spec=spec, cache=CacheConfig(num_blocks=128), seed=0))
    totals = _accepted_by_request(llm)
    prompts = [torch.arange(5 + 2 * i).tolist() for i in range(6)]
    alphas = [1.0, 0.0, None, 0.0, 1.0, 0.0]  # None: the engine's global 1.0
    temps = [0.0] * 4 + [0.8, 0.8]  # sampled rows too (the sweep runs both)
    params = [SamplingParams(max_tokens=12, temperature=t, ignore_eos=True, seed=i,
                             synthetic_acceptance=a)
              for i, (a, t) in enumerate(zip(alphas, temps, strict=True))]  # fmt: skip
    outs = llm.generate(prompts, params)
    by_id = [totals[o.request_id] for o in outs]
    for (drafted, accepted), alpha in zip(by_id, alphas, strict=True):
        assert drafted > 0
        assert accepted == (0 if alpha == 0.0 else drafted), (alpha, drafted, accepted)
    # The drafter is the target itself: whatever is accepted, the output is plain greedy.
    plain = llm.generate(prompts[:4], [SamplingParams(max_tokens=12, temperature=0.0,
                                                      ignore_eos=True)] * 4)  # fmt: skip
    assert [o.outputs[0].token_ids for o in outs[:4]] == [o.outputs[0].token_ids for o in plain]
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
