"""Where batchjob keeps what later runs reuse: `$BATCHJOB_CACHE`, else `~/.cache/batchjob`.

- `tiny-<arch>/`: the tiny random models of `batchjob.tiny_model` (the default job's model);
- `bench/`: the benchmark scripts' random-weight models;
- `triton/`: the native engine's compiled Triton kernels. A first run on a fresh machine compiles them
  (seconds to a minute); later runs load them. On a cluster, point `BATCHJOB_CACHE` at storage every node
  sees, so a job's tasks compile once between them: Triton writes each kernel atomically (temporary file,
  then rename) under a key that includes the GPU architecture and the Triton version, so concurrent tasks
  and mixed GPU types share one directory safely.
- `model-specs/`: what the native engine read from each model's config files (`models/spec_cache.py`), so a
  later job on the same config need not import transformers' config classes; written the same way.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("BATCHJOB_CACHE") or Path.home() / ".cache" / "batchjob")


def use_kernel_cache() -> None:
    """Send Triton's compiled kernels to `cache_root()/triton`, unless the user chose `TRITON_CACHE_DIR`.
    Triton reads the variable each time it looks a kernel up, so this only has to run before the first
    compile; the native engine's package runs it on import."""
    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = str(cache_root() / "triton")
