"""Where batchjob keeps what later runs reuse: `$BATCHJOB_CACHE`, else `~/.cache/batchjob`.

- `tiny-<arch>/`: the tiny random models of `batchjob.job.tiny_model` (the default job's model);
- `bench/`: the benchmark scripts' random-weight models;
- `triton/`: the native engine's compiled Triton kernels. A first run on a fresh machine compiles them
  (seconds to a minute); later runs load them. On a cluster, point `BATCHJOB_CACHE` at storage every node
  sees, so a job's tasks compile once between them: Triton writes each kernel atomically (temporary file,
  then rename) under a key that includes the GPU architecture and the Triton version, so concurrent tasks
  and mixed GPU types share one directory safely.
- `kernel-plans/`: the Triton kernel variants each kind of start-up launched (model config, engine options, GPU,
  versions), with their entries in `triton/`: a later start-up of that kind has them compiled by worker
  processes beside its weight load, or skips that when every entry is there (`engine/native/runtime/precompile.py`).
- `model-specs/`: what the native engine read from each model's config files through transformers
  (`models/spec_cache.py`; a first start-up reads without transformers and has a process beside it fill this), and
  `tokenizer-classes/`: which tokenizer class transformers chose for each model (`transformers_import.py`), so
  a later job on the same files need not import transformers' config and auto classes. Small JSON entries,
  written as a whole (`store_entry`) and read again from the model's files when unreadable (`load_entry`).
- `package-distributions/`: which distribution provides each importable package, as transformers asks the
  standard library on import (listing every installed file), kept per state of `sys.path`
  (`transformers_import.py`).
- `pycache/`: compiled Python of an environment that cannot keep its own beside its sources (installed without
  bytecode where PYTHONDONTWRITEBYTECODE is set or the folders are read-only; `startup.keep_bytecode`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("batchjob")


def cache_root() -> Path:
    return Path(os.environ.get("BATCHJOB_CACHE") or Path.home() / ".cache" / "batchjob")


def use_kernel_cache() -> None:
    """Send Triton's compiled kernels to `cache_root()/triton`, unless the user chose `TRITON_CACHE_DIR`.
    Triton reads the variable each time it looks a kernel up, so this only has to run before the first
    compile; the native engine's package runs it on import."""
    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = str(cache_root() / "triton")


def use_vllm_cache() -> None:
    """Send vLLM's compiled graphs to `cache_root()/vllm` and its Triton kernels beside the native engine's, unless
    the user chose `VLLM_CACHE_ROOT` / `TRITON_CACHE_DIR`: one shared cache then warms every task of an array
    (`python -m batchjob.warmup engine=vllm ...`). vLLM reads them as it starts, in its engine process too."""
    use_kernel_cache()
    if not os.environ.get("VLLM_CACHE_ROOT"):
        os.environ["VLLM_CACHE_ROOT"] = str(cache_root() / "vllm")


def files_key(folder: Path, names: Sequence[str], *salt: str) -> str:
    """An entry's key: a digest of `salt` and of the content (or the absence) of each file `names` in `folder`."""
    digest = hashlib.sha256("".join(f"{part}\0" for part in salt).encode())
    for name in names:
        path = folder / name
        digest.update(name.encode() + (b"\1" + path.read_bytes() if path.is_file() else b"\0"))
    return digest.hexdigest()[:32]


def load_entry(kind: str, key: str) -> Any | None:
    """The JSON entry `key` of `cache_root()/kind`, or None when absent or unreadable."""
    path = cache_root() / kind / f"{key}.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        log.debug("cache entry %s unreadable (%s): ignored", path, err)
        return None


def store_entry(kind: str, key: str, value: Any) -> None:
    """Keep `value` as the JSON entry `key` of `cache_root()/kind`: whole or absent (written to a temporary file,
    then renamed), so concurrent tasks on shared storage never read half of one; skipped when the cache cannot
    be written."""
    folder = cache_root() / kind
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as tmp:
            json.dump(value, tmp)
        os.chmod(tmp.name, 0o644)  # readable by the other users of a shared cache, as Triton's entries are
        os.replace(tmp.name, folder / f"{key}.json")
    except OSError as err:
        log.debug("cache entry %s/%s not kept (%s)", folder, key, err)
