"""``rejection.warm_noise``: nothing on CPU (no kernels to compile); on a GPU with the fused
noise kernels, every stream and vocabulary runs once (the no-compile GPU test,
tests/engine/test_no_midrun_compile.py, checks that nothing compiles under traffic)."""

from __future__ import annotations

import torch

from verifypd.engine import rejection


def test_warm_noise_draws_at_every_stream_and_vocabulary(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(rejection, "noise_race", lambda p, s, q, stream: calls.append(
        ("race", p.shape[1], stream)))  # fmt: skip
    monkeypatch.setattr(rejection, "uniform_noise", lambda s, q, n, stream: calls.append(
        ("uniform", n, stream)))  # fmt: skip
    rejection.warm_noise(torch.device("cpu"), {512})
    assert calls == []  # CPU: nothing to compile
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: torch.empty(0))
    monkeypatch.setattr(torch, "ones", lambda n, v, **k: torch.empty(n, v))
    rejection.warm_noise(torch.device("cuda"), {512, 100})
    assert calls == [("race", 100, 0), ("race", 100, rejection.FINAL_STREAM),
                     ("race", 512, 0), ("race", 512, rejection.FINAL_STREAM),
                     ("uniform", 1, rejection.ACCEPT_STREAM)]  # fmt: skip
