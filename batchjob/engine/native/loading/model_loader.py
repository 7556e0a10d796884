"""Model directory -> `ModelSpec` (config files only) and -> a `CausalLM` with its weights (safetensors only).

The module is built on the `meta` device and materialised directly on the target device in the target dtype,
then the checkpoint is copied into it tensor by tensor (`checkpoint.py`): an 8B model never exists as a full
float32 copy on the host. `load_format="dummy"` reads no weights at all: seeded random ones are made on the
device (`dummy_weights.py`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from batchjob.engine.api import EngineSetupError
from batchjob.engine.native.layers import batch_invariant, parallel
from batchjob.engine.native.layers.attention import PagedAttentionBackend
from batchjob.engine.native.layers.fp8_linear import Fp8Linear, LinearToQuantize
from batchjob.engine.native.layers.parallel import TensorParallel
from batchjob.engine.native.loading.checkpoint import load_checkpoint, safetensors_files
from batchjob.engine.native.loading.dummy_weights import fill_dummy_weights
from batchjob.engine.native.loading.sharding import check_tensor_parallel, param_shard, rank_spec
from batchjob.engine.native.models.decoder import CausalLM, quantize_at_source
from batchjob.engine.native.models.registry import SUPPORTED_ARCHITECTURES, spec_from_config_files
from batchjob.engine.native.models.spec import ModelSpec, UnsupportedModelError, check_batch_invariant
from batchjob.engine.weight_files import check_weight_files

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ModelSpec",
    "UnsupportedModelError",
    "device_dtype",
    "load_model",
    "read_model_spec",
    "resolve_model_dir",
]

# What a model directory fetched from the hub needs besides its weights: the configs, the chat template, and every
# file a tokenizer may be saved as (tokenizer.json; GPT-2 style vocab.json + merges.txt; WordPiece vocab.txt;
# SentencePiece models such as tokenizer.model or spiece.model; tiktoken files).
CONFIG_PATTERNS = ["*.json", "*.jinja", "tokenizer*", "merges.txt", "vocab.txt", "*.model", "*.tiktoken"]
log = logging.getLogger("batchjob.engine.native")


def resolve_model_dir(model_path: str | Path, with_weights: bool = True) -> Path:
    """A local model directory for `model_path`: the directory itself, or a Hugging Face hub id fetched
    into the hub cache (config and tokenizer files, plus safetensors weights if `with_weights`)."""
    path = Path(model_path).expanduser()
    if path.is_dir():
        return path
    text = str(model_path)
    if text.startswith(("/", ".", "~")) or text.count("/") != 1:
        raise FileNotFoundError(f"model directory {text} does not exist; pass a Hugging Face model directory")
    try:
        from huggingface_hub import snapshot_download

        patterns = CONFIG_PATTERNS + (["*.safetensors", "*.safetensors.index.json"] if with_weights else [])
        return Path(snapshot_download(text, allow_patterns=patterns))
    except Exception as err:  # any hub failure (offline, unknown repo, auth) means the same to the user
        raise FileNotFoundError(
            f"model {text!r} is not a local directory and could not be fetched from the Hugging Face hub "
            f"({type(err).__name__}: {err}); download it first and pass its directory as model.path"
        ) from err


def read_model_spec(
    model_path: str | Path,
    dtype: str = "auto",
    max_model_len: int | None = None,
    quantization: str = "auto",
    kv_cache_dtype: str = "auto",
) -> ModelSpec:
    """The model's spec from its config files; cheap (no weights are read). Raises `UnsupportedModelError`
    for architectures or features the native engine does not run (the message suggests engine=hf), and
    `BrokenWeightsError` for weight files that cannot load (missing shards, truncated copies)."""
    model_dir = resolve_model_dir(model_path, with_weights=False)
    spec = spec_from_config_files(model_dir, dtype, max_model_len, quantization, kv_cache_dtype)
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.safetensors")):
        safetensors_files(model_dir)  # refuse pickle-only directories before any GPU work
    check_weight_files(model_dir)  # missing shards, truncated copies: before any GPU work too
    return spec


def _materialise(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give every parameter and buffer of a meta-device module uninitialised storage on `device`, floating-point
    ones in `dtype`: what `Module.to(dtype)` and `Module.to_empty` do, without their per-tensor Python on the meta
    device (`to_empty`'s `empty_like` of a meta tensor imports torch's symbolic-shapes machinery and sympy)."""

    def empty(tensor: torch.Tensor, own_dtype: bool) -> torch.Tensor:
        keep = own_dtype or not tensor.is_floating_point()
        return torch.empty(tensor.shape, dtype=tensor.dtype if keep else dtype, device=device)

    for module in model.modules():
        # FP8 projections keep their parameters' dtypes (e4m3 weights, float32 scales; the bias is the model's)
        own = getattr(module, "keeps_dtypes", False)
        for name, param in module.named_parameters(recurse=False):
            module._parameters[name] = nn.Parameter(empty(param, own), requires_grad=param.requires_grad)
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = empty(buffer, own)


