"""The start-up run of the prompt steps' GEMMs (``engine.gemm_warmup``): every row count a
padded eager prompt step can have, each projection of the forward, nothing changed."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config, triton_on_cpu
from hypothesis import given
from hypothesis import strategies as st

from verifypd.config import env_overrides
from verifypd.engine import setup
from verifypd.engine.core import EngineCore
from verifypd.engine.gemm_warmup import warm_prompt_gemms
from verifypd.engine.step_inputs import StepInputBuilder


def builder(bucket: int) -> StepInputBuilder:
    return StepInputBuilder(16, torch.device("cpu"), {}, prompt_token_bucket=bucket)


@given(bucket=st.integers(1, 200), max_tokens=st.integers(17, 3000))
def test_prompt_rows_hold_every_padded_step(bucket: int, max_tokens: int) -> None:
    inputs = builder(bucket)
    rows = inputs.prompt_rows(max_tokens)
    padded = {n + inputs._prompt_padding(n) for n in range(17, max_tokens + 1)}
    assert rows == sorted(padded)  # each once, nothing a step never has


def test_no_rows_without_a_bucket() -> None:
    assert builder(0).prompt_rows(8192) == []
    assert builder(64).prompt_rows(8192) == list(range(64, 8192 + 1, 64))  # 128 counts


class RecordingOps:
    """The model's ops, recording (op, rows, weight shape, bias?) of every projection."""

    def __init__(self, ops) -> None:
        self.ops, self.calls = ops, []

    def linear(self, x, weight, bias=None, residual=None):
        self.calls.append(("linear", x.shape[0], tuple(weight.shape), residual is not None))
        return self.ops.linear(x, weight, bias, residual)

    def rms_norm_linear(self, x, norm_weight, eps, weight, bias=None):
        self.calls.append(("rms_norm_linear", x.shape[0], tuple(weight.shape), bias is not None))
        return self.ops.rms_norm_linear(x, norm_weight, eps, weight, bias)

    def mlp(self, residual, norm_weight, eps, gate_up_weight, down_weight):
        shapes = (tuple(gate_up_weight.shape), tuple(down_weight.shape))
        self.calls.append(("mlp", residual.shape[0], shapes, True))
        return self.ops.mlp(residual, norm_weight, eps, gate_up_weight, down_weight)


@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=triton_on_cpu)])
def test_every_projection_at_every_row_count_changes_nothing(use_triton: bool) -> None:
    core = EngineCore(tiny_config(use_triton=use_triton))
    model = core.runner.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    recorder = RecordingOps(model.ops)
    model.ops = recorder
    rows = [64, 128, 192]
    assert warm_prompt_gemms(model, rows) == 3
    cfg, attn, mlp = model.cfg, model.layers[0].self_attn, model.layers[0].mlp
    qkv, o = tuple(attn.qkv_proj.weight.shape), tuple(attn.o_proj.weight.shape)
    proj = (tuple(mlp.gate_up_proj.weight.shape), tuple(mlp.down_proj.weight.shape))
    assert recorder.calls == [
        call
        for m in rows
        for call in (
            ("rms_norm_linear", m, qkv, cfg.attention_bias),
            ("linear", m, o, True),
            ("mlp", m, proj, True),
        )  # fmt: skip
    ]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert warm_prompt_gemms(model, []) == 0


def test_setup_runs_it_with_the_runners_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(setup, "warm_prompt_gemms", lambda model, rows: seen.append(rows) or 0)
    monkeypatch.setattr(StepInputBuilder, "prompt_rows", lambda self, n: [n, 2 * n])
    core = EngineCore(tiny_config())
    assert seen == [[core.config.scheduler.max_num_batched_tokens,
                     2 * core.config.scheduler.max_num_batched_tokens]]  # fmt: skip
    EngineCore(tiny_config(warm_prompt_gemms=False))
    assert len(seen) == 1
    assert env_overrides({"VERIFYPD_WARM_PROMPT_GEMMS": "0"}) == {"warm_prompt_gemms": False}
