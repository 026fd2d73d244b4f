"""Smoke tests of the benchmark scripts: each ``main()`` runs on CPU with ``dummy:tiny`` and tiny
sizes into a temp dir, and its JSON has the metadata and positive numbers."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest
from helpers import load_bench, start_server_process, verifypd_serve_command

META_KEYS = {"device", "versions", "git_commit", "date_utc", "command", "params", "ceilings"}


def read_json(out: Path, script: str) -> dict:
    data = json.loads((out / f"{script}-cpu.json").read_text())
    assert META_KEYS <= set(data)
    assert data["device"] == "cpu"
    assert data["ceilings"]["copy_gbps"] is None
    assert data["command"].startswith(f"python bench/{script}.py")
    assert {"torch", "triton", "transformers"} <= set(data["versions"])
    return data


def test_offline(tmp_path: Path) -> None:
    argv = ["--device", "cpu", "--models", "dummy:tiny", "--num-requests", "3",
            "--min-len", "4", "--max-len", "12", "--skip-hf", "--out", str(tmp_path)]  # fmt: skip
    load_bench("offline").main(argv)
    data = read_json(tmp_path, "offline")
    ours = data["results"]["dummy:tiny"]["ours"]
    assert "error" not in ours, ours.get("error")
    assert ours["output_tokens"] == ours["requested_output_tokens"] > 0
    assert ours["output_tok_s"] > 0 and ours["total_tok_s"] > ours["output_tok_s"]
    assert (tmp_path / "offline-cpu.png").is_file()


def test_latency(tmp_path: Path) -> None:
    argv = ["--device", "cpu", "--models", "dummy:tiny", "--batches", "1", "2",
            "--prompt-len", "8", "--max-tokens", "4", "--repeats", "1",
            "--variants", "eager", "--out", str(tmp_path)]  # fmt: skip
    load_bench("latency").main(argv)
    data = read_json(tmp_path, "latency")
    eager = data["results"]["dummy:tiny"]["eager"]
    for batch in ("1", "2"):
        m = eager["batches"][batch]
        assert "error" not in m, m.get("error")
        assert m["decode_tok_s"] > 0 and m["e2e_tok_s"] > 0
        assert m["floor"]["weights_read_bytes"] > 0 and m["floor"]["kv_read_bytes"] > 0
        assert m["fraction_of_floor"] is None  # no bandwidth ceiling on CPU
    assert eager["engine"]["kernels"]["gemv_max_rows"] == 16  # KernelConfig, recorded
    assert eager["engine"]["spec"]["always_pad_verify"] is False
    assert (tmp_path / "latency-cpu.png").is_file()


def test_spec(tmp_path: Path) -> None:
    argv = ["--device", "cpu", "--model", "dummy:tiny", "--draft-model", "dummy:tiny",
            "--batches", "1", "--prompt-len", "8", "--max-tokens", "6", "--repeats", "1",
            "--lane-modes", "three", "single", "--out", str(tmp_path)]  # fmt: skip
    load_bench("spec").main(argv)
    data = read_json(tmp_path, "spec")
    assert data["synthetic_acceptance"]["used"] is True
    assert data["synthetic_acceptance"]["expected_tokens_per_verify"] == pytest.approx(3.3616)
    for lane_mode in ("three", "single"):
        r = data["results"][lane_mode]
        for name in ("plain", "spec"):
            m = r[name]["batches"]["1"]
            assert "error" not in m, m.get("error")
            assert m["decode_tok_s"] > 0 and m["e2e_tok_s"] > 0
        sp = r["speedup"]["1"]
        assert sp["decode"] > 0
        acc = r["spec"]["batches"]["1"]["steps"]["spec"]["mean_accepted_per_call"]
        assert sp["decode_at_expected"] == pytest.approx(sp["decode"] * 3.3616 / (1 + acc), 1e-3)


def test_gpu_check_logic_on_cpu(tmp_path: Path) -> None:
    argv = ["--model", "dummy:tiny", "--device", "cpu", "--variants", "eager",
            "--num-prompts", "2", "--max-prompt-len", "24", "--num-new", "4",
            "--speed-batches", "1", "2", "--speed-prompt-len", "8", "--speed-max-tokens", "4",
            "--repeats", "1", "--dtype", "float32", "--out", str(tmp_path)]  # fmt: skip
    load_bench("gpu_check").main(argv)
    data = read_json(tmp_path, "gpu_check")
    eager = data["variants"]["eager"]
    assert "error" not in eager, eager.get("error")
    # Same weights, same fp32 torch path: the copy must reproduce the reference exactly.
    assert all(c["identical"] for c in eager["vs_cpu_fp32"])
    assert eager["num_params_copied"] == data["reference"]["engine"]["num_params"]
    assert all(eager["speed"][b]["decode_tok_s"] > 0 for b in ("1", "2"))


def test_reference_scorer_agrees_with_greedy_engine() -> None:
    gpu_check, harness = load_bench("gpu_check"), load_bench("harness")
    from verifypd.llm import LLM

    llm = LLM(config=harness.engine_config("dummy:tiny", "cpu", "float32", num_blocks=16))
    prompt = [5, 17, 99, 3, 250, 41, 7]
    tokens = harness.run_generate(llm, [prompt], 3)[0].token_ids
    scorer = gpu_check.ReferenceScorer(llm.core.loaded.model)
    for i, tok in enumerate(tokens):
        assert int(scorer.logits(prompt + tokens[:i]).argmax()) == tok
    margin = scorer.margin(prompt, tokens[0], (tokens[0] + 1) % 512)
    assert margin["fp32_argmax_is_ref_pick"] and margin["ref_pick_minus_other_pick"] > 0


def test_hf_config_matches_model_shape() -> None:
    ref = load_bench("hf_reference")
    import torch

    from verifypd.config import PRESETS

    cfg = PRESETS["tiny"]
    model = ref.build_hf_model(cfg, torch.device("cpu"), torch.float32, "sdpa")
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params
    for name in ("qwen2.5-7b", "qwen3-0.6b"):
        hf = ref.hf_config(PRESETS[name])
        assert hf.num_key_value_heads == PRESETS[name].num_kv_heads
        assert ref.hf_rope_theta(hf) == PRESETS[name].rope_theta


def test_compare_reports_prefix_and_divergence() -> None:
    gpu_check = load_bench("gpu_check")
    out = gpu_check.compare([[1, 2, 3], [1, 9, 3], [4]], [[1, 2, 3], [1, 2, 3], [5]])
    assert [c["matching_prefix"] for c in out] == [3, 1, 0]
    assert [c["first_divergence"] for c in out] == [None, 1, 0]


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


def test_large_results_are_written_compact_and_small_ones_indented(tmp_path: Path) -> None:
    common = load_bench("common")
    small = {"device": "cpu", "rows": [1, 2]}
    large = {"timeline": [{"t_s": i * 0.25, "depth": i} for i in range(20_000)]}
    for name, data, indented in (("small", small, True), ("large", large, False)):
        path = common.write_json(tmp_path / f"{name}.json", data)
        text = path.read_text()
        assert json.loads(text) == data
        assert ("\n  " in text) is indented
    assert (tmp_path / "large.json").stat().st_size > common.COMPACT_JSON_BYTES


def test_figures_are_saved_as_palette_pngs(tmp_path: Path) -> None:
    common = load_bench("common")
    plt = pytest.importorskip("matplotlib.pyplot", reason="plots need matplotlib")
    image = pytest.importorskip("PIL.Image", reason="matplotlib brings pillow")
    fig, ax = plt.subplots()
    ax.plot([0, 1, 2], [2, 0, 1], label="a")
    ax.legend()
    path = common.save_figure(fig, tmp_path / "f.png", dpi=50)
    plt.close(fig)
    with image.open(path) as png:
        assert png.mode == "P" and png.size == (320, 240)


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


@pytest.mark.slow
def test_draft_window(tmp_path: Path) -> None:
    """SmolLM2 drafting for itself: with the whole context every draft is accepted; a window
    shorter than the prompts accepts fewer; output is plain greedy's either way."""
    argv = ["--device", "cpu", "--no-ceilings", "--windows", "none,16", "--passage-chars",
            "600", "--max-tokens", "6", "--out", str(tmp_path)]  # fmt: skip
    load_bench("draft_window").main(argv)
    data = json.loads((tmp_path / "draft_window-cpu.json").read_text())
    assert META_KEYS <= set(data) and data["complete"] is True
    assert min(data["prompt_tokens"]) > 16 + 4  # every prompt is cut by the window
    whole, cut = data["results"]["none"], data["results"]["16"]
    assert whole["lossless"] and cut["lossless"]
    assert whole["drafted"] > 0 and whole["acceptance"] > 0.9
    assert cut["window"] == 16 and cut["acceptance"] < whole["acceptance"]
    assert (tmp_path / "draft_window-cpu.png").is_file()


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