# The initialisers torch's layers call from `reset_parameters` (Linear: kaiming_uniform_ and uniform_; Embedding:
# normal_).
_INITIALISERS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "zeros_", "ones_")


@contextmanager
def _no_random_init() -> Iterator[None]:
    """Modules built on the meta device skip `nn.init`'s initialisers. They compute nothing there, but on meta
    tensors they run torch's Python reference ops (0.5 s for a 16-layer model's Linears; the first call imports
    torch._dynamo): start-up spent for nothing, since the loader overwrites every parameter."""
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS}
    for name in _INITIALISERS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, initialiser in saved.items():
            setattr(nn.init, name, initialiser)


def load_model(
    model_path: str | Path,
    dtype: str,
    device: str | torch.device,
    attn: PagedAttentionBackend,
    max_model_len: int | None = None,
    load_format: str = "auto",
    tp: TensorParallel | None = None,
    quantization: str = "auto",
    kv_cache_dtype: str = "auto",
    deterministic: bool = False,
) -> tuple[CausalLM, ModelSpec]:
    """The model in eval mode, without gradients, on `device` in `dtype` (auto | float32 | bfloat16 |
    float16), with its spec. `load_format`: auto (the safetensors weights) or dummy (seeded random weights,
    no weight file read). Under tensor parallelism (`tp`, default: this process's place, `parallel.current()`)
    the model and the returned spec are this rank's shard, and only its slices are read. `deterministic`: every
    projection computes a row alike whatever the batch (layers/batch_invariant.py)."""
    tp = parallel.current() if tp is None else tp
    dummy = load_format == "dummy"
    model_dir = resolve_model_dir(model_path, with_weights=not dummy)
    spec = read_model_spec(model_dir, dtype, max_model_len, quantization, kv_cache_dtype)
    spec = dataclasses.replace(device_dtype(spec, dtype, device), batch_invariant=deterministic)
    if deterministic:
        check_batch_invariant(spec)
    check_tensor_parallel(spec, tp.size)
    _check_fp8_units(spec, torch.device(device))
    local = rank_spec(spec, tp)
    with torch.device("meta"), _no_random_init():
        model = CausalLM(local, attn, tp)
    _materialise(model, device, spec.dtype)
    model.reset_tables()
    shards = {name: param_shard(name, spec, tp) for name, _ in model.named_parameters()}
    if dummy:
        fill_dummy_weights(model, shards)
    else:
        load_checkpoint(model, spec, model_dir, shards, tp)
    if local.quantization is not None and local.quantization.source == "engine":
        quantize_loaded(model)
    if local.quantization is not None:
        quantize_at_source(model)
    if deterministic:
        batch_invariant.apply(model)
    return model.eval().requires_grad_(False), local


def _check_fp8_units(spec: ModelSpec, device: torch.device) -> None:
    """FP8 weights or an FP8 KV cache on a GPU need its FP8 units (compute capability 8.9: Ada, Hopper, later)."""
    if device.type != "cuda" or (spec.quantization is None and spec.kv_cache_dtype is None):
        return
    capability = torch.cuda.get_device_capability(device)
    if capability >= (8, 9):
        return
    raise EngineSetupError(
        f"{spec.model_dir} runs with FP8 {'weights' if spec.quantization else 'KV cache'}, which needs FP8 units "
        f"(compute capability 8.9 or newer); {torch.cuda.get_device_name(device)} has {capability[0]}."
        f"{capability[1]}. Use the model's bf16 checkpoint without engine.quantization=fp8 and "
        "engine.kv_cache_dtype=fp8_e4m3, or engine=hf"
    )


@torch.no_grad()
def quantize_loaded(model: nn.Module) -> None:
    """`engine.quantization=fp8`: each projection loaded in the model's dtype for quantizing becomes an
    `Fp8Linear`, one at a time, so the device holds at most one projection in both forms beside the model."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LinearToQuantize):
                setattr(parent, name, Fp8Linear.from_linear(child))
                del child


def device_dtype(spec: ModelSpec, dtype: str, device: str | torch.device) -> ModelSpec:
    """`engine.dtype=auto` on a GPU runs a checkpoint that declares float32 (or no dtype) in bfloat16, as the hf
    backend does: float32 matmuls run at a small fraction of bfloat16's rate there and the weights take twice the
    memory (an 8B model's job would take ten times as long). On CPU, and with an explicit dtype, `spec` stays."""
    if dtype != "auto" or spec.dtype != torch.float32 or torch.device(device).type != "cuda":
        return spec
    log.info(
        "engine.dtype=auto: %s declares float32 or no dtype; running it in bfloat16 on the GPU "
        "(engine.dtype=float32 keeps float32)",
        spec.model_dir,
    )
    return dataclasses.replace(spec, dtype=torch.bfloat16)
