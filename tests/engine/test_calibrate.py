"""Start-up cost calibration (``engine.calibrate``) on CPU with dummy:tiny: it times the whole
grid, returns positive times, and leaves both KV pools and the runners' step counters exactly as
it found them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers import tiny_config, tiny_draft_spec

from verifypd.config import CacheConfig, EngineConfig, SchedulerConfig
from verifypd.costs import MIXED, CostTable
from verifypd.engine.calibrate import measure_costs, mixed_rows, row_grid, verify_widths
from verifypd.engine.core import EngineCore
from verifypd.engine.setup import calibration_wanted
from verifypd.lanes.sync_driver import SyncDriver


def _config(**overrides):
    return tiny_config(
        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=1024),
        cache=CacheConfig(num_blocks=512),
        spec=tiny_draft_spec(max_draft_len=2, initial_draft_len=2),
        **overrides,
    )


def _free(core: EngineCore) -> tuple[int, int]:
    return core.kv.num_free_blocks, core.spec.drafter.kv.num_free_blocks


def test_calibration_times_the_grid_and_gives_the_blocks_back() -> None:
    core = EngineCore(_config())
    assert core.cost_table is None  # off by default on the CPU
    before = _free(core)
    counters = (core.runner.num_eager_steps, core.spec.drafter.runner.num_eager_steps)
    table = measure_costs(core, context_len=40, repeats=1)
    assert table.context_len == 32  # whole blocks only
    decode = {(r, 1) for r in (1, 2, 4, 8)}
    verify = {(r, q) for r in (1, 2, 4, 8) for q in (2, 3)}
    assert set(table.target) == decode | verify | {(8, MIXED)}
    assert set(table.prefill) == {128, 512}
    assert set(table.draft) == {1, 2, 4, 8}
    values = [*table.target.values(), *table.prefill.values(), *table.draft.values()]
    assert all(v > 0 for v in values)
    assert table.mixed_draft_len == 2 and table.meta["repeats"] == 1
    # no graphs on the CPU: every point ran eagerly, a warm-up and one timed run each
    assert table.meta["target_graph_steps"] == table.meta["draft_graph_steps"] == 0
    assert table.meta["target_eager_steps"] == 2 * (len(table.target) + len(table.prefill))
    assert table.meta["draft_eager_steps"] == 2 * len(table.draft)
    assert _free(core) == before == (512, 512)
    core.check_integrity()
    core.spec.drafter.kv.check_integrity([])
    assert (core.runner.num_eager_steps, core.spec.drafter.runner.num_eager_steps) == counters


def test_the_config_knob_turns_it_on_and_the_engine_still_serves() -> None:
    core = EngineCore(_config(calibrate_costs=True))
    assert isinstance(core.cost_table, CostTable)
    assert core.costs.shape is core.cost_table  # the speculation policy's cost model reads it
    assert core.cost_table.target_time(3, 1) > 0 and core.cost_table.draft_time(3) > 0
    assert _free(core) == (512, 512)
    from verifypd.types import SamplingParams

    core.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    outs, driver = [], SyncDriver(core)
    while core.has_unfinished():
        outs += driver.step()
    assert outs[-1].finished and outs[-1].num_output_tokens == 4
    assert _free(core)[1] == 512  # the drafter's views are freed with the request


def test_target_only_calibration_measures_decode_and_prefill() -> None:
    cfg = tiny_config(scheduler=SchedulerConfig(max_num_seqs=3, max_model_len=256),
                      cache=CacheConfig(num_blocks=64))  # fmt: skip
    core = EngineCore(cfg)
    table = measure_costs(core, context_len=64, repeats=1)
    assert set(table.target) == {(1, 1), (2, 1), (3, 1)}
    assert set(table.prefill) == {128} and table.draft == {}
    assert core.kv.num_free_blocks == 64


def test_calibration_is_wanted_wherever_a_gpu_engine_plans_with_costs() -> None:
    """None: on for CUDA with a drafter, with the prefill bound, or with decode-ahead waiting
    for landing prompts (the default), so a server without a drafter plans decode-ahead with
    the same measured costs as one with a drafter; never on a CPU unless asked; the knob wins."""
    want = calibration_wanted
    default = EngineConfig()
    assert want(default, is_cuda=True, speculating=False)  # decode-ahead's landing rule reads it
    assert want(default, is_cuda=True, speculating=True)
    assert not want(default, is_cuda=False, speculating=True)
    no_wait = EngineConfig(decode_ahead_waits_for_prompts=False)
    assert not want(no_wait, is_cuda=True, speculating=False)
    assert want(no_wait, is_cuda=True, speculating=True)
    assert not want(EngineConfig(decode_ahead=False), is_cuda=True, speculating=False)
    bound = EngineConfig(decode_ahead=False,
                         scheduler=SchedulerConfig(prefill_step_target_s=0.02))  # fmt: skip
    assert want(bound, is_cuda=True, speculating=False)
    assert want(EngineConfig(decode_ahead=True), is_cuda=False, speculating=False) is False
    assert want(EngineConfig(calibrate_costs=True), is_cuda=False, speculating=False)
    assert not want(EngineConfig(calibrate_costs=False), is_cuda=True, speculating=True)


def test_calibrate_costs_is_validated() -> None:
    with pytest.raises(ValueError, match="calibrate_costs"):
        EngineConfig(calibrate_costs="yes")


def test_grids() -> None:
    assert row_grid(1) == [1]
    assert row_grid(64) == [1, 2, 4, 8, 16, 32, 64]
    assert row_grid(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert mixed_rows(256) == [8, 32] and mixed_rows(4) == [4] and mixed_rows(1) == []


def test_verify_widths_follow_the_captured_graphs() -> None:
    def fake(graphs, enabled=True):
        spec = SimpleNamespace(max_draft_len=4)
        return SimpleNamespace(spec=SimpleNamespace(enabled=enabled), runner=SimpleNamespace(
            graphs=graphs), config=SimpleNamespace(spec=spec))  # fmt: skip

    assert verify_widths(fake({1: 0, 2: 0, 3: 0})) == [1, 2, 3]
    assert verify_widths(fake({})) == [1, 2, 3, 4, 5]  # no graphs: every width runs eagerly
    assert verify_widths(fake({1: 0}, enabled=False)) == [1]
