"""Smoke tests of the benchmark scripts that run the engine: offline.py, latency.py, spec.py,
gpu_check.py (its reference scorer and comparison, and hf_reference.py's config) and
draft_window.py; each ``main()`` runs on CPU with ``dummy:tiny`` (draft_window.py: SmolLM2)
and tiny sizes into a temp dir, and its JSON has the metadata and positive numbers. Plus how
common.py writes results (compact when large) and figures (palette PNGs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_bench
from smoke_helpers import META_KEYS, read_json


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
