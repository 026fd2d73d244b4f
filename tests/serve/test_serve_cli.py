"""``verifypd serve`` argument parsing and EngineConfig construction; start-up via run_server."""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import subprocess
import time

import aiohttp
import pytest
from server_utils import bounded, fake_server_command

from verifypd.config import PROMPT_IN_DECODE_SIZES, SchedulerConfig
from verifypd.lanes.spec_policy import goodput_config_for
from verifypd.serve import cli
from verifypd.serve.cli import add_serve_args, config_from_args, serve_main


def parse(*argv: str) -> argparse.Namespace:
    return add_serve_args(argparse.ArgumentParser()).parse_args(argv)


def test_defaults() -> None:
    args = parse()
    assert (args.host, args.port, args.max_queue, args.drain_timeout) == (
        "127.0.0.1",
        8000,
        512,
        30,
    )
    config = config_from_args(args)
    assert config.model == "default" and config.spec.method == "off"
    assert config.device == "auto" and config.lane_mode == "three"
    assert config.cache.num_blocks is None and config.cache.block_size == 16
    sched = config.scheduler
    assert (sched.max_num_batched_tokens, sched.max_prefill_chunk, sched.prefill_pack_tokens) == (
        8192,
        4096,
        512,
    )


def test_all_options_reach_the_config() -> None:
    args = parse(
        "--model", "dummy:tiny", "--draft-model", "dummy:tiny", "--device", "cpu",
        "--dtype", "float32", "--max-num-seqs", "4", "--num-kv-blocks", "100",
        "--block-size", "32", "--lane-mode", "single", "--max-model-len", "1024",
    )  # fmt: skip
    config = config_from_args(args)
    assert config.spec.method == "draft" and config.spec.draft_model == "dummy:tiny"
    assert (config.device, config.dtype, config.lane_mode) == ("cpu", "float32", "single")
    assert config.scheduler.max_num_seqs == 4 and config.scheduler.max_model_len == 1024
    assert (config.cache.num_blocks, config.cache.block_size) == (100, 32)
    old = parse("--max-num-batched-tokens", "4096", "--max-prefill-chunk", "2048",
                "--prefill-pack-tokens", "none")  # fmt: skip
    chunking = config_from_args(old).scheduler
    assert (chunking.max_num_batched_tokens, chunking.max_prefill_chunk) == (4096, 2048)
    assert chunking.prefill_pack_tokens is None  # FCFS packing
    assert config_from_args(parse("--prefill-pack-tokens", "0")).scheduler.prefill_pack_tokens == 0
    assert config.scheduler.prefill_pack_backlog_s is None
    burst = parse("--prefill-pack-backlog-s", "0.05")
    assert config_from_args(burst).scheduler.prefill_pack_backlog_s == 0.05
    assert config.prefill_sm_carveout == 0
    assert config_from_args(parse("--prefill-sm-carveout", "16")).prefill_sm_carveout == 16
    assert config.prefill_sm_carveout_in_backlog is False
    backlog = parse("--prefill-sm-carveout", "16", "--prefill-sm-carveout-in-backlog")
    assert config_from_args(backlog).prefill_sm_carveout_in_backlog is True
    assert config.prompt_ahead is None  # on where launches only enqueue (GPU)
    assert config_from_args(parse("--prompt-ahead")).prompt_ahead is True
    assert config_from_args(parse("--no-prompt-ahead")).prompt_ahead is False
    assert config.calibrate_costs is None  # on a GPU wherever something plans with costs
    assert config_from_args(parse("--calibrate-costs")).calibrate_costs is True
    assert config_from_args(parse("--no-calibrate-costs")).calibrate_costs is False
    assert config.prompt_in_decode_tokens == PROMPT_IN_DECODE_SIZES  # on by default
    inside = parse("--prompt-in-decode-tokens", "32,128")
    assert config_from_args(inside).prompt_in_decode_tokens == (32, 128)
    off = parse("--prompt-in-decode-tokens", "none")
    assert config_from_args(off).prompt_in_decode_tokens == ()
    with pytest.raises(ValueError, match="prompt_in_decode_tokens"):  # the config's check
        config_from_args(parse("--prompt-in-decode-tokens", "128,64"))
    with pytest.raises(SystemExit):  # not sizes: argparse's usage error
        parse("--prompt-in-decode-tokens", "64,lots")
    assert config_from_args(parse("--spec", "ngram")).spec.method == "ngram"
    assert config_from_args(parse("--spec", "ngram")).spec.controller
    fixed = config_from_args(parse("--spec", "ngram", "--draft-len", "3")).spec
    assert (fixed.initial_draft_len, fixed.max_draft_len, fixed.controller) == (3, 3, False)
    assert config_from_args(args).spec.synthetic_acceptance is None
    synthetic = parse("--draft-model", "dummy:tiny", "--synthetic-acceptance", "0.7")
    assert config_from_args(synthetic).spec.synthetic_acceptance == 0.7
    with pytest.raises(ValueError, match="synthetic_acceptance"):
        config_from_args(parse("--draft-model", "dummy:tiny", "--synthetic-acceptance", "2"))


