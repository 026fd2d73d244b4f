"""Smoke tests of bench/overlap.py and bench/mixed.py: each ``main()`` runs on CPU with
``dummy:tiny`` and tiny sizes into a temp dir; its JSON has the metadata and positive numbers.
Plus exact checks of the latency arithmetic both scripts rest on."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import load_bench

META_KEYS = {"device", "versions", "git_commit", "date_utc", "command", "params", "ceilings"}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def read_json(out: Path, script: str) -> dict:
    data = json.loads((out / f"{script}-cpu.json").read_text())
    assert META_KEYS <= set(data)
    assert data["device"] == "cpu" and data["complete"] is True
    assert data["command"].startswith(f"python bench/{script}.py")
    assert (out / f"{script}-cpu.png").is_file()
    return data


def test_overlap(tmp_path: Path) -> None:
    argv = ["--device", "cpu", "--model", "dummy:tiny", "--batches", "1", "3", "--context", "20",
            "--repeats", "2", "--warmup", "1", "--out", str(tmp_path)]  # fmt: skip
    load_bench("overlap").main(argv)
    data = read_json(tmp_path, "overlap")
    assert data["engine"]["front"] == "EngineCore + ModelRunner.launch"
    for batch in ("1", "3"):
        r = data["results"][batch]
        assert "error" not in r, r.get("error")
        assert r["verify_batch"] == int(batch) and r["draft_len"] == 4
        for timing in ("real", "queued"):
            m = r[timing]
            for key in ("alone", "overlap", "fused", "sequential"):
                assert m[f"decode_{key}_ms"] > 0
            assert m["verify_alone_ms"] > 0 and m["verify_overlap_ms"] > 0
            assert isinstance(m["gain_vs_fused"], float)
            assert m["gate_not_held"] == 0
            assert all(len(m["samples"][k]) == 2 for k in ("alone", "overlap", "verify"))
            # CPU steps run synchronously: verify is over before decode arrives.
            assert m["verify_busy_at_arrival_frac"] == 0.0


def test_overlap_sample_values() -> None:
    overlap = load_bench("overlap")
    timer = SimpleNamespace(ms=lambda a, b: (b - a) * 1e3)
    marks = {"v_start": 1.000, "v_end": 1.010, "d_arrival": 1.004, "d_end": 1.012,
             "v_host_ms": 3.0, "d_host_ms": 1.0}  # fmt: skip
    vals = overlap.sample_values(timer, 1.0, marks)
    assert vals["decode_ms"] == pytest.approx(8.0)
    assert vals["verify_ms"] == pytest.approx(10.0)
    assert vals["overlap_ms"] == pytest.approx(6.0)
    assert vals["total_ms"] == pytest.approx(12.0)
    assert vals["verify_busy_at_arrival"] is True
    assert vals["v_host_ms"] == 3.0


MIXED_TINY = ["--device", "cpu", "--model", "dummy:tiny", "--draft-model", "dummy:tiny",
              "--num-requests", "6", "--rate", "40", "--short-prompt-len", "8", "16",
              "--short-output-len", "4", "8", "--long-prompt-len", "40", "64",
              "--long-output-len", "2", "4", "--long-fraction", "0.34", "--warmup-requests", "1",
              "--max-num-seqs", "8", "--snapshot-interval", "0.002"]  # fmt: skip


def test_mixed(tmp_path: Path) -> None:
    load_bench("mixed").main([*MIXED_TINY, "--out", str(tmp_path)])
    data = read_json(tmp_path, "mixed")
    assert data["synthetic_acceptance"]["used"] is True
    assert data["synthetic_acceptance"]["per_request"] is False
    assert data["workload"]["num_requests"] == 6
    lanes = {"three-ctrl": "three", "three-fixed": "three", "single-fixed": "single",
             "three-off": "three"}  # fmt: skip
    assert list(data["results"]) == list(lanes)
    for name, r in data["results"].items():
        assert "error" not in r, r.get("error")
        assert r["engine"]["lane_mode"] == lanes[name]
        load_, lat = r["load"], r["latency"]
        assert load_["num_finished"] == 6 and load_["num_errors"] == 0
        assert load_["output_tokens"] == load_["requested_output_tokens"] > 0
        assert load_["output_tok_s"] > 0
        assert lat["ttft_ms"]["p50"] > 0 and lat["itl_ms"]["p99"] > 0 and lat["e2e_ms"]["n"] == 6
        assert len(r["requests"]) == 6
        slowest = [x["seconds"] for x in r["steps"]["slowest"]]
        assert 0 < len(slowest) <= 8 and slowest == sorted(slowest, reverse=True)
        if name == "three-off":
            assert r["spec"] is None and r["controller"] is None
            continue
        if name.endswith("-fixed"):  # fixed L drafts every step: alpha 0.7 shows
            assert 0 < r["spec"]["acceptance_rate"] < 1 and r["spec"]["mean_drafts_per_verify"] > 0
        else:  # the goodput policy may draft a handful of tokens on CPU (or none)
            assert r["spec"]["acceptance_rate"] is None or 0 <= r["spec"]["acceptance_rate"] <= 1
        assert r["controller"]["final"]["num_steps"] > 0
        assert r["controller"]["num_snapshots"] > 0
        proposals = r["spec"]["slowest_proposals"]
        assert proposals and all(p["seconds"] > 0 and p["num_seqs"] >= 0 for p in proposals)
    assert data["results"]["three-ctrl"]["engine"]["spec"]["controller"] is True
    assert data["results"]["single-fixed"]["engine"]["spec"]["controller"] is False


def test_trace_arithmetic() -> None:
    loadgen = load_bench("loadgen")
    t = loadgen.Trace("r", "short", 10, 4, arrival=0.5)
    t.deltas = [(1.0, 1), (1.5, 1), (2.5, 2)]
    t.finish_time, t.finish_reason = 2.5, "length"
    assert t.ttft_s == pytest.approx(0.5) and t.e2e_s == pytest.approx(2.0)
    assert t.itl_samples() == pytest.approx([0.5, 0.5, 0.5])  # a 2-token delta: 2 samples
    assert t.tpot_s == pytest.approx(0.5)
    stats = loadgen.latency_stats([t])
    assert stats["itl_ms"]["n"] == 3 and stats["delta_gap_ms"]["p50"] == pytest.approx(750.0)
    assert loadgen.load_stats([t], 0.5)["output_tok_s"] == pytest.approx(2.0)


def test_requests_are_seeded_poisson_mix() -> None:
    loadgen = load_bench("loadgen")
    mix = loadgen.Mix((8, 16), (4, 8), (40, 64), (2, 4), long_fraction=0.25)
    a = loadgen.make_requests(mix, 512, 0, 200, 40.0)
    b = loadgen.make_requests(mix, 512, 0, 200, 40.0)
    assert [(r.arrival_s, r.prompt, r.max_tokens) for r in a] == [
        (r.arrival_s, r.prompt, r.max_tokens) for r in b
    ]
    arrivals = [r.arrival_s for r in a]
    assert arrivals == sorted(arrivals) and 3.0 < arrivals[-1] < 7.0  # 200 at 40/s: ~5 s
    longs = [r for r in a if r.kind == "long"]
    assert 25 < len(longs) < 75
    assert all(40 <= len(r.prompt) <= 64 and 2 <= r.max_tokens <= 4 for r in longs)
    assert all(max(r.prompt) < 512 for r in a)
    capped = loadgen.make_requests(mix, 512, 0, 100, 40.0, duration_s=1.0)
    assert 0 < len(capped) < 100 and all(r.arrival_s <= 1.0 for r in capped)
    assert all(r.arrival_s == 0.0 for r in loadgen.make_requests(mix, 512, 1, 5, None))


@pytest.mark.parametrize("name", ["off-noahead", "policy-noahead"])
def test_noahead_modes_turn_decode_ahead_off_and_nothing_else(name) -> None:
    mixed = load_bench("mixed")
    args = mixed.parse_args(["--device", "cpu", "--model", "dummy:tiny"])
    base = mixed.mode_config(args, name.removesuffix("-noahead"))
    cfg = mixed.mode_config(args, name)
    assert base.decode_ahead is None and cfg.decode_ahead is False
    assert cfg.replace(decode_ahead=None) == base


def test_every_mode_builds_a_config_and_scheduler_variants_set_their_fields() -> None:
    """Each of ``MODES`` gives a valid EngineConfig; a mode's scheduler options override the
    command line's (the chunking variants against --max-prefill-chunk)."""
    mixed = load_bench("mixed")
    args = mixed.parse_args(["--device", "cpu", "--model", "dummy:tiny"])
    for name in mixed.MODES:
        assert mixed.mode_config(args, name).scheduler.max_prefill_chunk > 0, name
    chunking = lambda name: (  # noqa: E731
        mixed.mode_config(args, name).scheduler.max_prefill_chunk,
        mixed.mode_config(args, name).scheduler.prefill_pack_tokens,
    )
    assert chunking("off") == chunking("policy") == (4096, 512)  # the defaults
    assert chunking("off-chunk2k") == chunking("policy-chunk2k") == (2048, None)
    assert chunking("off-chunk4k") == chunking("policy-chunk4k") == (4096, None)
    assert chunking("off-pack512") == (2048, 512) == chunking("policy-pack512")
    assert chunking("policy-chunk4k-pack512") == (4096, 512)
    chunked = mixed.mode_config(args, "policy-chunk2k")
    assert chunked.replace(scheduler=mixed.mode_config(args, "policy").scheduler) == (
        mixed.mode_config(args, "policy")
    )
    one_step = mixed.mode_config(args, "policy-chunk4k-pack512").scheduler
    assert mixed.mode_config(args, "off").kernels.gemm_split_rows == 0
    split = mixed.mode_config(args, "policy-chunk4k-pack512-split1k")
    assert split.kernels.gemm_split_rows == 1024 and split.scheduler == one_step
    assert mixed.mode_config(args, "policy").prefill_sm_carveout == 0
    for n in (8, 16, 32):
        for base in ("off", "policy"):
            carved = mixed.mode_config(args, f"{base}-carve{n}")
            assert carved == mixed.mode_config(args, base).replace(prefill_sm_carveout=n)


