"""The mask worker of the asynchronous loop starts filling before the loop goes on with its own Python work."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from batchjob.engine.native.scheduling.plan import StepPlan
from batchjob.engine.native.scheduling.sequence import Status
from batchjob.engine.native.step_masks import StepMasks

# A limit only a hung worker reaches: the waits below are for events the worker makes (a sampler enqueued, a gate
# opened, a future set), which on a machine busy with other work may come many times later than on an idle one.
HUNG_S = 60.0


class SlowLibrary:
    """Stands in for llguidance: its call runs without the GIL (a sleep) after `entering`."""

    def __init__(self, fails: bool = False) -> None:
        self.fails = fails
        self.entered_at: float | None = None

    def fill_bitmasks(self, rows, bitmask, entering=None) -> None:
        if self.fails:
            raise RuntimeError("the library failed")
        self.entered_at = time.perf_counter()
        if entering is not None:
            entering()
        self.compute()
        bitmask[[k for _, k in rows]] = 7

    def compute(self) -> None:
        time.sleep(0.02)


class HeldLibrary(SlowLibrary):
    """SlowLibrary whose fill lasts until the test releases it, so that "not done yet" holds however late the
    test's thread runs."""

    def __init__(self) -> None:
        super().__init__()
        self.released = threading.Event()

    def compute(self) -> None:
        assert self.released.wait(HUNG_S), "the test never released the fill"
        self.released.clear()


def one_constrained_step():
    seq = SimpleNamespace(seq_id=0, matcher=object(), status=Status.RUNNING, pending=[(0, 3)], forced_until=0)
    one = np.ones(1, dtype=np.int64)
    plan = StepPlan(seqs=[seq], starts=one * 3, counts=one, samples=np.ones(1, dtype=bool), carry_rows=-one)
    bitmask = torch.zeros(1, 4, dtype=torch.int32)
    enqueued = []
    runner = SimpleNamespace(
        bitmask_rows=lambda step: bitmask, enqueue_masked_sampler=enqueued.append, arm_gate=lambda step: False
    )
    return SimpleNamespace(plan=plan, sampled=False), runner, bitmask, enqueued


