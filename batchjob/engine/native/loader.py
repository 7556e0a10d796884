"""Model directory -> `ModelSpec` (config files only) and -> a `CausalLM` with its weights (safetensors only).

The module is built on the `meta` device and materialised directly on the target device in the target dtype,
then each checkpoint tensor is streamed from `safe_open` into its parameter (or its slice of a fused q/k/v or
gate/up parameter, or its expert's entry of the stacked expert weights): an 8B model never exists as a full
float32 copy on the host. `load_format="dummy"` reads no weights at all: seeded random ones are made on the
device (`dummy_weights.py`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from batchjob.engine.native import parallel
from batchjob.engine.native.attention import PagedAttentionBackend
from batchjob.engine.native.dummy_weights import fill_dummy_weights
from batchjob.engine.native.models import CausalLM
from batchjob.engine.native.models.registry import (
    ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    spec_from_config_files,
)
from batchjob.engine.native.models.spec import ModelSpec, UnsupportedModelError
from batchjob.engine.native.parallel import TensorParallel
from batchjob.engine.native.sharding import ParamShard, check_tensor_parallel, param_shard, rank_spec
from batchjob.engine.native.weight_stream import Piece, WeightReader, read_entries

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
_QKV = re.compile(r"(.*)\.self_attn\.([qkv])_proj\.(weight|bias)")
_GATE_UP = re.compile(r"(.*)\.mlp\.(gate|up)_proj\.(weight|bias)")
_EXPERT = re.compile(r"(.*)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")

log = logging.getLogger("batchjob.engine.native")


@dataclass(frozen=True)
class Slot:
    """Where a checkpoint tensor goes: parameter `name`, its `expert`-th entry (stacked experts), rows from
    `row` on (fused q/k/v or gate/up)."""

    name: str
    expert: int | None = None
    row: int | None = None


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


def checkpoint_slot(key: str, spec: ModelSpec) -> Slot | None:
    """Checkpoint tensor name -> its `Slot` in our model, or None for tensors we do not need. The family's
    renames come first (`Architecture.checkpoint_renames`), then the fused and stacked slots every family
    shares."""
    name = key.removeprefix("model.")
    if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and spec.tie_word_embeddings):
        return None
    for pattern, replacement in ARCHITECTURES[spec.architecture].checkpoint_renames:
        name = re.sub(pattern, replacement, name)
    q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    if match := _QKV.fullmatch(name):
        prefix, which, kind = match.groups()
        return Slot(f"{prefix}.self_attn.qkv_proj.{kind}", row={"q": 0, "k": q_size, "v": q_size + kv_size}[which])
    if match := _EXPERT.fullmatch(name):
        prefix, expert, which = match.groups()
        if which == "down":
            return Slot(f"{prefix}.mlp.experts.down_proj", expert=int(expert))
        row = 0 if which == "gate" else spec.moe.intermediate_size
        return Slot(f"{prefix}.mlp.experts.gate_up_proj", expert=int(expert), row=row)
    if match := _GATE_UP.fullmatch(name):
        prefix, which, kind = match.groups()
        return Slot(f"{prefix}.mlp.gate_up_proj.{kind}", row=0 if which == "gate" else spec.intermediate_size)
    return Slot(name)


def _materialise(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give every parameter and buffer of a meta-device module uninitialised storage on `device`, floating-point
    ones in `dtype`: what `Module.to(dtype)` and `Module.to_empty` do, without their per-tensor Python on the meta
    device (`to_empty`'s `empty_like` of a meta tensor imports torch's symbolic-shapes machinery and sympy)."""

    def empty(tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty(tensor.shape, dtype=dtype if tensor.is_floating_point() else tensor.dtype, device=device)

    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            module._parameters[name] = nn.Parameter(empty(param), requires_grad=param.requires_grad)
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = empty(buffer)


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
) -> tuple[CausalLM, ModelSpec]:
    """The model in eval mode, without gradients, on `device` in `dtype` (auto | float32 | bfloat16 |
    float16), with its spec. `load_format`: auto (the safetensors weights) or dummy (seeded random weights,
    no weight file read). Under tensor parallelism (`tp`, default: this process's place, `parallel.current()`)
    the model and the returned spec are this rank's shard, and only its slices are read."""
    tp = parallel.current() if tp is None else tp
    dummy = load_format == "dummy"
    model_dir = resolve_model_dir(model_path, with_weights=not dummy)
    spec = device_dtype(read_model_spec(model_dir, dtype, max_model_len), dtype, device)
    check_tensor_parallel(spec, tp.size)
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
    return model.eval().requires_grad_(False), local


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


def _expected_elements(param: torch.Tensor, shard: ParamShard | None) -> int:
    if shard is None or shard.first_rank_only:
        return param.numel()
    return param.numel() // param.shape[shard.dim] * shard.covered()