def test_stuck_modes_start_every_run_from_a_low_population_prior() -> None:
    """``policy-stuck`` / ``policy-nostale-stuck``: the goodput policy's population α is reset
    to 0.3 before each run (``reset_population``); other modes keep what the engine learnt."""
    from verifypd.lanes.async_engine import AsyncEngine

    mixed = load_bench("mixed")
    args = mixed.parse_args(["--device", "cpu", "--model", "dummy:tiny",
                             "--draft-model", "dummy:tiny"])  # fmt: skip
    core = AsyncEngine(mixed.mode_config(args, "policy-nostale-stuck")).core
    assert core.config.spec.probe_when_stale is False
    core.controller.population.update(4, 4)
    mixed.reset_population(core, "policy-nostale-stuck")
    assert core.controller.population.value == pytest.approx(0.3)
    core.controller.population.update(4, 4)
    learnt = core.controller.population.value
    mixed.reset_population(core, "policy")
    assert core.controller.population.value == learnt > 0.3
    assert mixed.mode_config(args, "policy-stuck").spec.probe_when_stale is True


def test_horizon_and_chunk_modes_reach_the_engine() -> None:
    """``policy-horizon``: the goodput policy spreads catch-ups within each request;
    ``policy-chunk512-1k``: chunk graphs of 512 and 1,024 tokens too; ``policy-fdec-beside``:
    the feed behind decode steps on a stream of its own."""
    from verifypd.lanes.async_engine import AsyncEngine

    mixed = load_bench("mixed")
    args = mixed.parse_args(["--device", "cpu", "--model", "dummy:tiny",
                             "--draft-model", "dummy:tiny"])  # fmt: skip
    horizon = AsyncEngine(mixed.mode_config(args, "policy-horizon")).core.controller
    policy = AsyncEngine(mixed.mode_config(args, "policy")).core.controller
    assert horizon.goodput.amortize_within_request is True
    assert policy.goodput.amortize_within_request is False
    chunks = mixed.mode_config(args, "policy-chunk512-1k").spec.catch_up_chunk
    assert chunks == (16, 64, 256, 512, 1024)
    assert mixed.mode_config(args, "policy-fdec-beside").spec.feeds_beside_decode
    assert not mixed.mode_config(args, "policy-fdec").spec.feeds_beside_decode


