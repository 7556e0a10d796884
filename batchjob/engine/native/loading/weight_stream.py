"""Reading a safetensors file at the page cache's speed: its bytes in large chunks, by several threads at once,
into a reusable (on a GPU host, pinned) buffer, from which each tensor is copied to its parameter while the next
chunk is read.

`safe_open(...).get_tensor` maps the file, and each tensor is then copied to the GPU from that pageable mapping
(an 8B model's "weights" start-up phase, 15 GB, took 5.0-5.9 s that way). Here the file is read with `os.preadv` (no
interpreter lock held) by `READERS` threads into one of two buffers of `CHUNK_BYTES`, and a tensor's bytes are
copied from there to the device without waiting (pinned memory), so reading chunk k+1 overlaps copying chunk k. A
tensor larger than a chunk is split into blocks of whole rows.

The safetensors layout: 8 bytes of little-endian header length N, N bytes of JSON (each tensor's dtype, shape
and `data_offsets` [begin, end) from the end of the header), then the data.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from batchjob.engine.weight_files import read_header

CHUNK_BYTES = 256 << 20
READERS = 8

DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file; `begin`/`end` are byte offsets in the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Piece:
    """Rows [row, row + rows) of `entry` (all of it for a 0-d tensor), bytes [begin, end) of the file."""

    entry: Entry
    row: int
    rows: int
    begin: int
    end: int


def read_entries(path: Path) -> list[Entry] | None:
    """The file's tensors in file order, or None when one has a dtype this reader does not know (the caller
    reads that file through safetensors itself)."""
    start, header = read_header(path)
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            return None
        begin, end = info["data_offsets"]
        entries.append(Entry(name, DTYPES[info["dtype"]], tuple(info["shape"]), start + begin, start + end))
    return sorted(entries, key=lambda e: e.begin)


def pieces(entries: list[Entry], chunk_bytes: int) -> list[Piece]:
    """Each entry whole, or in blocks of whole rows of at most `chunk_bytes` (at least one row)."""
    out = []
    for entry in entries:
        size = entry.end - entry.begin
        if size <= chunk_bytes or len(entry.shape) == 0 or entry.shape[0] <= 1:
            out.append(Piece(entry, 0, entry.shape[0] if entry.shape else 1, entry.begin, entry.end))
            continue
        row_bytes = size // entry.shape[0]
        step = max(1, chunk_bytes // row_bytes)
        for row in range(0, entry.shape[0], step):
            rows = min(step, entry.shape[0] - row)
            begin = entry.begin + row * row_bytes
            out.append(Piece(entry, row, rows, begin, begin + rows * row_bytes))
    return out


def chunks(all_pieces: list[Piece], chunk_bytes: int) -> list[list[Piece]]:
    """Consecutive pieces grouped into spans of the file of at most `chunk_bytes` (or one larger piece)."""
    out: list[list[Piece]] = []
    for piece in all_pieces:
        if out and piece.end - out[-1][0].begin <= chunk_bytes:
            out[-1].append(piece)
        else:
            out.append([piece])
    return out


class _Buffer:
    """A host buffer of `size` bytes (pinned when copying to a GPU) and the event after the last copies out of
    it: it is refilled only once they are done."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.data = torch.empty(size, dtype=torch.uint8, pin_memory=self.cuda)
        self.view = memoryview(self.data.numpy())
        self.copied: torch.cuda.Event | None = None

    def wait(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None

    def mark(self) -> None:
        if self.cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()


class WeightReader:
    """Reads safetensors files for copies to `device` (see the module's docstring); a context manager, whose
    exit waits for the last copies out of its buffers."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.buffers: list[_Buffer] = []
        self.pool = ThreadPoolExecutor(READERS, thread_name_prefix="batchjob-weights")

    def __enter__(self) -> WeightReader:
        return self

    def __exit__(self, *exc) -> None:
        for buffer in self.buffers:
            buffer.wait()
        self.pool.shutdown()

    def read(self, path: Path, entries: list[Entry], put: Callable[[Piece, torch.Tensor], None]) -> None:
        """Call `put(piece, rows)` for every piece of `entries` (from `read_entries(path)`), `rows` a host tensor
        of the piece's rows, valid until `put` returns: copy it out (a copy to the GPU may be non-blocking; the
        buffer is refilled only after it)."""
        groups = chunks(pieces(entries, CHUNK_BYTES), CHUNK_BYTES)
        size = max((group[-1].end - group[0].begin for group in groups), default=0)
        if self.buffers and self.buffers[0].data.numel() < size:
            for buffer in self.buffers:
                buffer.wait()
            self.buffers = []
        if not self.buffers and groups:
            self.buffers = [_Buffer(size, self.device) for _ in range(2)]
        fd = os.open(path, os.O_RDONLY)
        try:
            for index, group in enumerate(groups):
                buffer = self.buffers[index % 2]
                buffer.wait()
                start = group[0].begin
                self._read(fd, buffer.view[: group[-1].end - start], start)
                for piece in group:
                    put(piece, _rows(buffer.data[piece.begin - start : piece.end - start], piece))
                buffer.mark()
        finally:
            os.close(fd)

    def _read(self, fd: int, view: memoryview, offset: int) -> None:
        """`len(view)` bytes of the file from `offset` into `view`, in `READERS` parts read side by side."""
        part = max(1 << 20, math.ceil(len(view) / READERS))

        def read(start: int) -> None:
            target, at = view[start : start + part], offset + start
            while len(target):
                n = os.preadv(fd, [target], at)
                if n == 0:
                    raise OSError(f"unexpected end of file at byte {at}")
                target, at = target[n:], at + n

        for job in [self.pool.submit(read, start) for start in range(0, len(view), part)]:
            job.result()


def _rows(raw: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The bytes `raw` as the piece's rows (copied first when they do not start at a multiple of the element
    size, which safetensors does not promise)."""
    dtype = piece.entry.dtype
    if raw.storage_offset() % dtype.itemsize:
        raw = raw.clone()
    shape = (piece.rows, *piece.entry.shape[1:]) if piece.entry.shape else ()
    return raw.view(dtype).view(shape)
