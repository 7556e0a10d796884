"""The Triton kernel variants a start-up launches, as Triton's own records of them, and whether the kernel cache
holds their binaries.

Triton compiles a kernel the first time a process launches a new variant of it (argument dtypes, constexprs, the
specialisation of pointers and integers on alignment and on 1), one after another on the launching thread: most
of a cold start-up. Triton hands its compile hooks a record of each variant (`specialization_data`, JSON) from
which `JITFunction.preload` compiles the same binary under the same cache key in another process
(`compile_pool.py`). Two ways to collect the records:

- `skipping_launches()`: every launch of an engine kernel is recorded and not run (the `jit_cache_hook` answers
  that it handled it; the variants this process compiled before are hidden from Triton meanwhile, so each launch
  asks the hook), so running the start-up's steps under it lists every variant they need in a fraction of a
  second and compiles none. Its steps compute nothing meaningful: the tensors those launches should have written
  keep what they held, which is why `zeroed_allocations()` goes with it. No Triton kernel runs at all: one that
  did (a variant compiled by an earlier engine of the process) would read what a skipped one should have
  written, and an index read there can be out of range (an illegal memory access, which leaves the process's
  GPU unusable).
- `recording_compiles()`: every variant this process compiles or loads from the cache while it is active, with
  the hash of its cache entry: what a start-up needed, kept as the next start-up's plan (`precompile.py`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from triton import knobs
from triton.runtime.cache import get_cache_manager

log = logging.getLogger("batchjob.engine.native")
# The modules whose Triton kernels a listing pass hides (`_none_compiled`): the native engine's.
_ENGINE_PACKAGE = "batchjob.engine.native."


@dataclass(frozen=True)
class KernelVariant:
    """One compiled form of one `@triton.jit` function: where the function is defined, Triton's record of the
    variant, and (once compiled) the hash naming its cache entry."""

    module: str
    qualname: str
    data: str  # Triton's specialization_data (JSON)
    cache_hash: str = ""

    @property
    def key(self) -> tuple[str, str, str]:
        return self.module, self.qualname, self.data

    def to_json(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> KernelVariant:
        return cls(str(entry["module"]), str(entry["qualname"]), str(entry["data"]), str(entry.get("cache_hash", "")))


def _variant(fn: Any, compile: dict[str, Any], cache_hash: str = "") -> KernelVariant:
    return KernelVariant(fn.module, fn.name, compile["specialization_data"], cache_hash)


@contextmanager
def _hook(name: str, hook: Any) -> Iterator[None]:
    """`knobs.runtime.<name>` set to `hook` and then to what it was; a hook already there still runs first."""
    before = getattr(knobs.runtime, name)

    def chained(**kwargs: Any) -> Any:
        if before is not None and before(**kwargs):
            return True
        return hook(**kwargs)

    setattr(knobs.runtime, name, chained)
    try:
        yield
    finally:
        setattr(knobs.runtime, name, before)


@contextmanager
def _collecting(
    hook: str,
    variant_of: Callable[..., KernelVariant],
    handled: bool,
    on_new: Callable[[KernelVariant], None] | None = None,
) -> Iterator[list[KernelVariant]]:
    """Each variant Triton's `hook` is called for while active, once, in call order (the list fills on exit);
    the hook answers `handled` (True: the launch is not compiled nor run). `on_new` is called with each variant
    as it is first found."""
    found: dict[tuple[str, str, str], KernelVariant] = {}
    lock = threading.Lock()

    def record(**kwargs: Any) -> bool:
        try:
            variant = variant_of(**kwargs)
        except Exception:  # a hook that raised would fail the launch: this variant goes unrecorded instead
            log.debug("a Triton kernel variant could not be recorded", exc_info=True)
            return handled
        with lock:
            new = variant.key not in found
            if new:
                found[variant.key] = variant
        if new and on_new is not None:
            on_new(variant)
        return handled

    variants: list[KernelVariant] = []
    try:
        with _hook(hook, record):
            yield variants
    finally:
        variants.extend(found.values())


@contextmanager
def skipping_launches(on_new: Callable[[KernelVariant], None] | None = None) -> Iterator[list[KernelVariant]]:
    """Record the variants of the engine's kernels launched while active, and launch none of them, compiled earlier
    in the process or not. `on_new` gets each variant as it is found, so that compiling it can start before the
    listing ends."""

    def variant(*, fn: Any, compile: dict[str, Any], **_: Any) -> KernelVariant:
        return _variant(fn, compile)

    with _none_compiled(), _collecting("jit_cache_hook", variant, handled=True, on_new=on_new) as found:
        yield found


@contextmanager
def _none_compiled() -> Iterator[None]:
    """While active, Triton finds no compiled variant of the engine's kernels in this process: each launch looks
    its variant up afresh, through `jit_cache_hook`. The variants compiled before are back afterwards."""
    from triton.runtime.jit import JITFunction

    kernels = {
        id(value): value
        for name, module in list(sys.modules.items())
        if name.startswith(_ENGINE_PACKAGE) and module is not None
        for value in list(vars(module).values())
        if isinstance(value, JITFunction)
    }.values()
    saved = [(kernel, kernel.device_caches) for kernel in kernels]
    for kernel, _ in saved:
        kernel.device_caches = defaultdict(kernel.create_binder)
    try:
        yield
    finally:
        for kernel, caches in saved:
            kernel.device_caches = caches


def recording_compiles() -> AbstractContextManager[list[KernelVariant]]:
    """Record the variants compiled or loaded from the cache while active, with their cache hashes."""

    def variant(*, key: Any, fn: Any, compile: dict[str, Any], **_: Any) -> KernelVariant:
        kernel = fn.jit_function.device_caches[compile["device"]][0].get(key)
        return _variant(fn, compile, getattr(kernel, "hash", "") or "")

    return _collecting("jit_post_compile_hook", variant, handled=False)


def cached(variants: list[KernelVariant]) -> bool:
    """Whether Triton's cache holds a whole binary for every variant (each with a known hash): its entry's group
    file, which Triton writes last. A cache that is not a directory (a custom cache manager) answers no."""
    for variant in variants:
        if not variant.cache_hash:
            return False
        folder = getattr(get_cache_manager(variant.cache_hash), "cache_dir", None)  # made if missing
        try:
            if not folder or not any(name.startswith("__grp__") for name in os.listdir(folder)):
                return False
        except OSError:
            return False
    return True


@contextmanager
def zeroed_allocations() -> Iterator[None]:
    """While active, `torch.empty`, `torch.empty_like` and `Tensor.new_empty` called from Python give zeros. Under
    `skipping_launches` a kernel's output is never written, and a step goes on to use it: as an index (a token
    id gathered from the log-probabilities, an expert's rows), whatever bytes an empty tensor held would be out
    of range. Zeros are in range for every index and finite for every value, so the steps run through."""
    saved = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        return saved[0](*args, **kwargs).zero_()

    def empty_like(*args: Any, **kwargs: Any) -> torch.Tensor:
        return saved[1](*args, **kwargs).zero_()

    def new_empty(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return saved[2](self, *args, **kwargs).zero_()

    torch.empty, torch.empty_like, torch.Tensor.new_empty = empty, empty_like, new_empty
    try:
        yield
    finally:
        torch.empty, torch.empty_like, torch.Tensor.new_empty = saved
