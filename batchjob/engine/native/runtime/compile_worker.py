"""A kernel compile worker (`python -m batchjob.engine.native.runtime.compile_worker TARGET`), started by
`compile_pool.CompilePool`: it compiles the variants it is handed, one a line on standard input, for TARGET (a
`GPUTarget`'s backend, arch and warp size, as JSON) into Triton's cache, and answers each with the cache entry's
hash. It never touches a GPU and never loads torch (`without_torch`): this module imports neither, so that a
worker is ready once Python and Triton are.

Protocol, one JSON object a line: the worker says `{"ready": true}` once imported, then answers each
`{"module", "qualname", "data"}` with `{"hash": ...}` or `{"error": ...}`.
"""

from __future__ import annotations

import json
import os
import sys
import types
from typing import Any


class TargetOnlyDriver:
    """The part of a Triton driver that compiling asks for: the device to compile for, never a real one."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def use_target(backend: str, arch: int | str, warp_size: int) -> None:
    """Make Triton compile for this target in a process that has no such device (or none at all)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    driver.set_active(TargetOnlyDriver(GPUTarget(backend, arch, warp_size)))


def compile_variant(variant: dict[str, str]) -> str:
    """Compile one variant into the cache (or find it there), and its launcher where Triton builds one per kernel
    signature; returns the variant's cache hash."""
    import importlib

    owner: Any = importlib.import_module(variant["module"])
    for part in variant["qualname"].split("."):
        owner = getattr(owner, part)
    kernel = owner.preload(variant["data"])
    build_launcher(kernel)
    return str(kernel.hash)


def build_launcher(kernel: Any) -> bool:
    """Build `kernel`'s launcher into Triton's cache, where this Triton compiles one per kernel signature (a C
    module, compiled by the system's C compiler on the kernel's first launch: Triton 3.6 and earlier on NVIDIA
    GPUs; later versions launch every kernel through one module). A cold start-up's own launches otherwise compile
    them one after another, about 0.3 s each. Returns whether one was built (or found); one that cannot be built
    here is left to the launch, as before."""
    from triton.backends.nvidia import driver as nvidia

    if getattr(kernel.metadata, "target", None) is not None and kernel.metadata.target.backend != "cuda":
        return False
    if not hasattr(nvidia, "make_launcher"):
        return False
    try:
        nvidia.CudaLauncher(kernel.src, kernel.metadata)
    except Exception as exc:
        print(f"launcher for {kernel.hash} not built: {type(exc).__name__}: {exc}", file=sys.stderr)
        return False
    return True


class _Unloaded:
    """A torch name in a compile worker: it may be named (a dtype in a module's constants, an annotation), not used."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Unloaded:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unloaded(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} called in a kernel compile worker, which does not load torch")


class _UnloadedTorch(types.ModuleType):
    def __getattr__(self, attr: str) -> _Unloaded:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unloaded(f"torch.{attr}")


def without_torch() -> None:
    """Let the kernel modules import here without loading torch. A worker compiles `@triton.jit` functions from
    Triton's records and runs none of their modules' host code, which is all that uses torch; importing torch was
    most of a worker's start (seconds on a node that compiles torch's bytecode afresh), during which it compiled
    nothing. A kernel whose body named a torch object would not compile here, or would get another cache key than
    the start-up's launch: that variant is then compiled by the launch, as without workers."""
    torch = _UnloadedTorch("torch")
    torch.__path__ = []  # a package, so that `from torch import x` resolves; its submodules are not there
    sys.modules["torch"] = torch


def main() -> None:
    # Answers go to the pipe the parent reads; anything else the worker prints goes to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    without_torch()
    import triton  # noqa: F401  (imported before the first request: the worker is ready once it is)

    use_target(*json.loads(sys.argv[1]))
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        try:
            answer: dict[str, Any] = {"hash": compile_variant(json.loads(line))}
        except Exception as exc:  # a variant this worker cannot compile: the start-up's launch will
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), file=answers, flush=True)


if __name__ == "__main__":
    main()