def test_fixed_l2_modes_draft_two_in_their_lane_mode() -> None:
    """``single-fixed-l2`` / ``three-fixed-l2``: the fixed controller at L = 2 (graphs for the
    sweep's L_max kept), otherwise the sweep's fixed modes."""
    from verifypd.lanes.async_engine import AsyncEngine

    mixed = load_bench("mixed")
    args = mixed.parse_args(["--device", "cpu", "--model", "dummy:tiny",
                             "--draft-model", "dummy:tiny"])  # fmt: skip
    for lane in ("single", "three"):
        cfg = mixed.mode_config(args, f"{lane}-fixed-l2")
        base = mixed.mode_config(args, f"{lane}-fixed")
        assert cfg.spec.initial_draft_len == 2 != base.spec.initial_draft_len
        assert cfg.replace(spec=base.spec) == base
        controller = AsyncEngine(cfg).core.controller
        controller.add_request(7, True, 0.0)
        assert controller.step() == {7: 2}


def test_head_modes_swap_only_the_drafter() -> None:
    """``policy-head``, ``three-fixed-head``, ``single-fixed-head``: their base modes with the
    drafter of an EAGLE-3 head's cost (``dummy:qwen2.5-7b-head``) for the run's 0.5B."""
    mixed = load_bench("mixed")
    args = mixed.parse_args(["--device", "cpu", "--model", "dummy:qwen2.5-7b",
                             "--draft-model", "dummy:qwen2.5-0.5b"])  # fmt: skip
    for base in ("policy", "three-fixed", "single-fixed"):
        cfg, plain = mixed.mode_config(args, f"{base}-head"), mixed.mode_config(args, base)
        assert (plain.spec.draft_model, cfg.spec.draft_model) == (
            "dummy:qwen2.5-0.5b",
            "dummy:qwen2.5-7b-head",
        )
        assert cfg.replace(spec=plain.spec) == plain
    light = mixed.mode_config(args, "policy-head-follow-light")
    yielding = mixed.mode_config(args, "policy-head-follow-light-yield")
    assert (light.spec.follow_prefill, light.spec.follow_prefill_max_rows) == (True, 4)
    assert not light.spec.yield_to_prefill and yielding.spec.yield_to_prefill
    assert yielding.replace(spec=light.spec) == light
    bounded = {"cap125": {"max_step_ratio": 1.25}, "cap14": {"max_step_ratio": 1.4},
               "tol10": {"tail_tolerance": 0.1}}  # fmt: skip
    for suffix, changed in bounded.items():
        cfg = mixed.mode_config(args, f"policy-head-yield-{suffix}")
        assert cfg.spec == dataclasses.replace(yielding.spec, **changed) != yielding.spec
        assert cfg.replace(spec=yielding.spec) == yielding
    # The 5 ms TPOT target: the fed head's policy with the target, its objective and fast learning.
    target = mixed.mode_config(args, "policy-head-tpot5-obj")
    assert target.spec == dataclasses.replace(
        light.spec, tpot_target_s=0.005, tpot_objective=True, request_prior_count=2.0,
        explore_alpha=0.8,
    )  # fmt: skip
    assert target.replace(spec=light.spec) == light
    # ... and each row held to its own request's need.
    deadlines = mixed.mode_config(args, "policy-head-tpot5-dl")
    assert deadlines.spec == dataclasses.replace(target.spec, tpot_deadlines=True)
    assert deadlines.replace(spec=target.spec) == target
    # ... or tokens a second weighed against the rows within.
    weighed = mixed.mode_config(args, "policy-head-tpot5-w1")
    assert weighed.spec == dataclasses.replace(target.spec, tpot_tokens_weight=1.0)
    # ... and no guard while the plain step meets the target.
    free = mixed.mode_config(args, "policy-head-tpot5-free")
    assert free.spec == dataclasses.replace(weighed.spec, tpot_unguarded=True)
    # Prompt ids: below what both read; the head reads all of the target's 152,064 ids.
    assert mixed.prompt_vocab(args) == 151936
    head = mixed.parse_args(["--device", "cpu", "--model", "dummy:qwen2.5-7b",
                             "--draft-model", "dummy:qwen2.5-7b-head"])  # fmt: skip
    assert mixed.prompt_vocab(head) == 152064


