"""Every architecture the native engine runs, by its Hugging Face name, and the spec of a model directory.

Adding a family: describe it in one small module (an `Architecture`: how its config adjusts the common spec,
how its checkpoint names differ) and list it here; docs/engine.md walks through it.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from batchjob.engine.config_files import read_json_file
from batchjob.engine.native.models import spec_check
from batchjob.engine.native.models.config_json import native_config
from batchjob.engine.native.models.config_spec import common_spec
from batchjob.engine.native.models.gemma import GEMMA2, GEMMA3
from batchjob.engine.native.models.llama import LLAMA_FAMILY
from batchjob.engine.native.models.mixtral import MIXTRAL
from batchjob.engine.native.models.olmo2 import OLMO2
from batchjob.engine.native.models.phi3 import PHI3
from batchjob.engine.native.models.qwen3_moe import QWEN3_MOE
from batchjob.engine.native.models.smollm3 import SMOLLM3
from batchjob.engine.native.models.spec import (
    Architecture,
    ModelSpec,
    UnsupportedModelError,
    check_spec,
    requested_spec,
)
from batchjob.engine.native.models.spec_cache import load_spec, store_spec
from batchjob.engine.native.models.spec_key import spec_key
from batchjob.engine.transformers_import import from_transformers

ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch for arch in (*LLAMA_FAMILY, QWEN3_MOE, MIXTRAL, GEMMA2, GEMMA3, PHI3, SMOLLM3, OLMO2)
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def architecture_of(model_dir: Path) -> Architecture:
    """The description of the model's architecture, from config.json alone; `UnsupportedModelError` (naming
    the supported ones and engine=hf) when the native engine has none."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: is it a Hugging Face model directory?")
    name = (read_json_file(config_path).get("architectures") or ["<none>"])[0]
    if name not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{model_dir}: architecture {name} is not supported by the native engine "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)}); run it with engine=hf"
        )
    return ARCHITECTURES[name]


def spec_from_config(
    config: Any,
    architecture: Architecture,
    model_dir: str,
    generation: dict[str, Any],
    dtype: str,
    max_model_len: int | None,
    quantization: str = "auto",
    kv_cache_dtype: str = "auto",
) -> ModelSpec:
    """The spec of a model from transformers' config object (the benchmark's roofline builds one in memory)."""
    spec = check_spec(architecture.adapt(config, common_spec(config, architecture.name, model_dir, generation)))
    return requested_spec(spec, dtype, max_model_len, quantization, kv_cache_dtype)


def spec_from_config_files(
    model_dir: Path,
    dtype: str = "auto",
    max_model_len: int | None = None,
    quantization: str = "auto",
    kv_cache_dtype: str = "auto",
) -> ModelSpec:
    """The spec of the model in `model_dir` for a job's `dtype`, `max_model_len` and `quantization`: kept from an
    earlier read of the same config files (spec_cache.py), else read through transformers' config class and kept."""
    architecture = architecture_of(model_dir)
    key = spec_key(model_dir)
    spec = load_spec(key, model_dir)
    if spec is None and spec_check.enabled():
        spec = _native_spec(key, model_dir, architecture)
    if spec is None:
        spec = _read_config(model_dir, architecture)
        store_spec(key, spec)
    return requested_spec(spec, dtype, max_model_len, quantization, kv_cache_dtype)


def _native_spec(key: str, model_dir: Path, architecture: Architecture) -> ModelSpec | None:
    """The spec from config.json without transformers (`config_json.py`), its check against transformers' reading
    begun beside (`spec_check.py`); None where the native reading cannot tell or refuses the model (transformers'
    reading then decides)."""
    try:
        config = native_config(model_dir, architecture.name)
        if config is None:
            return None
        spec = spec_from_config(config, architecture, str(model_dir), _generation(model_dir), "auto", None)
    except Exception:  # a refusal, or a value of a type it does not expect: transformers' reading says which
        return None
    spec_check.begin(key, model_dir, spec, transformers_spec)
    return spec


def transformers_spec(model_dir: Path, fields: dict[str, Any] | None = None) -> ModelSpec:
    """The spec as transformers reads the config, kept in the spec cache: from `fields`, what the spec check's worker
    read of transformers' config object (`spec_check_worker.config_fields`), else read here."""
    architecture = architecture_of(model_dir)
    if fields is None:
        spec = _read_config(model_dir, architecture)
    else:
        config = config_namespace(fields)
        spec = spec_from_config(config, architecture, str(model_dir), _generation(model_dir), "auto", None)
    store_spec(spec_key(model_dir), spec)
    return spec


def config_namespace(fields: dict[str, Any]) -> SimpleNamespace:
    """An object whose attributes are `fields` (`spec_check_worker.config_fields`), nested configs' too."""
    from batchjob.engine.native.models.spec_check_worker import NESTED

    def value(v: Any) -> Any:
        return config_namespace(v[NESTED]) if isinstance(v, dict) and set(v) == {NESTED} else v

    return SimpleNamespace(**{name: value(v) for name, v in fields.items()})


def _generation(model_dir: Path) -> dict[str, Any]:
    generation_path = model_dir / "generation_config.json"
    return read_json_file(generation_path) if generation_path.is_file() else {}


def _read_config(model_dir: Path, architecture: Architecture) -> ModelSpec:
    try:
        config = from_transformers("AutoConfig").from_pretrained(model_dir)
    except (ValueError, KeyError, TypeError) as err:
        raise UnsupportedModelError(f"{model_dir}: transformers cannot read its config.json ({err})") from err
    return spec_from_config(config, architecture, str(model_dir), _generation(model_dir), "auto", None)