def test_the_carveout_flag_takes_precedence_over_its_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VERIFYPD_PREFILL_SM_CARVEOUT", "8")
    assert config_from_args(parse()).prefill_sm_carveout == 8
    assert config_from_args(parse("--prefill-sm-carveout", "0")).prefill_sm_carveout == 0


def test_limit_flags_reach_the_limits_and_the_config() -> None:
    args = parse(
        "--max-request-bytes", "1000", "--request-read-timeout", "2.5", "--max-prompt-chars",
        "50", "--max-n", "4", "--max-priority", "3", "--max-request-kv-share", "0.25",
    )  # fmt: skip
    limits = cli.limits_from_args(args)
    assert (limits.max_request_bytes, limits.request_read_timeout_s) == (1000, 2.5)
    assert (limits.max_prompt_chars, limits.max_n, limits.max_priority) == (50, 4, 3)
    assert config_from_args(args).scheduler.max_request_kv_share == 0.25
    defaults = cli.limits_from_args(parse())
    assert (defaults.max_request_bytes, defaults.max_priority) == (4 << 20, 0)


@pytest.mark.parametrize(
    "argv",
    [("--spec", "draft"), ("--max-queue", "0"), ("--block-size", "24"), ("--draft-len", "17"),
     ("--max-request-kv-share", "0"), ("--max-priority", "-1"), ("--request-read-timeout", "0"),
     ("--max-prefill-chunk", "0"), ("--prefill-pack-tokens", "-1"),
     ("--max-num-batched-tokens", "0"), ("--prefill-sm-carveout", "-1"),
     ("--prefill-sm-carveout", "128")],
)  # fmt: skip
def test_bad_options_exit_2(argv: tuple[str, ...], capsys: pytest.CaptureFixture) -> None:
    assert serve_main(parse(*argv)) == 2
    assert "verifypd serve: error:" in capsys.readouterr().err


def test_serve_main_calls_run_server(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_run_server(config, host, port, max_queue, **kwargs) -> int:
        seen.update(config=config, host=host, port=port, max_queue=max_queue, **kwargs)
        return 0

    monkeypatch.setattr(cli, "run_server", fake_run_server)
    argv = ("--port", "0", "--max-queue", "7", "--drain-timeout", "2.5", "--api-key", "k")
    assert serve_main(parse(*argv)) == 0
    assert (seen["port"], seen["max_queue"], seen["drain_timeout"]) == (0, 7, 2.5)
    assert seen["api_key"] == "k" and seen["served_model_name"] is None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@bounded(20)
async def test_health_503_while_loading_and_sigterm_exits() -> None:
    port = free_port()
    cmd = fake_server_command("--port", str(port), "--load-s", "30")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        status = await _health_status(f"http://127.0.0.1:{port}")
        assert status == (503, {"status": "starting"})
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 10) == 0
        assert time.monotonic() - start < 5  # it did not wait for the 30 s load
        assert proc.stdout.read() == ""  # never printed the ready line
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def _health_status(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession(url) as session:
        while True:
            try:
                resp = await session.get("/health")
                return resp.status, await resp.json()
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.05)


