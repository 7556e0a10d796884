"""Checkpoint tensors -> the model's parameters: which parameter (or slice of one) each safetensors tensor fills,
and the copy itself.

Checkpoint names map onto our parameters as `checkpoint_names.py` says; an FP8 checkpoint's scales are read by
`fp8_scales.py`. A single device reads whole files in large chunks (`weight_stream.py`); a tensor-parallel rank
reads only its slices of each tensor through `safe_open(...).get_slice`. Every shape is checked against the
config's before a byte is copied, and a parameter that no tensor filled completely is an error.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from batchjob.engine.native.layers.parallel import TensorParallel
from batchjob.engine.native.loading.checkpoint_names import Slot, checkpoint_slot
from batchjob.engine.native.loading.fp8_scales import load_scales
from batchjob.engine.native.loading.sharding import ParamShard
from batchjob.engine.native.loading.weight_stream import Piece, WeightReader, read_entries
from batchjob.engine.native.models.decoder import CausalLM
from batchjob.engine.native.models.spec import ModelSpec, UnsupportedModelError
from batchjob.engine.weight_files import safetensors_paths


def safetensors_files(model_dir: Path) -> list[Path]:
    files = safetensors_paths(model_dir)
    if files:
        return files
    if any(model_dir.glob("pytorch_model*.bin")):
        raise UnsupportedModelError(
            f"{model_dir} holds only PyTorch pickle weights (pytorch_model*.bin); the native engine loads "
            "safetensors only, since unpickling can run arbitrary code. Convert it once with "
            "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(new_dir) and use new_dir"
        )
    raise FileNotFoundError(f"{model_dir} has neither model.safetensors nor model.safetensors.index.json")


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
                    _check_fp8(file, entry.name, entry.dtype == torch.float8_e4m3fn, target)
                    targets[entry.name] = target
                    loaded[name] += target.numel()

            def put(piece: Piece, rows: torch.Tensor, targets=targets) -> None:
                targets[piece.entry.name].narrow(0, piece.row, piece.rows).copy_(rows, non_blocking=True)

            reader.read(file, [e for e in entries if e.name in targets], put)
    if spec.quantization is not None and spec.quantization.source != "engine":
        for name, count in load_scales(files, spec, params, shards).items():
            loaded[name] += count
    missing = [name for name, param in params.items() if loaded[name] != _expected_elements(param, shards[name])]
    if missing:
        raise UnsupportedModelError(f"{model_dir}: weights missing or incomplete for {', '.join(missing)}")


def _slot_target(
    file: Path, key: str, spec: ModelSpec, params: dict[str, torch.Tensor]
) -> tuple[Slot, torch.Tensor] | None:
    """Checkpoint tensor `key`'s slot and the parameter (or its expert's entry) it goes into; None for a tensor the
    model does not need."""
    slot = checkpoint_slot(key, spec)
    if slot is None:
        return None
    if slot.name not in params:
        raise UnsupportedModelError(f"{file}: unexpected tensor {key} for {spec.architecture}; use engine=hf")
    return slot, params[slot.name] if slot.expert is None else params[slot.name][slot.expert]


def _target(
    file: Path, key: str, shape: tuple[int, ...], spec: ModelSpec, params: dict[str, torch.Tensor]
) -> tuple[str, torch.Tensor] | None:
    """The parameter that checkpoint tensor `key` (of `shape`) goes into and the part of it: the whole parameter,
    its expert's entry, or its rows of a fused one; None for a tensor the model does not need."""
    found = _slot_target(file, key, spec, params)
    if found is None:
        return None
    slot, target = found
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
            found = _slot_target(file, key, spec, params)
            if found is None:
                continue
            slot, target = found
            name, shard = slot.name, shards[slot.name]
            _check_fp8(file, key, checkpoint.get_slice(key).get_dtype() == "F8_E4M3", target)
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


def _check_fp8(file: Path, key: str, fp8: bool, target: torch.Tensor) -> None:
    """An FP8 tensor goes into an FP8 parameter only (a plain copy would drop its scale), and the other way round."""
    if fp8 != (target.dtype == torch.float8_e4m3fn):
        declared = "does not quantize it" if fp8 else "quantizes it to FP8"
        raise UnsupportedModelError(
            f"{file}: tensor {key} is {'FP8' if fp8 else 'not FP8'}, but config.json's quantization_config "
            f"{declared}; the config and weights do not match"
        )


def _check_shape(file: Path, key: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if shape != expected:
        raise UnsupportedModelError(
            f"{file}: tensor {key} has shape {shape}, but config.json implies {expected}; the config and "
            "weights do not match"
        )
