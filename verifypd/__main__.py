"""CLI: ``verifypd serve | generate | bench``."""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

from verifypd.config import EngineConfig, SpecConfig, env_overrides, spec_env_overrides


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="default", help="default | PATH (HF dir or .gguf) | dummy:PRESET"
    )
    p.add_argument("--draft-model", default=None, help="draft model spec for --spec draft")
    p.add_argument("--spec", default="off", choices=["off", "ngram", "draft"])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    spec = SpecConfig(
        method=args.spec, draft_model=args.draft_model, **spec_env_overrides(os.environ)
    )
    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        spec=spec,
        **env_overrides(os.environ),
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from verifypd.llm import LLM
    from verifypd.types import SamplingParams

    llm = LLM(config=engine_config(args))
    tok = llm.tokenizer
    if args.raw:
        ids = list(tok.encode(args.prompt))
    else:
        messages = [{"role": "user", "content": args.prompt}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = list(tok.encode(text, add_special_tokens=False))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sample_seed
    )

    async def stream() -> None:
        async for out in llm.engine.generate("cli", ids, params):
            sys.stdout.write(out.new_text)
            sys.stdout.flush()

    llm.run(stream())
    llm.close()
    sys.stdout.write("\n")
    return 0


# Modules of bench/ that other scripts import; everything else there is a benchmark.
BENCH_LIBRARIES = frozenset(
    {
        "common",
        "harness",
        "hf_batch",
        "http_load",
        "loadgen",
        "sweep",
        "sweep_criteria",
        "sweep_ab",
        "intervals",
        "loop_callbacks",
        "mixed_sweep",
        "mixed_mode",
        "mixed_modes",
        "mixed_modes_ab",
        "mixed_report",
        "overlap_report",
        "kernel_shapes",
        "front_sweeps",
        "itl_anatomy",
        "ttft_anatomy",
        "process_counters",
        "machine_probe",
        "sweep_plots",
        "peer_sweep",
        "peer_engines",
        "peer_report",
        "peer_workloads",
        "result_files",
        "bar_plots",
        "hw_ceilings",
        "hf_reference",
        "decode_timing",
    }
)


def bench_dir() -> Path:
    """``bench/`` of the checkout this package runs from (a clone or an editable install)."""
    return Path(__file__).resolve().parents[1] / "bench"


def bench_names(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.py") if p.stem not in BENCH_LIBRARIES)


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    folder = bench_dir()
    names = bench_names(folder)
    if args.name not in names:
        if not names:
            print(f"verifypd bench: no benchmarks in {folder}; they ship with the repository "
                  "(install it from a clone with `pip install -e .`)", file=sys.stderr)  # fmt: skip
        else:
            what = f"unknown benchmark {args.name!r}" if args.name else "name a benchmark"
            print(f"verifypd bench: {what}; choose one of: {', '.join(names)}", file=sys.stderr)
        return 2
    script = folder / f"{args.name}.py"
    saved_argv, sys.argv = sys.argv, [str(script), *rest]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = saved_argv
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verifypd")
    sub = parser.add_subparsers(dest="cmd", required=True)
    from verifypd.serve.cli import add_serve_args

    serve = add_serve_args(sub.add_parser("serve", help="OpenAI-compatible HTTP server"))
    gen = sub.add_parser("generate", help="one-shot generation, streamed to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sample-seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="no chat template")
    add_engine_args(gen)
    # No -h of its own: `verifypd bench NAME --help` is the script's help.
    bench = sub.add_parser("bench", help="run a script of bench/ (NAME --help)", add_help=False)
    bench.add_argument("name", nargs="?", default="", help="latency | spec | mixed | ...")
    args, rest = parser.parse_known_args(argv)
    if args.cmd == "serve":
        from verifypd.serve.cli import serve_main, unknown_args_message

        if rest:  # a vLLM flag verifypd lacks must not start a server with other settings
            serve.error(unknown_args_message(serve, rest))
        return serve_main(args)
    if rest and args.cmd != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "generate":
        return cmd_generate(args)
    return cmd_bench(args, rest)


if __name__ == "__main__":
    sys.exit(main())