def test_burst(tmp_path: Path) -> None:
    """bench/burst.py on CPU: runs with and without decode rows, the burst's first tokens all
    within its span, decode tokens only where decode rows ran; an engine option reaches the
    engine (a bad one is the engine's error)."""
    bench = load_bench("burst")
    argv = ["--device", "cpu", "--model", "dummy:tiny", "--prompts", "40", "20",
            "--decode-rows", "2", "--decode-context", "8", "--decode-tokens", "400",
            "--repeats", "1", "--num-kv-blocks", "256", "--engine-option", "prefill_slice_layers=0",
            "--out", str(tmp_path)]  # fmt: skip
    bench.main(argv)
    data = read_json(tmp_path, "burst")
    res = data["results"]
    assert res["engine_options"] == {"prefill_slice_layers": 0}
    assert [r["decode_rows"] for r in res["runs"]] == [0, 2]
    for r in res["runs"]:
        assert len(r["ttft_ms"]) == 2 and max(r["ttft_ms"]) == pytest.approx(r["span_ms"])
        assert r["ms_per_1k_prompt_tokens"] == pytest.approx(r["span_ms"] * 1000 / 60)
    assert res["runs"][0]["decode_tokens_in_burst"] == 0
    assert res["runs"][1]["decode_tokens_in_burst"] > 0
    with pytest.raises(ValueError, match="prefill_slice_layers"):
        bench.main([*argv[:-4], "--engine-option", "prefill_slice_layers=-1",
                    "--out", str(tmp_path)])  # fmt: skip


