"""``verifypd serve`` arguments and entry point (wired into ``verifypd/__main__.py``)."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys

from verifypd.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpecConfig,
    env_overrides,
    spec_env_overrides,
)
from verifypd.serve.app import DEFAULT_DRAIN_TIMEOUT_S, DEFAULT_MAX_QUEUE, run_server
from verifypd.serve.cors import CorsConfig, parse_list
from verifypd.serve.engine_client import EngineClient
from verifypd.serve.limits import add_limit_args, limits_from_args
from verifypd.serve.model_source import ModelSource, hf_hub_cache, resolve_model
from verifypd.serve.request_timing import timing_log
from verifypd.types import Observer

logger = logging.getLogger("verifypd.serve")


def int_or_none(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def int_or_all(text: str) -> int | None:
    """``N`` (an int >= 0) or ``all`` (None: no limit)."""
    if text.strip().lower() == "all":
        return None
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0 or all, got {text!r}")
    return value


def float_or_none(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def token_sizes(text: str) -> tuple[int, ...]:
    """``--prompt-in-decode-tokens``: comma-separated sizes, or ``none`` (never)."""
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        message = f"expected sizes like 64,128,256 or none, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Define the ``serve`` options on ``parser`` (a subcommand parser) and return it."""
    add = parser.add_argument
    add(
        "--model",
        default="default",
        help="default | PATH (HF dir or .gguf) | dummy:PRESET | ORG/NAME (from the local HF cache)",
    )
    add("--revision", default=None, help="revision of a Hugging Face --model (default: main)")
    add("--draft-model", default=None, help="draft model spec (implies --spec draft)")
    add(
        "--spec",
        choices=("off", "ngram", "draft"),
        default=None,
        help="speculative decoding method (default: draft if --draft-model, else off)",
    )
    add(
        "--draft-len",
        type=int,
        default=None,
        help="fixed draft length L (turns the controller off); default: the controller picks L",
    )
    add(
        "--draft-window",
        type=int,
        default=None,
        metavar="N",
        help="the draft model sees a long prompt's first 4 and last N tokens only (its pass "
        "over a prompt costs at most N + 4 tokens; output stays lossless, acceptance may "
        "fall); default: the whole context",
    )
    add(
        "--spec-tail-budget",
        type=float,
        default=None,
        metavar="SHARE",
        help="the speculation policy keeps the tokens that speculation makes late (more than "
        "1.05 plain decode steps after the one before) to about SHARE of all tokens, e.g. "
        "0.002: the ITL p99 stays a plain step's, and speculation is given up wherever its "
        "rounds are longer than that; default: no budget",
    )
    add(
        "--spec-tpot-target-ms",
        type=float,
        default=None,
        metavar="MS",
        help="the TPOT target requests are served to: while a plain decode step is slower than "
        "it, every request misses it plainly, so the speculation policy drops its latency "
        "guard and rider bound and speculates for the most tokens per second (requests that "
        "accept little may then run slower than plain); default: none",
    )
    add(
        "--spec-tpot-objective",
        action="store_true",
        help="with --spec-tpot-target-ms: the policy ranks its plans by the requests they bring "
        "under the target, then by tokens per second (not by tokens per second alone): it "
        "speculates where that makes some requests meet the target even when the batch's "
        "throughput falls",
    )
    add(
        "--spec-tpot-tokens-weight",
        type=float,
        default=None,
        metavar="W",
        help="with --spec-tpot-objective: tokens a second weighed W to 1 against the share of "
        "requests within the target, where by default plans are ranked by that share first; "
        "default: none",
    )
    add(
        "--spec-tpot-unguarded",
        action="store_true",
        help="with --spec-tpot-objective: no latency guard or rider bound even while a plain "
        "decode step meets the target (by default they hold while it does)",
    )
    add(
        "--spec-follow-prefill-rows",
        type=int_or_all,
        default=False,
        metavar="N|all",
        help="the draft model computes its own KV of each prompt behind the prompt step while "
        "at most N rows decode and no other prompt waits (all: at any load), so a request's "
        "first speculative round needs no catch-up; for a drafter far cheaper than the target, "
        "such as an EAGLE-3-sized head (H200, 2 req/s: catch-up rounds went from 40-46 %% of "
        "the slowest tokens to 4-6 %%; 4 measured); default: off (a 0.5B drafter's pass slowed "
        "the decode steps beside it)",
    )
    add("--spec-catch-up-every-steps", type=int, default=SpecConfig.catch_up_every_steps,
        metavar="N", help="the policy's catch-up rounds (a fresh request's draft model fed its "
        "context) at most every N decode steps; default 8, set for a 0.5B drafter; 1 for a "
        "drafter far cheaper than the target, such as an EAGLE-3-sized head")  # fmt: skip
    add("--spec-catch-up-round-tokens", type=int_or_none, metavar="N|none",
        default=SpecConfig.catch_up_round_tokens, help="most context tokens one catch-up round "
        "feeds the draft model (its first request always goes); default 1024; none: no limit "
        "(with a drafter as cheap as above: H200, 5 ms TPOT target, both: 20-130 %% more "
        "requests within it at 14-26 req/s)")  # fmt: skip
    add(
        "--synthetic-acceptance",
        type=float,
        default=None,
        metavar="A",
        help="benchmark only: accepted draft counts drawn with acceptance A in [0, 1] (real "
        "draft and verify forwards); requests may then set their own synthetic_acceptance",
    )
    add("--device", choices=("auto", "cpu", "cuda"), default="auto")
    add("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000, help="0 picks a free port (printed when ready)")
    add(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help="max requests admitted and unfinished (queued + running); beyond it: 429",
    )
    add("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    for flag, name, kind, text in SCHEDULER_FLAGS:
        add(flag, type=kind, default=getattr(SchedulerConfig, name), help=text,
            metavar="N|none" if kind is int_or_none else None)  # fmt: skip
    add("--prefill-sm-carveout", type=int, default=None, metavar="N",
        help="SMs a prompt step's GEMMs leave to the decode lanes while decode rows run "
             "(GPU; default 0: all SMs; lower ITL beside prompt steps, slower prompt steps; "
             "overrides VERIFYPD_PREFILL_SM_CARVEOUT)")  # fmt: skip
    add("--prefill-sm-carveout-in-backlog", action="store_true",
        help="keep the carve-out while other prompts wait behind the prompt step too (by "
             "default a prompt step with prompts queued behind it takes every SM)")  # fmt: skip
    add("--fuse-decode-backlog-s", type=float_or_none, default=argparse.SUPPRESS,
        metavar="S|none",
        help="once the oldest queued prompt has waited S seconds, decode rows ride inside the "
             "prompt steps (one forward, as vLLM's steps) until the queue drains: a burst's "
             "prompts compute faster, its decode tokens wait for whole prompt steps; "
             "default 0.02; none: never")  # fmt: skip
    add("--fuse-decode-backlog-tokens", type=int, default=None, metavar="N",
        help="with --fuse-decode-backlog-s: only while the queued prompts hold at least N "
             "tokens (a burst, not one long prompt); default 4096; 0: any backlog")  # fmt: skip
    add("--fuse-rounds-rows", type=int, default=None, metavar="N",
        help="from N decoding rows, while a prompt waits, the rows and their drafts ride in "
             "the prompt step (one forward, as the single lane); off by default: measured "
             "for a fixed L only (docs/performance.md)")  # fmt: skip
    add("--prompt-ahead", action=argparse.BooleanOptionalAction, default=None,
        help="launch the next prompt step behind the one running (on by default on a GPU): "
             "the host's turnaround between prompt steps overlaps the GPU; a burst's first "
             "tokens come sooner, decode steps beside prompt steps get no gap of their own "
             "(docs/performance.md); --no-prompt-ahead turns it off")  # fmt: skip
    add("--calibrate-costs", action=argparse.BooleanOptionalAction, default=None,
        help="time the step costs at start-up (~1.5 s; on by default on a GPU): the speculation "
             "policy and decode-ahead plan with them, with or without a drafter")  # fmt: skip
    add("--prompt-in-decode-tokens", type=token_sizes, default=None, metavar="N,N,...|none",
        help="a prompt whose rest is at most the largest size is computed inside the next plain "
             "decode step, padded to the smallest size that holds it (GPU with CUDA graphs; "
             "default 64,96,128,160,192,224,256; none: prompt steps only)")  # fmt: skip
    add("--max-model-len", type=int, default=None, help="default: the model's context length")
    add("--num-kv-blocks", type=int, default=None, help="default: sized from memory")
    add("--block-size", type=int, default=CacheConfig.block_size)
    add(
        "--gpu-memory-utilization",
        type=float,
        default=CacheConfig.gpu_memory_utilization,
        help="fraction of GPU memory for weights + KV cache (sizes the KV cache; no effect on CPU)",
    )
    add(
        "--max-logprobs",
        type=int,
        default=EngineConfig.max_logprobs,
        help="most top log-probs a request may ask for (completions logprobs, chat top_logprobs)",
    )
    add("--lane-mode", choices=("three", "single"), default="three")
    add("--engine-process", action="store_true",
        help="run the engine in its own process: the HTTP front (parsing, tokenizing, streaming, "
             "metrics) no longer shares the engine's event loop (docs/api.md)")  # fmt: skip
    add(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="seconds in-flight requests get to finish after SIGTERM/SIGINT",
    )
    add("--served-model-name", default=None, help="model id in the API (default: the model's)")
    add("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    add("--allowed-origins", default="", help="CORS origins: a,b or '[\"a\"]' or * (default: off)")
    add("--allowed-methods", default="*", help="CORS methods for --allowed-origins (default: *)")
    add("--allowed-headers", default="*", help="CORS headers for --allowed-origins (default: *)")
    add_limit_args(parser)
    add("--seed", type=int, default=0)
    add("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    add("--log-request-timing", action="store_true",
        help="log one line per generation request: when it was received, handed to the "
             "engine, its first token sent by the engine, got and written, and done (ms; the "
             "client's X-Request-Id header included; docs/api.md)")  # fmt: skip
    return parser


# flag, SchedulerConfig field, type, help: how prompt work is cut into steps
SCHEDULER_FLAGS = (
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, "token budget of one step"),
    ("--max-prefill-chunk", "max_prefill_chunk", int,
     "one request's prompt tokens per step (longer prompts are chunked)"),
    ("--prefill-pack-tokens", "prefill_pack_tokens", int_or_none,
     "beside a prompt step's first chunk, only chunks that end their prompt, up to N tokens; "
     "none: every waiting chunk, first come first served, up to the step's budget (with "
     "--max-prefill-chunk 2048: lower ITL p99, higher TTFT p99 under load)"),
    ("--prefill-pack-backlog-s", "prefill_pack_backlog_s", float_or_none,
     "while the oldest queued prompt has waited longer than this, prompt steps pack every "
     "waiting chunk up to the step's budget (a burst); none: never"),
)  # fmt: skip


def unknown_args_message(parser: argparse.ArgumentParser, rest: list[str]) -> str:
    """'unknown argument --x (did you mean --y?)' for what ``parse_known_args`` left over."""
    known = [opt for action in parser._actions for opt in action.option_strings]
    flags = [arg.split("=", 1)[0] for arg in rest if arg.startswith("-")] or rest
    parts = []
    for flag in flags:
        close = difflib.get_close_matches(flag, known, n=3, cutoff=0.6)
        parts.append(flag + (f" (did you mean {' or '.join(close)}?)" if close else ""))
    noun = "argument" if len(parts) == 1 else "arguments"
    return f"unknown {noun}: {', '.join(parts)}"


def follow_prefill(rows: int | None | bool) -> dict[str, bool | int | None]:
    """``SpecConfig`` fields of ``--spec-follow-prefill-rows`` (False: not given; the flag
    wins over ``VERIFYPD_FOLLOW_PREFILL*``)."""
    if rows is False:
        return {}
    return {"follow_prefill": True, "follow_prefill_max_rows": rows}


def config_from_args(
    args: argparse.Namespace, model: str | None = None, draft_model: str | None = None
) -> EngineConfig:
    """Build the EngineConfig (``model``/``draft_model``: resolved specs overriding the flags);
    raises ValueError on inconsistent options."""
    draft_model = draft_model or args.draft_model
    method = args.spec or ("draft" if draft_model else "off")
    fixed = {} if args.draft_len is None else {
        "max_draft_len": args.draft_len, "initial_draft_len": args.draft_len, "controller": False,
    }  # fmt: skip
    spec = SpecConfig(
        method=method,
        draft_model=draft_model,
        synthetic_acceptance=args.synthetic_acceptance,
        draft_window=args.draft_window,
        tail_budget=args.spec_tail_budget,
        tpot_target_s=None if args.spec_tpot_target_ms is None else args.spec_tpot_target_ms / 1e3,
        tpot_objective=args.spec_tpot_objective,
        tpot_tokens_weight=args.spec_tpot_tokens_weight,
        tpot_unguarded=args.spec_tpot_unguarded,
        catch_up_every_steps=args.spec_catch_up_every_steps,
        catch_up_round_tokens=args.spec_catch_up_round_tokens,
        **fixed,
        **{**spec_env_overrides(os.environ), **follow_prefill(args.spec_follow_prefill_rows)},
    )
    cache = CacheConfig(
        block_size=args.block_size,
        num_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    return EngineConfig(
        model=model or args.model,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        lane_mode=args.lane_mode,
        cache=cache,
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_prefill_chunk=args.max_prefill_chunk,
            prefill_pack_tokens=args.prefill_pack_tokens,
            prefill_pack_backlog_s=args.prefill_pack_backlog_s,
            max_model_len=args.max_model_len,
            max_request_kv_share=args.max_request_kv_share,
        ),
        spec=spec,
        max_logprobs=args.max_logprobs,
        **engine_overrides(args),
    )


def engine_overrides(args: argparse.Namespace) -> dict[str, object]:
    """EngineConfig fields from the environment (``config.env_overrides``), a flag given on the
    command line taking precedence over its variable."""
    out: dict[str, object] = env_overrides(os.environ)
    if args.prefill_sm_carveout is not None:
        out["prefill_sm_carveout"] = args.prefill_sm_carveout
    if args.prefill_sm_carveout_in_backlog:
        out["prefill_sm_carveout_in_backlog"] = True
    if args.prompt_ahead is not None:
        out["prompt_ahead"] = args.prompt_ahead
    if args.calibrate_costs is not None:
        out["calibrate_costs"] = args.calibrate_costs
    if args.prompt_in_decode_tokens is not None:
        out["prompt_in_decode_tokens"] = args.prompt_in_decode_tokens
    if hasattr(args, "fuse_decode_backlog_s"):  # given, "none" included
        out["fuse_decode_backlog_s"] = args.fuse_decode_backlog_s
    if args.fuse_decode_backlog_tokens is not None:
        out["fuse_decode_backlog_tokens"] = args.fuse_decode_backlog_tokens
    if args.fuse_rounds_rows is not None:
        out["fuse_rounds_rows"] = args.fuse_rounds_rows
    return out


def cors_from_args(args: argparse.Namespace) -> CorsConfig:
    return CorsConfig(
        parse_list(args.allowed_origins),
        parse_list(args.allowed_methods),
        parse_list(args.allowed_headers),
    )


def resolve_models(args: argparse.Namespace) -> tuple[ModelSource, ModelSource | None]:
    """``--model`` and ``--draft-model`` as local specs (Hugging Face ids from the local cache,
    found through HF_HUB_CACHE / HF_HOME: the environment is read here and nowhere below)."""
    cache_dir = hf_hub_cache(os.environ)
    model = resolve_model(args.model, cache_dir, args.revision)
    draft = resolve_model(args.draft_model, cache_dir) if args.draft_model else None
    for source in (model, draft):
        if source is not None and source.hf_id:
            logger.info("resolved %s to %s", source.hf_id, source.spec)
    return model, draft


def serve_main(args: argparse.Namespace) -> int:
    """Run ``verifypd serve``; returns the process exit code."""
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.log_request_timing:
        timing_log.setLevel(logging.INFO)
    try:
        model, draft = resolve_models(args)
        config = config_from_args(args, model.spec, draft.spec if draft else None)
        cors = cors_from_args(args)
        limits = limits_from_args(args)
        if args.max_queue < 1:
            raise ValueError("--max-queue must be >= 1")
    except ValueError as exc:
        print(f"verifypd serve: error: {exc}", file=sys.stderr)
        return 2
    return run_server(
        config,
        args.host,
        args.port,
        args.max_queue,
        served_model_name=args.served_model_name or model.hf_id,
        api_key=args.api_key,
        drain_timeout=args.drain_timeout,
        cors=cors,
        limits=limits,
        engine_factory=remote_engine if args.engine_process else None,
    )


def remote_engine(config: EngineConfig, observer: Observer) -> EngineClient:
    """``--engine-process``: the engine in a child process (``serve.engine_process``)."""
    from verifypd.serve.engine_process import RemoteEngine

    return RemoteEngine(config, observer)
