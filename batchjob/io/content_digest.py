"""Content identities of input files, for the job record: what the bytes are, never where or when they were.

A copy of the input (cp without -p, rsync without -t, staging to scratch) must resume, so nothing here reads
mtimes, inodes or absolute paths. A Parquet file is identified by its size and its footer, which holds every
row group's row count, byte offsets, sizes and column statistics: any rewrite that moves a row changes it,
for one ranged read per file. Files without such a footer (Arrow stream files of `datasets`) are identified
by their size and a hash of evenly spaced windows (head and tail included), a bounded read whatever the size.
"""

from __future__ import annotations

import hashlib
import posixpath

import pyarrow as pa

_PARQUET_TAIL = 8  # footer length (4 bytes, little endian) + b"PAR1"
_WINDOWS = 8
_WINDOW_BYTES = 256 * 1024


def parquet_footer_sha256(f: pa.NativeFile) -> str:
    size = f.size()
    tail = f.read_at(_PARQUET_TAIL, size - _PARQUET_TAIL)
    footer_len = int.from_bytes(tail[:4], "little")
    return hashlib.sha256(f.read_at(footer_len, size - _PARQUET_TAIL - footer_len)).hexdigest()


def sampled_sha256(f: pa.NativeFile) -> str:
    size = f.size()
    digest = hashlib.sha256()
    if size <= _WINDOWS * _WINDOW_BYTES:
        digest.update(f.read_at(size, 0))
        return digest.hexdigest()
    step = (size - _WINDOW_BYTES) // (_WINDOWS - 1)
    for window in range(_WINDOWS):
        digest.update(f.read_at(_WINDOW_BYTES, window * step))
    return digest.hexdigest()


def relative_names(files: list[str]) -> list[str]:
    """Each file's path below the files' common directory (its base name when there is one file): the
    names fix the input order, and a staged copy of the same tree keeps them."""
    if len(files) == 1:
        return [posixpath.basename(files[0])]
    root = posixpath.commonpath([posixpath.dirname(f) for f in files])
    return [posixpath.relpath(f, root) if root else f for f in files]
