"""A model directory's JSON files (config.json, generation_config.json, the tokenizer's), read and checked before
anything loads: a download that stopped early or a hand edit that broke one fails the job's checks naming the file
and what is wrong with it, instead of a JSON parser's position deep inside transformers. Nothing here needs torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Read by the engines, by transformers' config and tokenizer classes, or by the weight loader (a sharded model's
# index); each is optional except config.json, whose absence resolve_model_path reports.
MODEL_JSON_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "model.safetensors.index.json",
)
_FIX = "fix the file or download it again"
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true or false"}


class BrokenConfigFileError(ValueError):
    """A model's JSON file that cannot be read as a JSON object of settings: a file to fix or download again."""


def read_json_file(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; `BrokenConfigFileError` naming the file and what is wrong with it."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise BrokenConfigFileError(f"{path} is not UTF-8 text (byte {err.start:,} is not): {_FIX}") from None
    except OSError as err:
        raise BrokenConfigFileError(f"{path} cannot be read ({err.strerror or err}): make it readable") from None
    if not text.strip():
        raise BrokenConfigFileError(f"{path} is empty: {_FIX}")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise BrokenConfigFileError(
            f"{path} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}): {_FIX}"
        ) from None
    if not isinstance(value, dict):
        kind = _JSON_KINDS.get(type(value), "null")
        raise BrokenConfigFileError(f"{path} holds {kind}, not a JSON object of settings: {_FIX}")
    return value


def check_model_json_files(model_dir: Path) -> None:
    """Read every one of `MODEL_JSON_FILES` that `model_dir` holds; the first broken one raises."""
    for name in MODEL_JSON_FILES:
        path = model_dir / name
        if path.is_file():
            read_json_file(path)
