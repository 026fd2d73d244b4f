"""Smoke tests of the kernel and profile benchmark scripts: gemv.py and kernels.py dry runs on
the interpreter, the latency variants' kernel choices as ``EngineConfig`` fields,
profile_offline.py, profile_prefill.py, profile_decode.py (its A/B rounds and kernel variants),
gemm_host.py and the kernel kinds the profiles share; each ``main()`` runs on CPU with
``dummy:tiny`` and tiny sizes into a temp dir, and its JSON has the metadata and positive
numbers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import load_bench
from smoke_helpers import read_json


def test_gemv_sweep_dry_run(tmp_path: Path, monkeypatch) -> None:
    """bench/gemv.py on the interpreter: every config checked against cuBLAS' stand-in.

    At 3 rows only: the interpreter runs one Python pass per program, and the one-row configs
    (block_n 4) take four times the programs; the kernel at one row, block_n 4 included, is
    tests/kernels/test_triton_gemv.py's."""
    # bench/gemv.py imports bench/kernels.py as ``kernels``; under pytest that name may already
    # be the tests/kernels namespace package.
    monkeypatch.delitem(sys.modules, "kernels", raising=False)
    load_bench("gemv").main(["--dry-run", "--rows", "3", "--out", str(tmp_path)])
    data = read_json(tmp_path, "gemv")
    assert len(data["summary"]) == 5 and len(data["fused"]) == 3  # 5 shapes, 3 fusions
    assert all(s["best"]["ok"] for s in data["summary"])
    assert all(f["fused_best"]["ok"] for f in data["fused"])


def test_kernel_variants_are_engine_config_fields(tmp_path: Path) -> None:
    """A latency variant's kernel choice is ``EngineConfig.kernels`` (no module global is set),
    and ``engine_info`` records every ``KernelConfig`` and ``SpecConfig`` field of the engine
    it ran, in the report's JSON."""
    import dataclasses

    from verifypd.config import KernelConfig, SpecConfig

    harness, common = load_bench("harness"), load_bench("common")
    variants = load_bench("decode_timing").VARIANTS
    assert variants["graphs-cublas"]["kernels"] == KernelConfig(gemv_max_rows=0)
    unfused = variants["graphs-unfused"]["kernels"]
    assert not unfused.fuse_norm and not unfused.fuse_silu and unfused.fuse_silu_epilogue
    assert "kernels" not in variants["graphs"]  # the default choice
    knobs = KernelConfig(gemv_max_rows=1, fuse_silu_epilogue=False, pdl=False)
    spec = SpecConfig(method="ngram", always_pad_verify=True)
    cfg = harness.engine_config("dummy:tiny", "cpu", "float32", kernels=knobs, spec=spec)
    llm = harness.build_engine(cfg)
    try:
        info = harness.engine_info(llm)
    finally:
        harness.close_engine(llm)
    path = common.write_json(tmp_path / "info.json", {"engine": info, "variants": variants})
    data = json.loads(path.read_text())
    assert data["engine"]["kernels"] == dataclasses.asdict(knobs)
    assert data["engine"]["spec"]["always_pad_verify"] is True
    assert data["variants"]["graphs-gemv1"]["kernels"]["gemv_max_rows"] == 1


def test_profile_offline(tmp_path: Path) -> None:
    bench = load_bench("profile_offline")
    argv = ["--model", "dummy:tiny", "--offline-requests", "5", "--offline-lens", "4", "12",
            "--windows", "0:0.2", "--out", str(tmp_path)]  # fmt: skip
    data = bench.main(argv)
    assert data["device"] == "cpu" and data["git_commit"]
    for run in (data["untraced"], data["traced"]):
        lens = run["output_tokens"]
        assert 5 * 4 <= lens <= 5 * 12
        assert sum(c["out_tok_s"] * bench.BUCKET_S for c in run["course"]) == pytest.approx(lens)
        assert run["course"][-1]["started"] == 5
    assert (tmp_path / "profile_offline-cpu.json").is_file()


def test_profile_offline_summary() -> None:
    """Busy time is the union over streams; kinds and streams add up the kernel durations."""
    bench = load_bench("profile_offline")
    evs = [(0, 10, 7, "ampere_bf16_gemm"), (5, 15, 8, "_split_kv_attention_kernel"),
           (30, 40, 7, "rms_norm_kernel")]  # fmt: skip
    s = bench.summarize(evs, 50)
    assert s["busy_ms"] == pytest.approx(25 / 1e6)
    assert s["busy_frac"] == pytest.approx(0.5)
    assert s["stream_busy_ms"] == {"7": pytest.approx(20 / 1e6), "8": pytest.approx(10 / 1e6)}
    assert s["kind_ms"] == {
        k: pytest.approx(10 / 1e6) for k in ("gemm", "attention", "norm/rope/act")
    }


