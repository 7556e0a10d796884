"""A spec read from config.json without transformers (`config_json.py`), checked against transformers' reading of
the same files in a process beside the start-up.

Within `checking()` (the engine's start-up), a model whose spec is not in the spec cache is read natively, and a
worker process (`spec_check_worker.py`, without torch) reads it through transformers and prints what transformers'
config object presents; from that the engine builds transformers' spec and keeps it in the cache (so later
start-ups read it from there). The worker is started before the engine's imports where it can be
(`begin_early`: this module imports no torch), and the native reading joins it. The engine takes the checks once
started and generates at once; `held_until_verified` hands on no completion before the worker has ended and its
reading equals the native one: a difference is a fault of the native reading, reported as a setup error that
names the fields (nothing having been handed on, so nothing committed); the next start-up then reads
transformers' spec from the cache. A config that transformers refuses but the native reading took (a value of the
wrong type, say) is refused there too, with transformers' reason: at the engine's first results rather than in the
job's checks before it. Outside `checking()`, and where the native reading cannot tell, the spec is read through
transformers as it always was.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from batchjob.caches import cache_root
from batchjob.engine.api import EngineSetupError
from batchjob.engine.native.models.spec_key import is_kept, spec_key

if TYPE_CHECKING:
    from batchjob.engine.native.models.spec import ModelSpec

T = TypeVar("T")
# How long the engine's first completions wait for a check before it stops producing more and waits for the check
# itself: a check (a process's imports of transformers) ends in seconds; one that hangs holds no more than this.
HOLD_S = 60.0
_native_reading: contextvars.ContextVar[bool] = contextvars.ContextVar("native_spec_reading", default=False)
# The checks this process started, by cache folder and key: a job's config checks start one, its engine verifies it.
_pending: dict[tuple[str, str], SpecCheck] = {}


class SpecCheckError(EngineSetupError):
    """The native reading of a config differs from transformers' (a fault of batchjob's, not of the model): a setup
    error, whose message says to run again (the spec cache then holds transformers' reading)."""


# Transformers' spec from what the worker printed, kept in the spec cache (`registry.transformers_spec`, handed over
# by the native reading: the registry imports this module).
SpecFromFields = Callable[[Path, dict[str, Any]], "ModelSpec"]


@dataclasses.dataclass
class SpecCheck:
    model_dir: Path
    native: ModelSpec | None  # None while begun early, before the native reading it checks (`begin_early`)
    process: subprocess.Popen
    theirs: SpecFromFields | None = None  # set with `native`
    began: float = dataclasses.field(default_factory=time.perf_counter)
    ended: float | None = None  # when the worker was first seen to have ended
    waited_s: float = 0.0  # how long the engine waited for it

    def done(self) -> bool:
        if self.ended is None and self.process.poll() is not None:
            self.ended = time.perf_counter()
        return self.ended is not None

    def result(self) -> None:
        """Wait for transformers' reading; raise `SpecCheckError` where it differs from the native one. A worker
        that could not read the config (transformers refuses it) is a difference too."""
        waiting = time.perf_counter()
        out, err = self.process.communicate()
        self.done()  # it has ended: when it was first seen to have
        self.waited_s += max(0.0, self.ended - waiting)
        if self.process.returncode != 0:
            raise SpecCheckError(
                f"transformers could not read {self.model_dir}/config.json, which batchjob read without it "
                f"({err.strip().splitlines()[-1] if err.strip() else f'exit {self.process.returncode}'})"
            )
        from batchjob.engine.native.models.spec import UnsupportedModelError

        try:  # transformers' spec, from what its config object presents, kept in the spec cache
            theirs = comparable(self.theirs(self.model_dir, json.loads(out.strip().splitlines()[-1])))
        except UnsupportedModelError as err:
            reason = f"transformers' reading of {self.model_dir}/config.json is not one batchjob runs natively"
            raise SpecCheckError(f"{reason} ({err})") from err
        ours = comparable(self.native)
        differ = sorted(key for key in set(theirs) | set(ours) if theirs.get(key) != ours.get(key))
        if differ:
            details = "; ".join(f"{key}: {ours.get(key)!r} against {theirs.get(key)!r}" for key in differ)
            raise SpecCheckError(
                f"batchjob read {self.model_dir}/config.json otherwise than transformers does ({details}). "
                "transformers' reading is now kept in the spec cache: run the command again to use it, and please "
                "report this with the config"
            )


def comparable(spec: ModelSpec) -> dict:
    """A spec as JSON, less where it was read from."""
    from batchjob.engine.native.models.spec_cache import spec_to_json

    fields = json.loads(json.dumps(spec_to_json(spec)))
    fields.pop("model_dir", None)
    return fields


# The devices whose start-ups read natively: a GPU's start-up (seconds of kernels, graphs and warm-up after the
# spec) hides the worker on a node's spare cores. A CPU engine's start-up is shorter than the worker's own imports.
NATIVE_READING_DEVICES = frozenset({"cuda"})


@contextmanager
def checking(device_type: str) -> Iterator[None]:
    """Inside, for a start-up on `device_type` (`NATIVE_READING_DEVICES`), specs missing from the cache are read
    natively and checked beside (`begin`); `verify` waits."""
    token = _native_reading.set(device_type in NATIVE_READING_DEVICES)
    try:
        yield
    finally:
        _native_reading.reset(token)


def enabled() -> bool:
    return _native_reading.get()


def begin(key: str, model_dir: Path, native: ModelSpec, theirs: SpecFromFields) -> None:
    """Check `native`, read from `model_dir`, against transformers' reading in a process beside (the one
    `begin_early` started for `key`, else a new one), whose output `theirs` turns into a spec."""
    pending = _pending.get(_slot(key))
    if pending is None:
        _pending[_slot(key)] = SpecCheck(model_dir, native, _worker(model_dir), theirs)
    elif pending.native is None:
        pending.native, pending.theirs = native, theirs


def begin_early(model_path: str, device: str) -> None:
    """Start transformers' reading of a local model directory whose spec the cache lacks before the engine's
    imports (torch's take seconds), for a start-up on `device` that may read natively: a GPU's, or `auto` on a
    node whose NVIDIA driver is loaded. `begin` then checks the native reading against it; one that no native
    reading took (the spec was read through transformers, or on a CPU after all) is stopped by `take`. A node whose
    GPUs are hidden (`CUDA_VISIBLE_DEVICES` empty) starts none for `auto`."""
    kind = device.split(":")[0]
    if kind not in NATIVE_READING_DEVICES and not (kind == "auto" and may_have_gpu()):
        return
    model_dir = Path(model_path).expanduser()
    if not (model_dir / "config.json").is_file():
        return  # a hub id, or no model: the engine's checks say which
    key = spec_key(model_dir)
    if _slot(key) not in _pending and not is_kept(key):
        _pending[_slot(key)] = SpecCheck(model_dir, None, _worker(model_dir))


# Where a loaded NVIDIA driver shows itself, told without torch.
NVIDIA_DRIVER = Path("/proc/driver/nvidia")


def may_have_gpu() -> bool:
    """Whether `device=auto` may choose a GPU here: an NVIDIA driver is loaded and CUDA_VISIBLE_DEVICES hides none."""
    return NVIDIA_DRIVER.is_dir() and os.environ.get("CUDA_VISIBLE_DEVICES") not in ("", "-1")


def _slot(key: str) -> tuple[str, str]:
    """A check's place in `_pending`: the spec cache it fills, and the config's key there."""
    return str(cache_root()), key


def _worker(model_dir: Path) -> subprocess.Popen:
    from batchjob.processes import dies_with_us

    command = [sys.executable, "-m", "batchjob.engine.native.models.spec_check_worker", str(model_dir)]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=dies_with_us(signal.SIGKILL)
    )