def python_work(seconds: float) -> None:
    """Pure-Python work that holds the GIL, like the loop laying out the next step."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_the_fill_has_entered_the_library_before_start_returns() -> None:
    step, runner, bitmask, enqueued = one_constrained_step()
    library = SlowLibrary()
    masks = StepMasks(runner, library)
    for _ in range(3):  # the first step also starts the worker thread, which hands it the GIL anyway
        bitmask.zero_()
        masks.start(step)
        returned_at = time.perf_counter()
        python_work(0.03)  # without the hand-over the worker would wait out the switch interval here
        masks.finish()
        assert library.entered_at is not None and library.entered_at <= returned_at
        assert bitmask.eq(7).all()
    masks.close()
    assert enqueued == [step] * 3


def test_a_fill_that_fails_never_leaves_the_loop_waiting() -> None:
    step, runner, _, enqueued = one_constrained_step()
    masks = StepMasks(runner, SlowLibrary(fails=True))
    masks.start(step)  # returns: the worker signals even when the library raises
    with pytest.raises(RuntimeError, match="the library failed"):
        masks.finish()
    masks.close()
    assert enqueued == []


def test_poll_enqueues_the_sampler_from_the_loops_thread_once_the_fill_is_done() -> None:
    """The sampler goes to the GPU at the loop's first poll after the bitmask is filled, not when the loop next waits
    for it; a poll before then enqueues nothing, and `finish` then only waits."""
    step, runner, bitmask, enqueued = one_constrained_step()
    threads = []
    runner.enqueue_masked_sampler = lambda s: (enqueued.append(s), threads.append(threading.get_ident()))
    library = HeldLibrary()
    masks = StepMasks(runner, library)
    for _ in range(3):
        masks.start(step)
        masks.poll()  # the fill is held: not done yet
        assert enqueued == [] and masks.busy
        library.released.set()
        deadline = time.perf_counter() + HUNG_S
        while not enqueued and time.perf_counter() < deadline:
            python_work(0.001)  # the loop's work, polling between pieces of it
            masks.poll()
        assert len(enqueued) == 1 and bitmask.eq(7).all() and not masks.busy
        masks.finish()  # nothing left to wait for or enqueue
        assert len(enqueued) == 1
        enqueued.clear()
    assert set(threads) == {threading.get_ident()}
    masks.abandon()
    masks.close()


def test_the_switch_interval_is_cut_while_masks_fill_and_given_back() -> None:
    import sys

    before = sys.getswitchinterval()
    step, runner, _, _ = one_constrained_step()
    masks = StepMasks(runner, SlowLibrary())
    masks.start(step)
    assert sys.getswitchinterval() < before
    masks.finish()
    masks.abandon()  # the loop's end
    assert sys.getswitchinterval() == before
    masks.close()


class GatedRunner:
    """A runner whose masked samplers wait behind gates: records who armed, enqueued and opened each gate."""

    def __init__(self, bitmask: torch.Tensor) -> None:
        self.bitmask = bitmask
        self.events: list[tuple[str, int]] = []  # (what, thread)
        self.bitmask_at_open: torch.Tensor | None = None

    def bitmask_rows(self, step):
        return self.bitmask

    def arm_gate(self, step) -> bool:
        step.gate = object()
        self.events.append(("arm", threading.get_ident()))
        return True

    def enqueue_gated_sampler(self, step) -> None:
        self.events.append(("enqueue", threading.get_ident()))

    def open_gate(self, step) -> None:
        self.bitmask_at_open = self.bitmask.clone()
        self.events.append(("open", threading.get_ident()))

    def enqueue_masked_sampler(self, step) -> None:
        self.events.append(("sampled", threading.get_ident()))


@pytest.mark.parametrize("fails", [False, True])
def test_a_gated_sampler_is_enqueued_by_the_loop_and_its_gate_opened_by_the_worker(fails) -> None:
    """The gate is armed before the worker starts (so the worker's open can never miss it), the sampler enqueued
    by the loop's thread, and the gate opened by the worker once the bitmask is filled, even when the fill
    raised: the loop's thread, which may block on a closed gate, never has to open it."""
    step, _, bitmask, _ = one_constrained_step()
    runner = GatedRunner(bitmask)
    masks = StepMasks(runner, SlowLibrary(fails=fails))
    masks.start(step)
    assert masks.gated and masks.holds(step)
    deadline = time.perf_counter() + HUNG_S
    while len(runner.events) < 3 and time.perf_counter() < deadline:
        time.sleep(0.001)  # the loop, free to launch the next step meanwhile
    loop = threading.get_ident()
    assert [what for what, _ in runner.events][:1] == ["arm"]
    assert sorted(what for what, _ in runner.events) == ["arm", "enqueue", "open"]
    assert {what: thread == loop for what, thread in runner.events} == {"arm": True, "enqueue": True, "open": False}
    if fails:
        with pytest.raises(RuntimeError, match="the library failed"):
            masks.finish()
    else:
        assert runner.bitmask_at_open.eq(7).all()  # filled before the gate opened
        masks.finish()
        assert runner.events[-1][0] == "sampled" and not masks.gated
    masks.abandon()
    masks.close()


class AdvancingLibrary(SlowLibrary):
    """SlowLibrary that also advances matchers: records the order of its calls and the thread they ran in."""

    def __init__(self, fails: bool = False) -> None:
        super().__init__()
        self.advance_fails = fails
        self.calls: list[tuple[str, int]] = []

    def advance(self, pairs):
        self.calls.append(("advance", threading.get_ident()))
        if self.advance_fails:
            raise RuntimeError("the matcher failed")
        time.sleep(0.01)
        return [(True, token == 9, "") for _, token in pairs]

    def fill_bitmasks(self, rows, bitmask, entering=None) -> None:
        self.calls.append(("fill", threading.get_ident()))
        super().fill_bitmasks(rows, bitmask, entering)


def test_the_worker_advances_the_step_being_processed_then_fills_the_next_ones_masks() -> None:
    # The loop hands the processed step's (matcher, token) pairs over with the next step's rows and goes on with
    # its own work; the worker advances them first (their answer is the future the loop reads later), then fills.
    step, runner, bitmask, enqueued = one_constrained_step()
    library = AdvancingLibrary()
    masks = StepMasks(runner, library)
    advanced = masks.advance_and_start(step, [("m1", 5), ("m2", 9)])
    python_work(0.005)
    assert advanced.result(timeout=HUNG_S) == [(True, False, ""), (True, True, "")]
    masks.finish()
    assert bitmask.eq(7).all() and enqueued == [step]
    assert [name for name, _ in library.calls] == ["advance", "fill"]
    assert len({thread for _, thread in library.calls}) == 1 and library.calls[0][1] != threading.get_ident()
    assert masks.started_early == 1
    masks.close()


def test_a_failed_advance_reaches_the_loop_through_its_future_and_finish() -> None:
    step, runner, _, enqueued = one_constrained_step()
    masks = StepMasks(runner, AdvancingLibrary(fails=True))
    advanced = masks.advance_and_start(step, [("m1", 5)])
    with pytest.raises(RuntimeError, match="the matcher failed"):
        advanced.result(timeout=HUNG_S)
    with pytest.raises(RuntimeError, match="the matcher failed"):
        masks.finish()
    masks.close()
    assert enqueued == []