@torch.no_grad()
def load_checkpoint(
    model: CausalLM, spec: ModelSpec, model_dir: Path, shards: dict[str, ParamShard | None], tp: TensorParallel
) -> None:
    """Copy the checkpoint into `model` (this rank's shard of the model of `spec`). A single device reads whole
    files (`weight_stream`); a tensor-parallel rank reads only its slices, through safetensors."""
    files = safetensors_files(model_dir)
    params = dict(model.named_parameters())
    for name, shard in shards.items():
        if shard is not None and shard.covered() < params[name].shape[shard.dim]:
            params[name].zero_()  # vocabulary padding rows; a bias that another rank adds
    loaded = dict.fromkeys(params, 0)
    device = next(iter(params.values())).device
    with WeightReader(device) as reader:
        for file in files:
            entries = None if tp.active else read_entries(file)
            if entries is None:
                _load_slices(file, spec, params, shards, tp, loaded)
                continue
            targets = {}
            for entry in entries:
                found = _target(file, entry.name, entry.shape, spec, params)
                if found is not None:
                    name, target = found
                    _check_shape(file, entry.name, entry.shape, tuple(target.shape))
                    targets[entry.name] = target
                    loaded[name] += target.numel()

            def put(piece: Piece, rows: torch.Tensor, targets=targets) -> None:
                target = targets.get(piece.entry.name)
                if target is not None:
                    target.narrow(0, piece.row, piece.rows).copy_(rows, non_blocking=True)

            reader.read(file, [e for e in entries if e.name in targets], put)
    missing = [name for name, param in params.items() if loaded[name] != _expected_elements(param, shards[name])]
    if missing:
        raise UnsupportedModelError(f"{model_dir}: weights missing or incomplete for {', '.join(missing)}")


def _target(
    file: Path, key: str, shape: tuple[int, ...], spec: ModelSpec, params: dict[str, torch.Tensor]
) -> tuple[str, torch.Tensor] | None:
    """The parameter that checkpoint tensor `key` (of `shape`) goes into and the part of it: the whole parameter,
    its expert's entry, or its rows of a fused one; None for a tensor the model does not need."""
    slot = checkpoint_slot(key, spec)
    if slot is None:
        return None
    if slot.name not in params:
        raise UnsupportedModelError(f"{file}: unexpected tensor {key} for {spec.architecture}; use engine=hf")
    target = params[slot.name] if slot.expert is None else params[slot.name][slot.expert]
    if slot.row is not None:  # clipped to the parameter: a tensor too large then fails the shape check
        target = target.narrow(0, slot.row, min(shape[0] if shape else 0, target.shape[0] - slot.row))
    return slot.name, target


def _load_slices(
    file: Path,
    spec: ModelSpec,
    params: dict[str, torch.Tensor],
    shards: dict[str, ParamShard | None],
    tp: TensorParallel,
    loaded: dict[str, int],
) -> None:
    """`file` through safetensors, each tensor or only this rank's slices of it."""
    with safe_open(file, framework="pt", device="cpu") as checkpoint:
        for key in checkpoint.keys():  # noqa: SIM118 (safe_open is not a mapping)
            slot = checkpoint_slot(key, spec)
            if slot is None:
                continue
            name = slot.name
            if name not in params:
                raise UnsupportedModelError(f"{file}: unexpected tensor {key} for {spec.architecture}; use engine=hf")
            target = params[name] if slot.expert is None else params[name][slot.expert]
            shard = shards[name]
            if shard is None:
                tensor = checkpoint.get_tensor(key)
                if slot.row is not None:
                    target = target.narrow(0, slot.row, tensor.shape[0])
                _check_shape(file, key, tuple(tensor.shape), tuple(target.shape))
                target.copy_(tensor)
                loaded[name] += tensor.numel()
            elif shard.first_rank_only:
                if tp.rank == 0:
                    target.copy_(checkpoint.get_tensor(key))
                loaded[name] += target.numel()
            else:
                shard = shard.entry() if slot.expert is not None else shard
                source = checkpoint.get_slice(key)
                shape = tuple(source.get_shape())
                full = shard.full_shape(tuple(target.shape))
                expected = full[: shard.dim] + shape[shard.dim : shard.dim + 1] + full[shard.dim + 1 :]
                _check_shape(file, key, shape, expected)
                loaded[name] += shard.copy_(target, source, slot.row or 0, shape[shard.dim])


def _check_shape(file: Path, key: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if shape != expected:
        raise UnsupportedModelError(
            f"{file}: tensor {key} has shape {shape}, but config.json implies {expected}; the config and "
            "weights do not match"
        )
