"""The CLI a vLLM user expects: unknown flags, --gpu-memory-utilization, Hugging Face ids from
the local cache, load progress, one-line errors for a bad --model, CORS flags."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import aiohttp
import pytest
from server_utils import bounded, start_server_process, verifypd_serve_command

from verifypd.__main__ import main
from verifypd.serve import cli
from verifypd.serve.cli import add_serve_args, serve_main
from verifypd.serve.model_source import hf_hub_cache

HF_ID = "tiny-org/tiny-llama"


def parse(*argv: str) -> argparse.Namespace:
    return add_serve_args(argparse.ArgumentParser()).parse_args(argv)


@pytest.fixture
def run_server_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    calls: list[dict] = []

    def fake_run_server(config, host, port, max_queue, **kwargs) -> int:
        calls.append({"config": config, **kwargs})
        return 0

    monkeypatch.setattr(cli, "run_server", fake_run_server)
    return calls


def test_unknown_serve_flags_are_an_error(run_server_calls, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--max-model-length", "64", "--tensor-parallel-size", "2"])
    assert exit_info.value.code == 2 and not run_server_calls
    err = capsys.readouterr().err
    assert "unknown arguments: --max-model-length (did you mean --max-model-len?)" in err
    assert "--tensor-parallel-size" in err
    with pytest.raises(SystemExit):
        main(["serve", "--gpu-memory-utilisation=0.5"])
    assert "did you mean --gpu-memory-utilization?" in capsys.readouterr().err
    assert main(["serve", "--model", "dummy:tiny", "--max-model-len", "64"]) == 0
    assert run_server_calls[0]["config"].scheduler.max_model_len == 64


def test_gpu_memory_utilization(run_server_calls, capsys) -> None:
    assert serve_main(parse("--model", "dummy:tiny", "--gpu-memory-utilization", "0.5")) == 0
    assert run_server_calls[0]["config"].cache.gpu_memory_utilization == 0.5
    for bad in ("0", "1.5", "-0.1"):
        assert serve_main(parse("--gpu-memory-utilization", bad)) == 2
        assert "gpu_memory_utilization must be in (0, 1]" in capsys.readouterr().err


def test_cors_flags(run_server_calls) -> None:
    assert serve_main(parse("--model", "dummy:tiny")) == 0
    assert not run_server_calls[0]["cors"].enabled  # default: no CORS
    argv = ("--model", "dummy:tiny", "--allowed-origins", '["http://a", "http://b"]',
            "--allowed-methods", "GET,POST")  # fmt: skip
    assert serve_main(parse(*argv)) == 0
    cors = run_server_calls[1]["cors"]
    assert cors.allowed_origins == ("http://a", "http://b")
    assert cors.allowed_methods == ("GET", "POST") and cors.allowed_headers == ("*",)


def tiny_hf_cache(root: Path) -> Path:
    """A Hugging Face hub cache holding HF_ID: refs/main -> snapshots/<commit> -> a tiny Llama
    (random weights, no tokenizer files: the loader gives it a DummyTokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    weights = root / "weights"
    LlamaForCausalLM(config).save_pretrained(weights, safe_serialization=True)
    repo = root / "hub" / f"models--{HF_ID.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots").mkdir()
    (repo / "snapshots" / commit).symlink_to(weights)
    return root / "hub"


def test_hf_cache_location_from_env(tmp_path: Path) -> None:
    assert hf_hub_cache({"HF_HUB_CACHE": "/x/hub", "HF_HOME": "/y"}) == Path("/x/hub")
    assert hf_hub_cache({"HF_HOME": "/y"}) == Path("/y/hub")
    assert hf_hub_cache({"XDG_CACHE_HOME": "/z"}) == Path("/z/huggingface/hub")
    assert hf_hub_cache({}) == Path.home() / ".cache" / "huggingface" / "hub"


def test_hf_id_resolves_from_the_local_cache(tmp_path, monkeypatch, run_server_calls, capsys):
    hub = tiny_hf_cache(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert serve_main(parse("--model", HF_ID)) == 0
    [call] = run_server_calls
    assert Path(call["config"].model).resolve() == (tmp_path / "weights").resolve()
    assert call["served_model_name"] == HF_ID  # served under its id, as vLLM does
    assert serve_main(parse("--model", HF_ID, "--revision", "v9")) == 2
    assert "at revision 'v9'" in capsys.readouterr().err
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    assert serve_main(parse("--model", HF_ID)) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("verifypd serve: error: model 'tiny-org/tiny-llama' is neither")
    assert len(run_server_calls) == 1


@bounded(240)
async def test_serve_hf_id_end_to_end_with_progress(tmp_path: Path) -> None:
    hub = tiny_hf_cache(tmp_path)
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    cmd = verifypd_serve_command("--model", HF_ID, "--device", "cpu")
    with start_server_process(cmd, timeout=180, env=env) as server:
        assert server.model == HF_ID
        async with aiohttp.ClientSession(server.url) as session:
            models = await (await session.get("/v1/models")).json()
            assert models["data"][0]["id"] == HF_ID
            payload = {"model": HF_ID, "prompt": "hello", "max_tokens": 3, "temperature": 0}
            body = await (await session.post("/v1/completions", json=payload)).json()
            assert body["usage"]["completion_tokens"] == 3
        assert server.stop() == 0
    log = "\n".join(server.stderr)
    steps = (
        f"resolved {HF_ID} to",
        "loading model",
        "loading weights 1/1",
        "sizing the KV",
        "ready:",
    )
    for step in steps:
        assert step in log, (step, log)
    assert "Traceback" not in log


@pytest.mark.parametrize("spec", ["no-such-model", "dummy:nope", "EMPTY_DIR"])
def test_bad_model_is_one_line_and_nonzero(tmp_path: Path, spec: str) -> None:
    import subprocess

    spec = str(tmp_path) if spec == "EMPTY_DIR" else spec
    cmd = verifypd_serve_command("--model", spec, "--device", "cpu")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and proc.stdout == ""
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert spec in errors[0] or "preset" in errors[0]
