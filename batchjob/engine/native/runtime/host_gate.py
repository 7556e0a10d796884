"""Stream waits that a host thread releases with a plain store: the GPU holds a stream until a word in pinned host
memory reaches a value (the CUDA driver's `cuStreamWaitValue32`), and any thread opens it by writing that value.

Structured outputs use it to enqueue a constrained step's masked sampler together with its forward: the sampler's
bitmask copy waits behind a gate that the thread filling the bitmask opens, so the GPU starts sampling, and then
the next step's forward, the moment the masks exist, with no CUDA call in between (split_steps.py).

A gate's value only grows (each wait asks for the next value of its word), so opening an older wait late, or
twice, never releases a newer one. The caller must open every wait it enqueues, on every path (`open_all` when a
run ends early): a stream held by an unopened gate never finishes, and a device synchronize would hang.

Loading a kernel's module synchronizes the device, so it waits for every closed gate: a thread that loads one
(a kernel's first launch) while a gate is closed blocks until another thread opens it. So a gate is only ever
armed where a thread other than the loop's will open it (the mask worker), and only after the warm-up has
launched every kernel the run can launch.

`HostGates.create` returns None where the driver has no stream memory operations (or off a GPU): callers then
enqueue the sampler once the masks are filled, as before.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass

import torch

log = logging.getLogger("batchjob.engine.native")

CU_STREAM_WAIT_VALUE_GEQ = 0x0


@dataclass(frozen=True)
class Gate:
    """One enqueued wait: word `index` of its `HostGates` must reach `value`."""

    index: int
    value: int


class HostGates:
    def __init__(self, driver: ctypes.CDLL, words: int) -> None:
        self._driver = driver
        # Pinned host memory is mapped into the device's address space; the driver gives its device address.
        self._words = torch.zeros(words, dtype=torch.int32, pin_memory=True)
        self._view = self._words.numpy()
        address = ctypes.c_uint64()
        self._check(
            driver.cuMemHostGetDevicePointer_v2(ctypes.byref(address), ctypes.c_void_p(self._words.data_ptr()), 0),
            "cuMemHostGetDevicePointer",
        )
        self._address = address.value
        self._armed = [0] * words  # the value each word's newest wait asks for
        self._lock = threading.Lock()  # opens come from worker threads and the loop's

    @classmethod
    def create(cls, words: int, device: torch.device) -> HostGates | None:
        if device.type != "cuda":
            return None
        try:
            driver = ctypes.CDLL("libcuda.so.1")
        except OSError as error:
            log.info("no CUDA driver library (%s): masked samplers enqueue once their masks are filled", error)
            return None
        # The V2 stream memory operations (CUDA 11.7 and later) need no driver option.
        if not hasattr(driver, "cuStreamWaitValue32_v2"):
            log.info("no stream memory operations in this CUDA driver: masked samplers enqueue once filled")
            return None
        # The pinned allocation is a runtime call: it makes the device's context current on this thread, which the
        # driver calls below need.
        with torch.cuda.device(device):
            try:
                return cls(driver, words)
            except (RuntimeError, AttributeError) as error:  # a driver call failed, or this driver lacks one
                log.info("host gates unavailable (%s): masked samplers enqueue once filled", error)
                return None

    def arm(self, index: int) -> Gate:
        """The next gate of word `index`, not enqueued yet: it may be opened before `wait` enqueues it (the work
        behind it then runs at once)."""
        with self._lock:
            self._armed[index] += 1
            return Gate(index, self._armed[index])

    def wait(self, stream: torch.cuda.Stream, gate: Gate) -> None:
        """Enqueue on `stream` a wait for `gate`: the work enqueued after it runs once the gate is opened."""
        self._check(
            self._driver.cuStreamWaitValue32_v2(
                ctypes.c_void_p(stream.cuda_stream),
                ctypes.c_uint64(self._address + 4 * gate.index),
                ctypes.c_uint32(gate.value),
                ctypes.c_uint(CU_STREAM_WAIT_VALUE_GEQ),
            ),
            "cuStreamWaitValue32",
        )

    def open(self, gate: Gate) -> None:
        """Release `gate` (and any older wait on its word). Safe from any thread; a plain store, no CUDA call.
        What the opening thread wrote to pinned memory before it (a bitmask) is there for the GPU work behind the
        gate: the GPU reads host memory coherently, and the store comes after those writes."""
        with self._lock:
            if self._view[gate.index] < gate.value:
                self._view[gate.index] = gate.value

    def open_all(self) -> None:
        """Release every wait enqueued so far (a run that ends early: its streams must drain)."""
        with self._lock:
            for index, value in enumerate(self._armed):
                self._view[index] = value

    def pending(self) -> int:
        """How many words have a wait not yet opened."""
        with self._lock:
            return sum(int(self._view[i]) < value for i, value in enumerate(self._armed))

    @staticmethod
    def _check(result: int, call: str) -> None:
        if result != 0:
            raise RuntimeError(f"{call} failed with CUDA driver error {result}")
