"""A model directory's safetensors files, checked from their headers before any weights are read: a copy that
stopped early, a shard that never arrived or a damaged header fails the job at its checks, with the file named,
instead of a traceback once the model loads. Both backends check the same way; nothing here needs torch."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from batchjob.engine.config_files import read_json_file

INDEX = "model.safetensors.index.json"


class BrokenWeightsError(ValueError):
    """A model directory whose weight files are incomplete or damaged: a copy to redo (not a model the native
    engine cannot run, which `engine=auto` answers with the hf backend)."""


def safetensors_paths(model_dir: Path) -> list[Path]:
    """The files the index names (present or not), else model.safetensors if present, else none."""
    index = model_dir / INDEX
    if index.is_file():
        return [model_dir / shard for shard in sorted(set(read_json_file(index)["weight_map"].values()))]
    single = model_dir / "model.safetensors"
    return [single] if single.is_file() else []


def check_local_weight_files(model_path: str) -> None:
    """`check_weight_files` where `model_path` is a local directory; a hub id is left to the backend that fetches
    it."""
    path = Path(model_path).expanduser()
    if path.is_dir():
        check_weight_files(path)


def check_weight_files(model_dir: Path) -> None:
    """Raise `BrokenWeightsError` for a shard that the index names but that is missing while others are there
    (with none there the directory holds configs only: a hub model whose weights come later, or dummy weights), a
    file shorter or longer than its header accounts for (an interrupted download or copy), or a header that does
    not parse. Reads each file's header only."""
    files = safetensors_paths(model_dir)
    if not any(file.is_file() for file in files):
        return
    missing = [file.name for file in files if not file.is_file()]
    if missing:
        raise BrokenWeightsError(
            f"{model_dir}: {len(missing)} of the {len(files)} weight files that {INDEX} names are missing "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); copy or download them again"
        )
    for file in files:
        _check_size(file)


def read_header(path: Path) -> tuple[int, dict]:
    """The byte offset where `path`'s data starts and its header (tensor name -> dtype, shape, `data_offsets`
    from that offset). Raises `ValueError` when there is no readable header."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than the 8 bytes of its header's length")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise ValueError(f"its header's length {length:,} is more than the file holds")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    return 8 + length, header


def _check_size(path: Path) -> None:
    try:
        start, header = read_header(path)
        end = max((info["data_offsets"][1] for key, info in header.items() if key != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError) as err:
        raise BrokenWeightsError(
            f"{path} is not a readable safetensors file ({err}); copy or download it again"
        ) from None
    size, expected = path.stat().st_size, start + end
    if size != expected:
        what = "truncated: an interrupted download or copy?" if size < expected else "bytes beyond its last tensor"
        raise BrokenWeightsError(
            f"{path} has {size:,} bytes where its header accounts for {expected:,} ({what}); copy or download it again"
        )
