"""The job record: everything that changes the outputs, so a rerun never mixes two jobs' rows.

It holds the model (a hash of its config and tokenizer files; the weight files' names, sizes and sampled content:
a copy staged to node-local disk resumes, another checkpoint of the same shape in the same folder does not),
the engine name and dtype (backends differ numerically, so switching them mid-job would mix outputs;
throughput knobs such as batch sizes are left out, so a resume may retune them), sampling, prompt
settings, the output columns, the input's fingerprint, the rows the job owns and the batchjob version; and, never
compared, where the model was read (`provenance`). The IO layer adds the shard count and compares records on every
open.
"""

from __future__ import annotations

import dataclasses
import hashlib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchjob.config.settings import JobSettings
from batchjob.engine.config_files import BrokenConfigFileError, check_model_json_files
from batchjob.errors import ConfigError
from batchjob.io.content_digest import sampled_sha256

# Small files whose content decides what the model computes or how prompts are rendered.
HASHED_MODEL_FILES = ("*.json", "*.jinja", "tokenizer.model", "*.txt")
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.gguf")


def resolve_model_path(path: str | None) -> str:
    """A local model directory or a hub id; null means the embedded tiny model (created on first use)."""
    if path is None:
        from batchjob.job.tiny_model import DEFAULT_CACHE, default_tiny_model

        try:
            return str(default_tiny_model())
        except OSError as err:
            raise ConfigError(
                f"the bundled model cannot be created in {DEFAULT_CACHE} ({err}): set BATCHJOB_CACHE to a folder "
                "this user may write, or give model.path"
            ) from None
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ConfigError(
                f"model.path={path} has no config.json: point it at a Hugging Face model directory "
                "(config.json, *.safetensors, tokenizer files)"
            )
        try:
            check_model_json_files(local)
        except BrokenConfigFileError as err:
            raise ConfigError(f"model.path={path}: {err}") from None
        return str(local.resolve())
    if local.is_file():
        parent = f" (its folder {local.parent} holds config.json)" if (local.parent / "config.json").is_file() else ""
        raise ConfigError(
            f"model.path={path} is a file{parent}: point it at a Hugging Face model directory (config.json, "
            "*.safetensors, tokenizer files); single-file formats such as GGUF are not read"
        )
    looks_like_hub_id = path.count("/") == 1 and not path.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise ConfigError(
            f"model.path={path} does not exist: use a Hugging Face model directory or a hub id like org/name"
        )
    return path


def model_fingerprint(model_path: str) -> dict[str, Any]:
    """What the model is, not where: a hub id, or a local directory's small files hashed and each weight file's
    name, size and a hash of evenly spaced windows of it (a bounded read: 2 MiB a file)."""
    local = Path(model_path)
    if not local.is_dir():
        return {"hub_id": model_path}
    digest = hashlib.sha256()
    for pattern in HASHED_MODEL_FILES:
        for file in sorted(local.glob(pattern)):
            if file.name.endswith(".index.json") or file.stat().st_size > 50_000_000:
                continue
            digest.update(file.name.encode() + b"\0" + file.read_bytes())
    weights = {}  # by name, so a changed file is named alone when a rerun is refused
    for file in sorted({f for pattern in WEIGHT_FILES for f in local.glob(pattern)}):
        with pa.OSFile(str(file)) as f:
            weights[file.name] = {"size": f.size(), "sampled_sha256": sampled_sha256(f)}
    return {"files_sha256": digest.hexdigest(), "weights": weights}


def batchjob_version() -> str:
    try:
        return version("batchjob")
    except PackageNotFoundError:
        return "unknown"


def _engine_record(options: dict[str, Any], name: str) -> dict[str, Any]:
    record = {"name": name, "dtype": options.get("dtype", "auto")}
    if name == "vllm":
        from batchjob.engine.vllm_options import vllm_version

        # Another vLLM is another engine: its kernels and scheduling give other outputs.
        record["vllm_version"] = vllm_version()
    # Random weights make other outputs than the checkpoint's: a dummy run never resumes a real one. Recorded
    # only when set, so the records of earlier jobs still match.
    if options.get("load_format", "auto") != "auto":
        record["load_format"] = options["load_format"]
    # FP8 weights quantized at load, or an FP8 KV cache, change every output: such a run never resumes another.
    for key in ("quantization", "kv_cache_dtype"):
        if options.get(key, "auto") != "auto":
            record[key] = options[key]
    # Jump-forward takes a constraint's forced tokens as the grammar tokenizes them, not as the model samples
    # them: other outputs, so a job run with it never resumes one run without (nor the other way round).
    if options.get("jump_forward"):
        record["jump_forward"] = True
    # Deterministic arithmetic gives other bits than the default: a run with it never resumes one without.
    if options.get("deterministic"):
        record["deterministic"] = True
    return record


def job_record(
    settings: JobSettings,
    model_path: str,
    input_fingerprint: dict[str, Any],
    passthrough: list[str],
    job_rows: int | None,
    string_ids: bool = False,
) -> dict[str, Any]:
    """`job_rows`: rows of all shards together after `data.limit` (None when unknown, streaming);
    `string_ids`: the id column holds strings, so row ids are input positions and the ids a column."""
    sampling = dataclasses.asdict(settings.sampling)
    if settings.data.json_schema_column is not None:
        # Per-row schemas change every output; recorded only when used, so older records still match.
        sampling["json_schema_column"] = settings.data.json_schema_column
    return {
        "batchjob_version": batchjob_version(),
        "model": model_fingerprint(model_path),
        "engine": _engine_record(settings.engine_options, settings.engine_name),
        "sampling": sampling,
        "prompt": dataclasses.asdict(settings.prompt),
        "output_columns": {
            "passthrough": passthrough,
            "token_ids": settings.output.token_ids,
        },
        "on_error": settings.on_error,
        "input": input_fingerprint,
        # What `python -m batchjob.status` checks the output against. Also guards resume: a new
        # data.limit moves the shard boundaries, and a new id column renames every row.
        "rows": {"count": job_rows, "id_column": settings.data.id_column, "string_ids": string_ids},
        # Kept for people (and the export's model name), never compared: a staged copy of the model resumes.
        "provenance": {"model_path": model_path},
    }
