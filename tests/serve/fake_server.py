"""Run the real ``run_server`` (uvloop, signals, drain) around a FakeEngine.

python tests/serve/fake_server.py --port 0 --drain-timeout 2 --step-s 0.01
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parents[2]))  # the repo root, when not pip-installed

from fake_engine import FakeEngine  # noqa: E402

from verifypd.config import EngineConfig  # noqa: E402
from verifypd.serve.app import run_server  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    parser.add_argument("--step-s", type=float, default=0.005)
    parser.add_argument("--load-s", type=float, default=0.0, help="simulated model load time")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    args = parser.parse_args()
    logging.basicConfig(stream=sys.stderr, level=logging.INFO)

    def factory(config: EngineConfig, observer: object) -> FakeEngine:
        if args.load_s:
            import time

            time.sleep(args.load_s)
        return FakeEngine(step_s=args.step_s, max_num_seqs=args.max_num_seqs, observer=observer)

    return run_server(
        EngineConfig(model="dummy:tiny"),
        args.host,
        args.port,
        args.max_queue,
        drain_timeout=args.drain_timeout,
        engine_factory=factory,
    )


if __name__ == "__main__":
    sys.exit(main())
