"""The speculation policy hears what the engine reports (``SpecListener``): every admitted
sequence (those admitted before it attached as well), every finished or aborted one, and each
verify's acceptance, which its controller then holds."""

from __future__ import annotations

from helpers import tiny_config, tiny_draft_spec

from verifypd.engine.core import EngineCore
from verifypd.lanes.spec_policy import SpeculationPolicy
from verifypd.lanes.sync_driver import SyncDriver
from verifypd.types import SamplingParams, Sequence

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class RecordingPolicy(SpeculationPolicy):
    def __init__(self, core: EngineCore) -> None:
        self.events: list[tuple[str, int]] = []
        self.acceptance: list[tuple[int, int, int]] = []
        super().__init__(core)

    def request_added(self, seq: Sequence) -> None:
        self.events.append(("added", seq.seq_id))
        super().request_added(seq)

    def request_removed(self, seq: Sequence) -> None:
        self.events.append(("removed", seq.seq_id))
        super().request_removed(seq)

    def accepted(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        self.acceptance.append((seq.seq_id, num_drafted, num_accepted))
        super().accepted(seq, num_drafted, num_accepted)


def test_the_policy_hears_admits_finishes_aborts_and_acceptance() -> None:
    core = EngineCore(tiny_config(spec=tiny_draft_spec(initial_draft_len=3, max_draft_len=3)))
    (early,) = core.add_request("early", [1, 2, 3, 4], GREEDY)
    policy = RecordingPolicy(core)
    assert core.listener is policy and SpeculationPolicy.of(core) is policy
    assert policy.events == [("added", early.seq_id)]  # announced when the policy attached
    (late,) = core.add_request("late", [5, 6, 7], GREEDY)
    (gone,) = core.add_request("gone", [8, 9], GREEDY)
    assert len(policy.controller) == 3
    driver = SyncDriver(core)
    assert driver.policy is policy
    driver.step()
    core.abort_request("gone")
    assert ("removed", gone.seq_id) in policy.events and gone.seq_id not in policy.controller
    while core.has_unfinished():
        driver.step()
    removed = sorted(i for kind, i in policy.events if kind == "removed")
    assert removed == sorted([early.seq_id, late.seq_id, gone.seq_id])
    assert len(policy.controller) == 0
    # Every verify's acceptance reached the policy, as the engine counted it.
    assert policy.acceptance and {i for i, _, _ in policy.acceptance} == {
        early.seq_id,
        late.seq_id,
    }
    assert sum(d for _, d, _ in policy.acceptance) == core.spec.num_drafted
    assert sum(a for _, _, a in policy.acceptance) == core.spec.num_accepted
    assert core.controller is policy.controller
    core.check_integrity()


def test_with_speculation_off_the_policy_controls_nobody() -> None:
    core = EngineCore(tiny_config())
    assert core.controller is None  # no policy attached yet
    core.add_request("r", [1, 2, 3], GREEDY)
    driver = SyncDriver(core)  # attaches a policy, which hears of the live request
    assert len(driver.policy.controller) == 0  # speculation is off: nothing to control
    outs = []
    while core.has_unfinished():
        outs += driver.step()
    assert outs[-1].finished and outs[-1].num_output_tokens == 8