def take() -> list[SpecCheck]:
    """The checks this process began, now the caller's to `verify` (or `stop`); those begun early that no native
    reading took are stopped."""
    checks = list(_pending.values())
    _pending.clear()
    stop([check for check in checks if check.native is None])
    return [check for check in checks if check.native is not None]


def settled(checks: list[SpecCheck]) -> bool:
    """Whether every one of `checks` has ended, so that `verify` would not wait."""
    return all([check.done() for check in checks])  # each polled, so that each notes when it ended


def timings(checks: list[SpecCheck]) -> dict[str, float]:
    """`spec_check_s`: from the first check's start to the last one's end; `spec_check_wait_s`: how long the
    engine waited for them (completions held after the engine had no more, or `settle`). Empty while any runs."""
    if not checks or any(check.ended is None for check in checks):
        return {}
    return {
        "spec_check_s": max(check.ended for check in checks) - min(check.began for check in checks),
        "spec_check_wait_s": sum(check.waited_s for check in checks),
    }


def verify(checks: list[SpecCheck]) -> None:
    """Wait for `checks`; `SpecCheckError` on the first difference."""
    try:
        for check in checks:
            check.result()
    finally:
        stop(checks)


def held_until_verified(checks: list[SpecCheck], items: Iterator[T], hold_s: float = HOLD_S) -> Iterator[T]:
    """`items`, none handed on before `checks` have passed: the first ones wait, without stopping `items` from
    being produced, until the checks have ended (or `items` has, or `hold_s` has passed since the first one: then
    this waits for the checks, so that a check that hangs holds no more than that); `SpecCheckError` instead where
    one differs, and then nothing was handed on. Stopped early, the checks are stopped unverified."""
    held: list[T] = []
    first_at = None
    try:
        for item in items:
            held.append(item)
            first_at = first_at or time.monotonic()
            if settled(checks) or time.monotonic() - first_at > hold_s:
                break
        pending, checks = checks, []
        verify(pending)
        yield from held
        held.clear()
        yield from items
    finally:
        stop(checks)
        close = getattr(items, "close", None)
        if close is not None:
            close()


def discard() -> None:
    """Stop the checks this process began, unverified (a start-up that failed before taking them)."""
    stop(take())


def stop(checks: list[SpecCheck]) -> None:
    """End `checks` unverified."""
    for check in checks:
        if check.process.poll() is None:
            check.process.kill()
        check.process.communicate()
