"""Which `datasets` builder reads a plain file of prompts, and with what options, by the file's name."""

from __future__ import annotations

import os

# Files read through datasets' builder of their kind (`load_dataset(builder, data_files=file)`), by extension.
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "csv", ".txt": "text"}
# Compressions datasets opens by itself.
COMPRESSED = (".gz", ".bz2", ".xz", ".zst")


def _plain_name(path: str) -> str:
    name = path.lower()
    for suffix in COMPRESSED:
        name = name.removesuffix(suffix)
    return name


def file_builder(path: str) -> str | None:
    """The datasets builder that reads a JSON Lines, JSON, CSV, TSV or text file at `path` (compressed or not)."""
    return FILE_BUILDERS.get(os.path.splitext(_plain_name(path))[1])


def builder_options(path: str | None) -> dict[str, str]:
    """What the file's builder needs beyond its name: a tab for tab-separated files."""
    return {"sep": "\t"} if _plain_name(path or "").endswith(".tsv") else {}
