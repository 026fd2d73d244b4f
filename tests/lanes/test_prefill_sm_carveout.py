"""``EngineConfig.prefill_sm_carveout``: while decode rows run, a prompt lane's launch (the
prefill and follow streams) enqueues its GEMMs with cuBLASLt's SM count target lowered, so the
decode and verify streams keep SMs the prompt's GEMMs do not take. The settings are
process-wide: they must hold for every piece of a prompt step and nothing else, and be
restored after. Torch's setters are replaced by a recorder here (on CPU they would only flip
globals no kernel reads); ``test_gpu_prefill_sm_carveout.py`` runs the real ones."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from verifypd.config import EngineConfig, env_overrides
from verifypd.engine.scheduler import Scheduler
from verifypd.lanes import executor as ex
from verifypd.types import SeqStatus


@pytest.fixture
def blas(monkeypatch: pytest.MonkeyPatch) -> dict:
    """The process-wide settings, as torch would hold them, and every change made to them."""
    state = {"library": "cublas", "carveout": None, "changes": []}

    def library(backend=None):
        if backend is not None:
            state["library"] = backend
            state["changes"].append(("library", backend))
        return state["library"]

    def set_carveout(sms):
        state["carveout"] = sms
        state["changes"].append(("carveout", sms))

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", library)
    monkeypatch.setattr(torch._C, "_set_sm_carveout_experimental", set_carveout, raising=False)
    monkeypatch.setattr(torch._C, "_get_sm_carveout_experimental",
                        lambda: state["carveout"], raising=False)  # fmt: skip
    return state


def test_the_carveout_holds_inside_and_is_restored(blas: dict) -> None:
    with ex.gemm_sm_carveout(16):
        assert (blas["library"], blas["carveout"]) == ("cublaslt", 16)
    assert (blas["library"], blas["carveout"]) == ("cublas", None)
    with pytest.raises(RuntimeError), ex.gemm_sm_carveout(8):
        raise RuntimeError("a launch failed")
    assert (blas["library"], blas["carveout"]) == ("cublas", None)  # restored on failure too
    blas["changes"].clear()
    with ex.gemm_sm_carveout(0):
        pass
    assert blas["changes"] == []  # 0: nothing touched


def _executor(monkeypatch: pytest.MonkeyPatch, carveout: int, statuses: list[SeqStatus], **config):
    """A running sequence per status, each in flight (a prompt step computes the prefilling
    ones: nothing waits behind it) and nothing queued."""
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(multi_processor_count=132))  # fmt: skip
    running = [SimpleNamespace(status=s, in_flight=1) for s in statuses]
    sched = SimpleNamespace(running=running, waiting=[])
    sched.prompts_waiting = lambda: Scheduler.prompts_waiting(sched)  # the scheduler's own rule
    core = SimpleNamespace(config=EngineConfig(prefill_sm_carveout=carveout, **config),
                           scheduler=sched, device="cuda")  # fmt: skip
    streams = ex.LaneStreams(torch.device("cpu"))  # no streams: the carve-out alone is tested
    return ex.StreamExecutor(core, policy=None, streams=streams), running


def _pieces(blas: dict, seen: list, n: int):
    for _ in range(n):
        seen.append((blas["library"], blas["carveout"]))
        yield
    return "done"


def test_each_piece_of_a_prompt_step_beside_decode_rows_is_carved(
    blas: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    executor, running = _executor(monkeypatch, 16, [SeqStatus.DECODING, SeqStatus.PREFILLING])
    seen: list = []

    async def main() -> None:
        assert await executor._in_pieces("prefill", _pieces(blas, seen, 3)) == "done"
        # between the pieces (the event loop's turn) the settings are the process's own
        assert (blas["library"], blas["carveout"]) == ("cublas", None)
        await executor._in_pieces("follow", _pieces(blas, seen, 1))
        await executor._in_pieces("decode", _pieces(blas, seen, 1))
        await executor._in_pieces("verify", _pieces(blas, seen, 1))

    asyncio.run(main())
    carved = ("cublaslt", 16)
    assert seen == [carved] * 4 + [("cublas", None)] * 2
    assert executor.num_carved == 6  # 3 pieces + the call that ends them; 1 follow piece + its end
    blas["changes"].clear()
    running[0].status = SeqStatus.VERIFYING  # waiting for its verify: still a decode row
    with executor._context("prefill"):
        assert blas["carveout"] == 16


def test_a_prompt_step_with_nothing_decoding_has_every_sm(
    blas: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    executor, _ = _executor(monkeypatch, 16, [SeqStatus.PREFILLING, SeqStatus.WAITING])
    seen: list = []
    asyncio.run(executor._in_pieces("prefill", _pieces(blas, seen, 2)))
    assert seen == [("cublas", None)] * 2 and blas["changes"] == []
    assert executor.num_carved == 0
    off, _ = _executor(monkeypatch, 0, [SeqStatus.DECODING])  # the default: never
    with off._context("prefill"):
        assert blas["changes"] == []


@pytest.mark.parametrize("in_backlog", [False, True])
def test_a_prompt_step_with_prompts_waiting_behind_it_has_every_sm(
    blas: dict, monkeypatch: pytest.MonkeyPatch, in_backlog: bool
) -> None:
    """``prefill_sm_carveout_in_backlog`` False (the default): the carve-out is decided for
    each piece, and once a prompt waits behind the step (queued, or part-prefilled and not in
    flight) the pieces after take every SM; True: carved regardless, as before."""
    executor, running = _executor(monkeypatch, 16, [SeqStatus.DECODING, SeqStatus.PREFILLING],
                                  prefill_sm_carveout_in_backlog=in_backlog)  # fmt: skip
    waiting = executor.core.scheduler.waiting
    seen: list = []

    def pieces():
        for i in range(4):
            seen.append((blas["library"], blas["carveout"]))
            if i == 0:
                waiting.append(SimpleNamespace())  # a prompt arrives during the step
            if i == 1:
                waiting.clear()  # ... is admitted; its next chunk waits, not in flight
                running.append(SimpleNamespace(status=SeqStatus.PREFILLING, in_flight=0))
            if i == 2:
                running[-1].in_flight = 1  # ... and is in flight: no backlog
            yield

    asyncio.run(executor._in_pieces("prefill", pieces()))
    carved, whole = ("cublaslt", 16), ("cublas", None)
    assert seen == ([carved] * 4 if in_backlog else [carved, whole, whole, carved])


def test_the_setting_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _executor(monkeypatch, 127, [])[0].carveout == 127  # of 132: five left
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(multi_processor_count=100))  # fmt: skip
    core = SimpleNamespace(config=EngineConfig(prefill_sm_carveout=100), device="cuda",
                           scheduler=SimpleNamespace(running=[]))  # fmt: skip
    with pytest.raises(ValueError, match="no SMs of 100"):
        ex.StreamExecutor(core, None, ex.LaneStreams(torch.device("cpu")))
    monkeypatch.delattr(torch._C, "_set_sm_carveout_experimental")  # a torch without it
    with pytest.raises(ValueError, match="has no SM carve-out"):
        _executor(monkeypatch, 16, [])
    assert _executor(monkeypatch, 0, [])[0].carveout == 0  # off: not needed
    assert env_overrides({"VERIFYPD_PREFILL_SM_CARVEOUT": "16"}) == {"prefill_sm_carveout": 16}
    with pytest.raises(ValueError, match="VERIFYPD_PREFILL_SM_CARVEOUT"):
        env_overrides({"VERIFYPD_PREFILL_SM_CARVEOUT": "-4"})