def test_burst_trace_annotates_the_host_steps(tmp_path: Path) -> None:
    """bench/burst.py --profile --trace on CPU: the profiled bursts' traces are written, with
    the burst and the host's step parts as ranges (the GPU gaps need a GPU)."""
    bench = load_bench("burst")
    gg = load_bench("gpu_gaps")
    bench.main(["--device", "cpu", "--model", "dummy:tiny", "--prompts", "30", "--decode-rows",
                "1", "--decode-context", "8", "--decode-tokens", "400", "--repeats", "1",
                "--num-kv-blocks", "256", "--profile", "--trace", str(tmp_path / "traces"),
                "--out", str(tmp_path)])  # fmt: skip
    profiled = [r for r in read_json(tmp_path, "burst")["results"]["runs"] if r.get("profiled")]
    assert sorted(r["trace"] for r in profiled) == ["burst-trace-0-rows.json.gz",
                                                    "burst-trace-1-rows.json.gz"]  # fmt: skip
    trace = gg.load_trace(tmp_path / "traces" / "burst-trace-1-rows.json.gz")
    names = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"}
    # on the event loop's thread (on CPU the step itself runs in a worker thread)
    assert {"burst", "LaneDispatcher.collect", "EngineCore.apply_step", "Scheduler.begin_step",
            "Scheduler.plan_prefill"} <= names  # fmt: skip
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--trace", str(tmp_path), "--out", str(tmp_path)])


def test_burst_over_http(tmp_path: Path) -> None:
    """bench/burst.py --http against a real ``verifypd serve``: the same runs through the
    server's front (its settings recorded, the vocabulary read from its dummy preset), and the
    decode rows' disconnects leave nothing running on it."""
    cmd = verifypd_serve_command("--model", "dummy:tiny", "--device", "cpu",
                                 "--num-kv-blocks", "256", "--max-model-len", "256")  # fmt: skip
    bench = load_bench("burst")
    with start_server_process(cmd, timeout=120) as server:
        argv = ["--http", server.url, "--prompts", "40", "20", "--decode-rows", "2",
                "--decode-context", "8", "--decode-tokens", "200", "--repeats", "1",
                "--out", str(tmp_path)]  # fmt: skip
        bench.main(argv)
        with pytest.raises(SystemExit):  # an in-process option, refused over HTTP
            bench.main([*argv, "--engine-option", "prefill_slice_layers=0"])
        metrics = urllib.request.urlopen(f"{server.url}/metrics", timeout=10).read().decode()
        server.stop()
    res = read_json(tmp_path, "burst")["results"]
    assert res["http"] == server.url and res["vocab"] == 512
    assert res["server_info"]["engine_config"]["model"] == "dummy:tiny"
    assert [r["decode_rows"] for r in res["runs"]] == [0, 2]
    for r in res["runs"]:
        assert len(r["ttft_ms"]) == 2 and max(r["ttft_ms"]) == pytest.approx(r["span_ms"])
    assert res["runs"][0]["decode_tokens_in_burst"] == 0
    assert res["runs"][1]["decode_tokens_in_burst"] > 0
    running = [line for line in metrics.splitlines()
               if line.startswith("verifypd_num_requests_running")]  # fmt: skip
    assert running and float(running[0].split()[-1]) == 0.0


def test_burst_compare_draws_each_file(tmp_path: Path) -> None:
    bench = load_bench("burst")
    data = {"results": {"summary": {"0": {"span_ms": 200.0}, "32": {"span_ms": 250.0}}}}
    files = []
    for tag in ("a", "b"):
        path = tmp_path / f"burst-cpu-{tag}-abc1234.json"
        path.write_text(json.dumps(data))
        files.append(str(path))
    bench.main(["--compare", *files, "--out", str(tmp_path / "c.png")])
    assert (tmp_path / "c.png").stat().st_size > 1000
