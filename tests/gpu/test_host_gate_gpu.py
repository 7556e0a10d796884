"""Host gates: GPU work enqueued behind a gate waits until a host thread opens it with a store into pinned memory,
and what that thread wrote to pinned memory before opening is what the GPU reads behind it.

Run on a machine with a CUDA GPU:  python -m pytest tests/gpu -q
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from batchjob.engine.native.runtime.host_gate import HostGates  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture
def gates() -> HostGates:
    gates = HostGates.create(2, torch.device("cuda"))
    assert gates is not None, "this CUDA driver has no stream memory operations (cuStreamWaitValue32_v2)"
    return gates


def _behind(gates: HostGates, stream: torch.cuda.Stream, index: int, out: torch.Tensor, value: float):
    with torch.cuda.stream(stream):
        gate = gates.arm(index)
        gates.wait(stream, gate)
        out.fill_(value)
        done = torch.cuda.Event()
        done.record(stream)
    return gate, done


def test_work_behind_a_gate_waits_until_another_thread_opens_it(gates):
    stream, out = torch.cuda.Stream(), torch.zeros(4, device="cuda")
    gate, done = _behind(gates, stream, 1, out, 7.0)
    time.sleep(0.2)
    assert not done.query() and gates.pending() == 1
    opener = threading.Thread(target=gates.open, args=(gate,))
    opener.start()
    opener.join()
    done.synchronize()
    assert out.tolist() == [7.0] * 4 and gates.pending() == 0


def test_opening_an_older_wait_never_releases_a_newer_one(gates):
    stream, out = torch.cuda.Stream(), torch.zeros(4, device="cuda")
    first, _ = _behind(gates, stream, 0, out, 1.0)
    second, done = _behind(gates, stream, 0, out, 2.0)
    gates.open(first)
    time.sleep(0.2)
    assert not done.query() and out.tolist() == [1.0] * 4
    gates.open(second)
    gates.open(first)  # late and twice: a no-op
    done.synchronize()
    assert out.tolist() == [2.0] * 4


def test_a_gate_opened_before_its_wait_is_enqueued_lets_the_work_through(gates):
    stream, out = torch.cuda.Stream(), torch.zeros(4, device="cuda")
    gate = gates.arm(0)
    gates.open(gate)
    with torch.cuda.stream(stream):
        gates.wait(stream, gate)
        out.fill_(5.0)
    stream.synchronize()
    assert out.tolist() == [5.0] * 4 and gates.pending() == 0


def test_open_all_drains_every_wait(gates):
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = [torch.zeros(4, device="cuda") for _ in streams]
    waits = [_behind(gates, s, i, o, 3.0) for i, (s, o) in enumerate(zip(streams, outs, strict=True))]
    assert gates.pending() == 2
    gates.open_all()
    for _, done in waits:
        done.synchronize()
    assert all(o.tolist() == [3.0] * 4 for o in outs) and gates.pending() == 0


def test_the_copy_behind_a_gate_reads_what_the_opening_thread_wrote_before_it(gates):
    words = 1 << 18  # a megabyte, as the bitmask rows of 64 sequences at a 128k vocabulary
    host = torch.zeros(words, dtype=torch.int32, pin_memory=True)
    device = torch.empty(words, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    for round_ in range(1, 101):
        with torch.cuda.stream(stream):
            gate = gates.arm(round_ % 2)
            gates.wait(stream, gate)
            device.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)

        def fill(value: int = round_, gate=gate) -> None:
            host.numpy()[:] = np.int32(value)
            gates.open(gate)

        writer = threading.Thread(target=fill)
        writer.start()
        writer.join()
        done.synchronize()
        assert int(device.min()) == int(device.max()) == round_, round_
