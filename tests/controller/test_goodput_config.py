"""From configuration to the goodput policy: ``build_policy`` following ``SpecConfig``, the
policy's switches checked as bools, and the options that reach the policy and the dispatcher
through a CPU ``EngineCore`` (the round overhead only where decode-ahead runs, reading prompt
work, drafts beside decode)."""

import pytest

from verifypd.config import SpecConfig
from verifypd.controller import (
    BatchCostModel,
    DraftController,
    FixedController,
    GoodputConfig,
    GoodputPolicy,
    build_policy,
)


def test_build_policy_follows_spec_config():
    costs = BatchCostModel()
    assert type(build_policy(SpecConfig(), costs)) is GoodputPolicy
    assert type(build_policy(SpecConfig(policy="feedback"), costs)) is DraftController
    assert type(build_policy(SpecConfig(controller=False), costs)) is FixedController
    with pytest.raises(ValueError):
        SpecConfig(policy="oracle")


@pytest.mark.parametrize("name, default", [("probe_when_stale", True),
                                           ("amortize_within_request", False)])  # fmt: skip
def test_the_policys_switches_are_bools(name, default):
    assert getattr(GoodputConfig(), name) is default
    assert getattr(SpecConfig(), name) is default
    with pytest.raises(ValueError, match=name):
        GoodputConfig(**{name: 1})
    with pytest.raises(ValueError, match=name):
        SpecConfig(**{name: "no"})


def test_the_round_overhead_reaches_the_policy_only_where_decode_ahead_runs():
    from verifypd.config import EngineConfig
    from verifypd.engine.core import EngineCore
    from verifypd.lanes.spec_policy import goodput_config

    spec = SpecConfig(method="ngram", round_overhead_s=1e-3)
    core = EngineCore(EngineConfig(model="dummy:tiny", device="cpu", spec=spec))
    assert goodput_config(core).round_overhead_s == 0.0  # CPU: no decode-ahead by default
    core = EngineCore(EngineConfig(model="dummy:tiny", device="cpu", spec=spec, decode_ahead=True))
    assert goodput_config(core).round_overhead_s == 1e-3


@pytest.mark.parametrize(
    ("options", "reads"),
    [({}, False), ({"yield_to_prefill": True}, True), ({"catch_up_yields_to_prefill": True}, True)],
)
def test_the_engine_reads_prompt_work_for_a_policy_that_yields_to_it(options, reads):
    from verifypd.config import EngineConfig
    from verifypd.engine.core import EngineCore
    from verifypd.lanes.spec_policy import SpeculationPolicy

    spec = SpecConfig(method="ngram", catch_up_round_tokens=512, catch_up_every_steps=3,
                      waiting_rider_max_steps=5, **options)  # fmt: skip
    core = EngineCore(EngineConfig(model="dummy:tiny", device="cpu", spec=spec))
    policy = SpeculationPolicy(core)
    assert policy.reads_prompt_work is reads
    g = policy.controller.goodput
    assert g.catch_up_round_tokens == 512 and g.catch_up_every_steps == 3
    assert g.waiting_rider_max_steps == 5
    assert g.catch_up_yields_to_prefill is options.get("catch_up_yields_to_prefill", False)


@pytest.mark.parametrize("beside", [False, True])
def test_drafts_beside_decode_reaches_the_dispatcher_and_the_policy(beside):
    from verifypd.config import EngineConfig
    from verifypd.engine.core import EngineCore
    from verifypd.lanes.spec_policy import SpeculationPolicy

    spec = SpecConfig(method="ngram", drafts_beside_decode=beside)
    core = EngineCore(EngineConfig(model="dummy:tiny", device="cpu", spec=spec))
    policy = SpeculationPolicy(core)
    assert policy.drafts_beside_decode is beside
    assert policy.controller.goodput.drafts_beside_decode is beside