def test_policy_knobs_reach_the_server_config_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The speculation policy's A/B knobs have no flag: ``VERIFYPD_FOLLOW_PREFILL`` and
    ``VERIFYPD_TAIL_TOLERANCE`` set them for a server."""
    args = parse("--draft-model", "dummy:tiny")
    assert not config_from_args(args).spec.follow_prefill
    monkeypatch.setenv("VERIFYPD_FOLLOW_PREFILL", "1")
    monkeypatch.setenv("VERIFYPD_TAIL_TOLERANCE", "0.1")
    spec = config_from_args(args).spec
    assert spec.follow_prefill and spec.tail_tolerance == 0.1


@pytest.mark.parametrize(
    ("flag", "field", "good", "value", "bad"),
    [
        ("--spec-tail-budget", "tail_budget", "0.005", 0.005, "1.5"),
        ("--draft-window", "draft_window", "256", 256, "0"),
        ("--spec-tpot-target-ms", "tpot_target_s", "4", 0.004, "0"),
    ],
)
def test_spec_policy_flags(flag, field, good, value, bad) -> None:
    args = parse("--draft-model", "dummy:tiny", flag, good)
    assert getattr(config_from_args(args).spec, field) == value
    assert getattr(config_from_args(parse()).spec, field) is None
    with pytest.raises(ValueError, match=field):
        config_from_args(parse("--draft-model", "dummy:tiny", flag, bad))


def test_spec_follow_prefill_rows_flag(monkeypatch) -> None:
    """``--spec-follow-prefill-rows N|all`` turns the drafter's pass behind prompt steps on, at
    most N rows decoding (all: any load); off without it; it wins over the environment's
    ``VERIFYPD_FOLLOW_PREFILL*``; a negative or unparsable N is refused."""
    spec = config_from_args(parse("--draft-model", "dummy:tiny", "--spec-follow-prefill-rows",
                                  "4")).spec  # fmt: skip
    assert spec.follow_prefill and spec.follow_prefill_max_rows == 4
    spec = config_from_args(parse("--draft-model", "dummy:tiny", "--spec-follow-prefill-rows",
                                  "all")).spec  # fmt: skip
    assert spec.follow_prefill and spec.follow_prefill_max_rows is None
    spec = config_from_args(parse("--draft-model", "dummy:tiny")).spec
    assert not spec.follow_prefill
    monkeypatch.setenv("VERIFYPD_FOLLOW_PREFILL", "1")
    monkeypatch.setenv("VERIFYPD_FOLLOW_PREFILL_MAX_ROWS", "8")
    assert config_from_args(parse("--draft-model", "dummy:tiny")).spec.follow_prefill_max_rows == 8
    spec = config_from_args(parse("--draft-model", "dummy:tiny", "--spec-follow-prefill-rows",
                                  "2")).spec  # fmt: skip
    assert spec.follow_prefill and spec.follow_prefill_max_rows == 2
    for bad in ("-1", "four"):
        with pytest.raises(SystemExit):
            parse("--draft-model", "dummy:tiny", "--spec-follow-prefill-rows", bad)


def test_spec_tpot_objective_flag_needs_a_target() -> None:
    """``--spec-tpot-objective`` sets ``SpecConfig.tpot_objective`` beside a target; alone it
    is refused with the reason."""
    args = parse("--draft-model", "dummy:tiny", "--spec-tpot-target-ms", "4",
                 "--spec-tpot-objective")  # fmt: skip
    spec = config_from_args(args).spec
    assert spec.tpot_objective and spec.tpot_target_s == 0.004
    assert not config_from_args(parse("--draft-model", "dummy:tiny")).spec.tpot_objective
    with pytest.raises(ValueError, match="tpot_objective needs a TPOT target"):
        config_from_args(parse("--draft-model", "dummy:tiny", "--spec-tpot-objective"))


def test_spec_tpot_variant_flags() -> None:
    """``--spec-tpot-tokens-weight`` and ``--spec-tpot-unguarded`` set the objective's
    variants; off by default; a weight of 0 or the guard dropped without the objective is
    refused with the reason."""
    base = ("--draft-model", "dummy:tiny", "--spec-tpot-target-ms", "5", "--spec-tpot-objective")
    spec = config_from_args(parse(*base, "--spec-tpot-tokens-weight", "1",
                                  "--spec-tpot-unguarded")).spec  # fmt: skip
    assert spec.tpot_tokens_weight == 1.0 and spec.tpot_unguarded
    plain = config_from_args(parse(*base)).spec
    assert plain.tpot_tokens_weight is None and not plain.tpot_unguarded
    with pytest.raises(ValueError, match="tpot_tokens_weight must be > 0"):
        config_from_args(parse(*base, "--spec-tpot-tokens-weight", "0"))
    target = ("--draft-model", "dummy:tiny", "--spec-tpot-target-ms", "5")
    with pytest.raises(ValueError, match="tpot_unguarded needs tpot_objective"):
        config_from_args(parse(*target, "--spec-tpot-unguarded"))
    with pytest.raises(ValueError, match="tpot_tokens_weight needs tpot_objective"):
        config_from_args(parse(*target, "--spec-tpot-tokens-weight", "1"))
    with pytest.raises(SystemExit):
        parse(*base, "--spec-tpot-tokens-weight", "heavy")


def test_spec_catch_up_flags() -> None:
    """``--spec-catch-up-every-steps`` and ``--spec-catch-up-round-tokens`` reach the policy's
    config (defaults as ``SpecConfig``'s); a bad value is refused with the reason."""
    base = ("--draft-model", "dummy:tiny")
    spec = config_from_args(parse(*base, "--spec-catch-up-every-steps", "1",
                                  "--spec-catch-up-round-tokens", "none")).spec  # fmt: skip
    assert (spec.catch_up_every_steps, spec.catch_up_round_tokens) == (1, None)
    assert goodput_config_for(SchedulerConfig(), spec, True, False).catch_up_every_steps == 1
    plain = config_from_args(parse(*base)).spec
    assert (plain.catch_up_every_steps, plain.catch_up_round_tokens) == (8, 1024)
    with pytest.raises(ValueError, match="catch_up_every_steps must be an int >= 1"):
        config_from_args(parse(*base, "--spec-catch-up-every-steps", "0"))
    with pytest.raises(ValueError, match="catch_up_round_tokens must be >= 1"):
        config_from_args(parse(*base, "--spec-catch-up-round-tokens", "0"))
    with pytest.raises(SystemExit):
        parse(*base, "--spec-catch-up-round-tokens", "lots")