def test_a_mode_once_more_under_its_own_label() -> None:
    """``NAME~K`` runs ``NAME``'s configuration under a label of its own (a mode measured first
    and last in one run); a suffix that is not a number, or an unknown base, is refused."""
    import pytest

    mixed = load_bench("mixed")
    argv = ["--device", "cpu", "--model", "dummy:tiny", "--draft-model", "dummy:tiny"]
    args = mixed.parse_args([*argv, "--modes", "single-fixed,off,single-fixed~2"])
    assert args.modes == ["single-fixed", "off", "single-fixed~2"]
    again = mixed.mode_config(args, "single-fixed~2")
    assert again == mixed.mode_config(args, "single-fixed") != mixed.mode_config(args, "off")
    assert mixed.MODES["single-fixed~2"] is mixed.MODES["single-fixed"]
    for bad in ("single-fixed~x", "no-such-mode~2", "single-fixed~"):
        assert bad not in mixed.MODES
        with pytest.raises(SystemExit):
            mixed.parse_args([*argv, "--modes", bad])


def test_free_draft_mode_drafts_l_copies_of_the_last_token() -> None:
    """``policy-free-drafts``: prompt lookup under the goodput policy, its proposer replaced by
    L copies of the last token (``stand_in_drafts``); other modes keep their proposer, and a
    stand-in needs prompt lookup."""
    import dataclasses

    from verifypd.lanes.async_engine import AsyncEngine

    mixed = load_bench("mixed")
    args = mixed.parse_args(["--device", "cpu", "--model", "dummy:tiny",
                             "--draft-model", "dummy:tiny"])  # fmt: skip
    config = mixed.mode_config(args, "policy-free-drafts")
    assert config.spec.method == "ngram" and config.spec.policy == "goodput"
    core = AsyncEngine(config).core
    assert core.spec.ngram.propose(1, [5, 6, 7], 3) == []  # no earlier 7: a real lookup misses
    assert mixed.stand_in_drafts(core, "policy-free-drafts")["note"]
    assert core.spec.ngram.propose(1, [5, 6, 7], 3) == [7, 7, 7]
    assert mixed.stand_in_drafts(core, "policy") is None
    mixed.MODES["free-draft-model"] = dataclasses.replace(mixed.MODES["policy"],
                                                          stand_in_drafts=True)  # fmt: skip
    try:
        drafter = AsyncEngine(mixed.mode_config(args, "free-draft-model")).core
        with pytest.raises(ValueError, match="need SpecConfig.method 'ngram'"):
            mixed.stand_in_drafts(drafter, "free-draft-model")
    finally:
        del mixed.MODES["free-draft-model"]