def test_gemm_host_smoke(tmp_path: Path) -> None:
    """bench/gemm_host.py on CPU (tiny shapes): every projection and case timed, the simulated
    prompt steps' host time split into first layer and the rest."""
    load_bench("gemm_host").main(["--device", "cpu", "--model", "tiny", "--calls", "20",
                                  "--layers", "2", "--steps", "2", "--no-ceilings",
                                  "--out", str(tmp_path)])  # fmt: skip
    data = read_json(tmp_path, "gemm_host")
    assert data["complete"] is True and data["git_commit"]
    calls = data["results"]["one_call"]
    assert set(calls) == {"qkv", "o", "gate_up", "down"}
    assert all(v > 0 for r in calls.values() for v in r.values())
    steps = data["results"]["prompt_steps"]
    assert steps["gemm_host_ms_per_step"] > 0 and steps["first_layer_p50_us"] > 0


def test_profile_prefill(tmp_path: Path) -> None:
    """bench/profile_prefill.py on CPU: one row per (split setting, context), the linear
    layers' FLOPs, op time by kind (the GEMMs found), the chunk computed after its context each
    time."""
    bench = load_bench("profile_prefill")
    argv = ["--model", "dummy:tiny", "--tokens", "24", "--contexts", "0", "16", "--repeats", "2",
            "--beside-decode", "8", "--split-rows", "0", "64", "--out", str(tmp_path),
            "--no-ceilings"]  # fmt: skip
    data = bench.main(argv)  # the decode stream is set up on CPU too (timed beside on a GPU)
    rows = data["results"]["rows"]
    assert [(r["split_rows"], r["context"], r["tokens"]) for r in rows] == [
        (0, 0, 24), (0, 16, 24), (64, 0, 24), (64, 16, 24)
    ]  # fmt: skip
    assert data["results"]["linear_flops"] > 0 and data["complete"]
    for r in rows:
        assert "decode_step_ms_beside" not in r  # GPU only
        assert r["seconds"] > 0 and r["ms_by_kind"]["matmul"] > 0 and r["gpu_span_ms"] is None
        assert r["tflops"] == pytest.approx(data["results"]["linear_flops"] / r["seconds"] / 1e12)
        assert "seconds_beside_decode" not in r  # GPU only
    assert (tmp_path / "profile_prefill-cpu.json").is_file()


def test_profile_kernel_kinds() -> None:
    """The profiles' shares (profile_decode.py, profile_prefill.py): GEMMs, attention, rest."""
    kind_of = load_bench("common").kernel_kind
    assert kind_of("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNN") == "matmul"
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    assert kind_of("_prefill_attention_kernel") == "attention"
    assert kind_of("_split_kv_merge_kernel") == "attention"
    assert kind_of("aten::linear") == "matmul"  # CPU smoke runs
    assert kind_of("_rms_norm_kernel") == "other"


def test_kernels_dry_run_times_the_prompt_attention_the_engine_runs(tmp_path: Path, monkeypatch):
    """bench/kernels.py on the interpreter: every row checked against the torch reference; the
    prompt-attention rows read the step's own keys as the engine does, plus one row through the
    block table (the path it replaced) to compare."""
    monkeypatch.delitem(sys.modules, "kernels", raising=False)  # tests/kernels shadows it
    assert load_bench("kernels").main(["--dry-run", "--out", str(tmp_path)]) == 0
    rows = read_json(tmp_path, "kernels")["rows"]
    assert rows and all(r["ok"] for r in rows)
    prompt = [r for r in rows if r["kernel"].endswith("_attn") and "keys" in r]
    assert {r["keys"] for r in prompt} == {"own rows", "pages"}
    assert sum(r["keys"] == "pages" for r in prompt) == 1


def test_profile_decode_ab_rotates_the_order_and_plots(tmp_path: Path) -> None:
    """``profile_decode.py --ab-rounds``: each round times every variant, starting one further
    on each round; the medians and ratios come from the rounds; the plot is written."""
    mod = load_bench("profile_decode")
    order: list[str] = []

    def timer(name: str, ms: float):
        return lambda n: order.append(name) or ms

    timers = [("off", timer("off", 2.0)), ("auto", timer("auto", 1.5))]
    ab = mod.interleaved_ab("m", timers, rounds=3, replays=10)

    assert order == ["off", "auto", "off", "auto", "auto", "off", "off", "auto"]  # warm, rounds
    assert [v["median_ms"] for v in ab["variants"]] == [2.0, 1.5]
    assert [v["ratio_median"] for v in ab["variants"]] == [1.0, 0.75]
    report = {"ab": [ab], "results": [{"batch": 1}]}
    png = mod.plot_ab(report, tmp_path / "ab.png")
    assert png is not None and png.stat().st_size > 0


def test_profile_decode_kernel_variants_parse_by_field_type() -> None:
    mod = load_bench("profile_decode")
    cfg = mod.kernel_config("weight_prefetch=off,fuse_norm_max_n=16384,fuse_silu=false", pdl=False)
    assert (cfg.weight_prefetch, cfg.fuse_norm_max_n, cfg.fuse_silu, cfg.pdl) == (
        "off", 16384, False, False,
    )  # fmt: skip
    assert mod.kernel_config("default") == mod.KernelConfig()
    with pytest.raises(SystemExit, match="no field"):
        mod.kernel_config("prefetch=off")
    with pytest.raises(ValueError, match="weight_prefetch"):
        mod.kernel_config("weight_prefetch=l2")
