"""Durable file operations on a local path or any fsspec URI (s3://, gs://, memory://, file://).

Local paths get the full crash-safety kit: fsync of files and directories, atomic rename, create-exclusive.
Object stores have no fsync, rename or append; there a closed write is durable and atomic, `rename` is a
copy + delete and `append_line` rewrites the file, which is why the manifest (not the rename) is the commit
point everywhere.
"""

from __future__ import annotations

import os
import posixpath
import uuid

import fsspec
import pyarrow.fs as pafs
from fsspec.implementations.local import LocalFileSystem


class Storage:
    """One filesystem plus whether it is local (so POSIX durability calls apply)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, is_local: bool) -> None:
        self.fs = fs
        self.is_local = is_local

    @classmethod
    def for_uri(cls, uri: str) -> tuple[Storage, str]:
        """The storage holding `uri` and the path of `uri` inside it."""
        fs, path = fsspec.core.url_to_fs(uri)
        is_local = isinstance(fs, LocalFileSystem)
        if is_local:
            path = os.path.abspath(path)
        return cls(fs, is_local), path

    def pyarrow_fs(self) -> pafs.FileSystem:
        if self.is_local:
            return pafs.LocalFileSystem()
        return pafs.PyFileSystem(pafs.FSSpecHandler(self.fs))

    def join(self, *parts: str) -> str:
        return os.path.join(*parts) if self.is_local else posixpath.join(*parts)

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    def isdir(self, path: str) -> bool:
        return self.fs.isdir(path)

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def list_files(self, directory: str) -> dict[str, int]:
        """Base name -> size of the files directly in `directory` (empty if it does not exist)."""
        if self.is_local:
            try:
                with os.scandir(directory) as entries:
                    return {e.name: e.stat().st_size for e in entries if e.is_file()}
            except FileNotFoundError:
                return {}
        if not self.fs.exists(directory):
            return {}
        return {
            posixpath.basename(info["name"].rstrip("/")): int(info["size"])
            for info in self.fs.ls(directory, detail=True)
            if info["type"] == "file"
        }

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    def read_bytes(self, path: str) -> bytes:
        with self.fs.open(path, "rb") as f:
            return f.read()

    def remove(self, path: str) -> None:
        """Delete a file; absent is fine (cleanup is re-run after crashes)."""
        if self.is_local:
            try:
                os.remove(path)
            except FileNotFoundError:
                return
        elif self.fs.exists(path):
            self.fs.rm_file(path)

    def write_durable(self, path: str, data: bytes) -> None:
        """Write `data` to `path` (a name nobody reads yet) and make it durable before returning."""
        if self.is_local:
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        else:
            with self.fs.open(path, "wb") as f:
                f.write(data)

    def rename(self, src: str, dst: str) -> None:
        """Move `src` over `dst`; on local disks atomic and durable (the directory entry is fsynced)."""
        if self.is_local:
            os.replace(src, dst)
            self.fsync_dir(os.path.dirname(dst))
        else:
            self.fs.mv(src, dst)

    def write_atomic(self, path: str, data: bytes, tmp_dir: str) -> None:
        """Readers of `path` see the old content or all of `data`, never a torn file."""
        self.makedirs(tmp_dir)
        tmp = self.join(tmp_dir, f"{posixpath.basename(path)}.{uuid.uuid4().hex}")
        self.write_durable(tmp, data)
        self.rename(tmp, path)

    def create_exclusive(self, path: str, data: bytes, tmp_dir: str) -> bool:
        """Create `path` holding `data` unless it exists; False if it existed.

        Local: atomic (a complete temp file is hard-linked into place, so no reader sees a half-written
        file). Object stores: exclusive-create where the backend supports it, else check-then-write.
        """
        if self.is_local:
            self.makedirs(tmp_dir)
            tmp = self.join(tmp_dir, f"{os.path.basename(path)}.{uuid.uuid4().hex}")
            self.write_durable(tmp, data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            except OSError:
                # No hard links here (some FUSE mounts): exclusive create, briefly visible half-written.
                return self._create_exclusive_unlinked(path, data)
            finally:
                os.remove(tmp)
            self.fsync_dir(os.path.dirname(path))
            return True
        try:
            with self.fs.open(path, "xb") as f:
                f.write(data)
        except FileExistsError:
            return False
        return True

    def _create_exclusive_unlinked(self, path: str, data: bytes) -> bool:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return True

    def append_line(self, path: str, line: str) -> None:
        """Append one text line durably (fsynced locally; a full rewrite on object stores)."""
        encoded = (line.rstrip("\n") + "\n").encode()
        if self.is_local:
            with open(path, "ab") as f:
                f.write(encoded)
                f.flush()
                os.fsync(f.fileno())
            return
        old = self.read_bytes(path) if self.fs.exists(path) else b""
        with self.fs.open(path, "wb") as f:
            f.write(old + encoded)

    def truncate(self, path: str, size: int) -> None:
        if self.is_local:
            with open(path, "r+b") as f:
                f.truncate(size)
                os.fsync(f.fileno())
            return
        data = self.read_bytes(path)[:size]
        with self.fs.open(path, "wb") as f:
            f.write(data)

    def fsync_dir(self, directory: str) -> None:
        if not self.is_local:
            return
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
