"""On the GPU: start-up calibration is on by default with speculation, times decode and verify
points by replaying the captured graphs (the mixed shapes too: their plain rows are padded to
the verify width, as in a fused step; short prefill chunks replay the prompt graph, the longer
run eagerly), and gives every scratch block back."""

from __future__ import annotations

import pytest
import torch

from verifypd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from verifypd.costs import MIXED
from verifypd.engine.core import EngineCore

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def test_calibration_replays_the_graphs_and_frees_its_blocks() -> None:
    spec = SpecConfig(method="draft", draft_model="dummy:tiny", max_draft_len=3,
                      initial_draft_len=3)  # fmt: skip
    core = EngineCore(EngineConfig(
        model="dummy:tiny", device="cuda", spec=spec, cuda_graphs=True,
        scheduler=SchedulerConfig(max_num_seqs=16, max_model_len=1024),
        cache=CacheConfig(num_blocks=1024),
    ))  # fmt: skip
    table = core.cost_table
    assert table is not None  # calibrate_costs=None: on for CUDA with speculation
    runs = 1 + table.meta["repeats"]
    graphed = [k for k in table.target if k[1] != MIXED]
    assert {q for _, q in graphed} == {1, 2, 3, 4}
    mixed = [k for k in table.target if k[1] == MIXED]
    assert mixed  # 8 rows fit the verify graphs (16 rows)
    # prefill chunks up to prompt_graph_tokens replay the prompt graph, the longer run eager
    short = [n for n in table.prefill if n <= core.config.prompt_graph_tokens]
    assert short and len(short) < len(table.prefill)
    assert table.meta["target_graph_steps"] == runs * (len(graphed) + len(mixed) + len(short))
    assert table.meta["target_eager_steps"] == runs * (len(table.prefill) - len(short))
    assert table.meta["draft_graph_steps"] == runs * len(table.draft)
    assert all(t > 0 for t in table.target.values())
    assert core.kv.num_free_blocks == core.spec.drafter.kv.num_free_blocks == 1024
    core.check_integrity()
    assert core.runner.num_eager_steps == 0  # calibration's steps are not counted as steps


def test_an_engine_without_a_drafter_calibrates_too() -> None:
    """Decode-ahead's wait for a landing prompt reads the costs: measured without a drafter
    as with one (the target's decode and prefill points, no drafter points)."""
    core = EngineCore(EngineConfig(
        model="dummy:tiny", device="cuda", cuda_graphs=True,
        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=512),
        cache=CacheConfig(num_blocks=256),
    ))  # fmt: skip
    assert core.decode_ahead and core.cost_table is not None and core.costs.measured
    assert core.cost_table.draft == {} and core.cost_table.prefill
    assert core.kv.num_free_blocks == 256
