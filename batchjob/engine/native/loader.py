"""Model directory -> `ModelSpec` (config files only) and -> a `CausalLM` with its weights (safetensors only).

The module is built on the `meta` device and materialised directly on the target device in the target dtype,
then each checkpoint tensor is streamed from `safe_open` into its parameter (or its slice of a fused q/k/v or
gate/up parameter): an 8B model never exists as a full float32 copy on the host.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from batchjob.engine.native.attention import PagedAttentionBackend
from batchjob.engine.native.models import CausalLM
from batchjob.engine.native.models.spec import (
    SUPPORTED_ARCHITECTURES,
    ModelSpec,
    UnsupportedModelError,
    spec_from_config_files,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ModelSpec",
    "UnsupportedModelError",
    "load_model",
    "read_model_spec",
    "resolve_model_dir",
]

CONFIG_PATTERNS = ["*.json", "*.jinja", "tokenizer*"]
_FUSED = re.compile(r"(.*)\.(?:self_attn\.([qkv])_proj|mlp\.(gate|up)_proj)\.(weight|bias)$")


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


def read_model_spec(model_path: str | Path, dtype: str = "auto", max_model_len: int | None = None) -> ModelSpec:
    """The model's spec from its config files; cheap (no weights are read). Raises `UnsupportedModelError`
    for architectures or features the native engine does not run (the message suggests engine=hf)."""
    model_dir = resolve_model_dir(model_path, with_weights=False)
    spec = spec_from_config_files(model_dir, dtype, max_model_len)
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.safetensors")):
        safetensors_files(model_dir)  # refuse pickle-only directories before any GPU work
    return spec


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    if any(model_dir.glob("pytorch_model*.bin")):
        raise UnsupportedModelError(
            f"{model_dir} holds only PyTorch pickle weights (pytorch_model*.bin); the native engine loads "
            "safetensors only, since unpickling can run arbitrary code. Convert it once with "
            "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(new_dir) and use new_dir"
        )
    raise FileNotFoundError(f"{model_dir} has neither model.safetensors nor model.safetensors.index.json")


def _param_slot(key: str, spec: ModelSpec) -> tuple[str, int | None] | None:
    """Checkpoint tensor name -> (our parameter name, row offset into the fused parameter or None), or None
    for tensors we do not need."""
    name = key.removeprefix("model.")
    if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and spec.tie_word_embeddings):
        return None
    match = _FUSED.fullmatch(name)
    if match is None:
        return name, None
    prefix, qkv, gate_up, kind = match.groups()
    if qkv is not None:
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        offset = {"q": 0, "k": q_size, "v": q_size + kv_size}[qkv]
        return f"{prefix}.self_attn.qkv_proj.{kind}", offset
    return f"{prefix}.mlp.gate_up_proj.{kind}", 0 if gate_up == "gate" else spec.intermediate_size


@contextmanager
def _no_random_init() -> Iterator[None]:
    """Modules built on the meta device skip `nn.init.normal_` (nn.Embedding's init). It computes nothing there,
    but on meta tensors it runs torch's Python reference op, whose first call imports torch._dynamo: seconds
    of start-up for nothing (the loader overwrites every parameter)."""
    normal = nn.init.normal_
    nn.init.normal_ = lambda tensor, *args, **kwargs: tensor
    try:
        yield
    finally:
        nn.init.normal_ = normal


def load_model(
    model_path: str | Path,
    dtype: str,
    device: str | torch.device,
    attn: PagedAttentionBackend,
    max_model_len: int | None = None,
) -> tuple[CausalLM, ModelSpec]:
    """The model in eval mode, without gradients, on `device` in `dtype` (auto | float32 | bfloat16 |
    float16), with its spec."""
    model_dir = resolve_model_dir(model_path, with_weights=True)
    spec = read_model_spec(model_dir, dtype, max_model_len)
    files = safetensors_files(model_dir)
    with torch.device("meta"), _no_random_init():
        model = CausalLM(spec, attn).to(spec.dtype)
    # `to_empty` would do this with torch.empty_like, which on meta tensors runs torch's Python reference op,
    # importing sympy and torch.fx on first use (seconds of start-up); every parameter here is contiguous.
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.rotary.reset_table()
    params = dict(model.named_parameters())
    loaded = dict.fromkeys(params, 0)
    with torch.no_grad():
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as shard:
                for key in shard.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    slot = _param_slot(key, spec)
                    if slot is None:
                        continue
                    name, offset = slot
                    if name not in params:
                        raise UnsupportedModelError(
                            f"{file}: unexpected tensor {key} for {spec.architecture}; use engine=hf"
                        )
                    tensor = shard.get_tensor(key)
                    target = params[name] if offset is None else params[name].narrow(0, offset, tensor.shape[0])
                    if target.shape != tensor.shape:
                        raise UnsupportedModelError(
                            f"{file}: tensor {key} has shape {tuple(tensor.shape)}, but config.json implies "
                            f"{tuple(target.shape)}; the config and weights do not match"
                        )
                    target.copy_(tensor)
                    loaded[name] += tensor.numel()
    missing = [name for name, param in params.items() if loaded[name] != param.numel()]
    if missing:
        raise UnsupportedModelError(f"{model_dir}: weights missing or incomplete for {', '.join(missing)}")
    return model.eval().requires_grad_(False), spec
