"""Durable file operations on a local path or any fsspec URI (s3://, gs://, memory://, file://).

Local paths get the full crash-safety kit: fsync of files and of the directories whose entries change,
atomic rename, create-exclusive by hard link, files written without a name and linked into place (O_TMPFILE,
where the filesystem has them). Object stores have no fsync or rename; there a completed PUT is durable and
atomic (an object appears whole or not at all), `rename` is a copy + delete, and create-exclusive is a
conditional PUT (`If-None-Match: *`) where the backend supports it (s3fs on S3 and S3-compatible servers;
elsewhere fsspec's `xb` mode, which some backends implement as check-then-write).
Listings are never cached: other processes change the directories this one reads.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import posixpath
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import fsspec
import pyarrow.fs as pafs
from fsspec.implementations.local import LocalFileSystem

_FULL = (errno.ENOSPC, errno.EDQUOT)
# O_TMPFILE unknown to the kernel (EISDIR) or the filesystem; then a file needs a name from the start.
_NO_UNNAMED_FILES = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL)
# One way of linking an unnamed file that this system refuses: no /proc, a sandbox's /proc, no privilege for
# AT_EMPTY_PATH (before Linux 6.10).
_LINK_REFUSED = (errno.ENOENT, errno.EXDEV, errno.EPERM, errno.EINVAL, errno.EOPNOTSUPP)
_AT_FDCWD, _AT_EMPTY_PATH = -100, 0x1000
_READ_CONCURRENCY = 16  # objects fetched at once from an object store; a batch of parts stays small in memory


class StorageFull(RuntimeError):
    """A write failed because the device (or the user's quota) holding the output is full."""


@contextlib.contextmanager
def full_disk_reported(what: str) -> Iterator[None]:
    """Turn ENOSPC/EDQUOT while writing `what` into `StorageFull`, whose message names the fix."""
    try:
        yield
    except OSError as err:
        if err.errno not in _FULL:
            raise
        raise StorageFull(
            f"no space left on the device holding {what} ({os.strerror(err.errno)}). Rows committed so far "
            "are kept: free some space (or raise the quota) and rerun the same command to resume"
        ) from err


class Storage:
    """One filesystem plus whether it is local (so POSIX durability calls apply)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, is_local: bool) -> None:
        self.fs = fs
        self.is_local = is_local

    @classmethod
    def for_uri(cls, uri: str) -> tuple[Storage, str]:
        """The storage holding `uri` and the path of `uri` inside it."""
        fs, path = fsspec.core.url_to_fs(uri, use_listings_cache=False)
        is_local = isinstance(fs, LocalFileSystem)
        if is_local:
            path = os.path.abspath(path)
        return cls(fs, is_local), path

    @property
    def is_s3(self) -> bool:
        """s3fs, whose PUTs take the If-Match / If-None-Match conditions S3 and S3-compatible servers honour."""
        return hasattr(self.fs, "call_s3")

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
        """Create `path` and its missing parents; on local disks each new entry is fsynced into its parent."""
        if not self.is_local:
            self.fs.makedirs(path, exist_ok=True)
            return
        missing = []
        while not os.path.isdir(path):
            missing.append(path)
            path = os.path.dirname(path)
        for directory in reversed(missing):
            with contextlib.suppress(FileExistsError):  # another shard created it meanwhile
                os.mkdir(directory)
            self.fsync_dir(os.path.dirname(directory))

    def _entries(self, directory: str) -> list[tuple[str, bool, int]]:
        """(base name, is a directory, size) of what is directly in `directory` (empty if it does not exist)."""
        if self.is_local:
            try:
                with os.scandir(directory) as entries:
                    return [(e.name, e.is_dir(), 0 if e.is_dir() else e.stat().st_size) for e in entries]
            except FileNotFoundError:
                return []
        try:
            infos = self.fs.ls(directory, detail=True)
        except FileNotFoundError:
            return []
        return [
            (posixpath.basename(i["name"].rstrip("/")), i["type"] == "directory", int(i.get("size") or 0))
            for i in infos
            if i["name"].rstrip("/") != directory.rstrip("/")
        ]

    def list_files(self, directory: str) -> dict[str, int]:
        """Base name -> size of the files directly in `directory` (empty if it does not exist)."""
        return {name: size for name, is_dir, size in self._entries(directory) if not is_dir}

    def list_dirs(self, directory: str) -> list[str]:
        return sorted(name for name, is_dir, _ in self._entries(directory) if is_dir)

    def list_names(self, directory: str) -> list[str]:
        """Base names of everything directly in `directory`, folders ending in `/` (empty if it does not exist)."""
        return sorted(name + "/" if is_dir else name for name, is_dir, _ in self._entries(directory))

    def read_bytes(self, path: str) -> bytes:
        with self.fs.open(path, "rb") as f:
            return f.read()

    def read_many(self, paths: list[str]) -> Iterator[tuple[str, bytes]]:
        """(path, content) of each path, in order; object stores fetch a few at a time concurrently (a
        request's latency, not its bandwidth, is what a shard's thousands of small reads would wait on)."""
        if self.is_local:
            yield from ((p, self.read_bytes(p)) for p in paths)
            return
        with ThreadPoolExecutor(_READ_CONCURRENCY) as pool:
            for start in range(0, len(paths), _READ_CONCURRENCY):
                batch = paths[start : start + _READ_CONCURRENCY]
                yield from zip(batch, pool.map(self.read_bytes, batch), strict=True)

    def modified(self, path: str) -> float | None:
        """When `path` was last written (seconds since the epoch, the storage's clock), or None if absent."""
        if self.is_local:
            try:
                return os.stat(path).st_mtime
            except FileNotFoundError:
                return None
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return None
        stamp = info.get("LastModified") or info.get("mtime") or info.get("created")
        return stamp.timestamp() if isinstance(stamp, datetime) else float(stamp)

    def remove(self, path: str) -> None:
        """Delete a file; absent is fine (cleanup is re-run after crashes)."""
        if self.is_local:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            return
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def write_durable(self, path: str, data: bytes) -> None:
        """Write `data` to `path` and make it durable; on failure nothing is left. Local files are written in
        place (give a name nobody reads yet); an object store's PUT is atomic, so any name will do."""
        if not self.is_local:
            self.fs.pipe_file(path, data)
            return
        try:
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(path)
            raise

    def write_unnamed(self, directory: str, data: bytes) -> int | None:
        """A descriptor of a new durable file in local `directory` holding `data` that has no name yet (O_TMPFILE),
        for `link_unnamed`; None where the filesystem has no such files. No listing shows it, and a crash before
        it is linked leaves nothing behind."""
        unnamed = getattr(os, "O_TMPFILE", None)  # Linux only
        if unnamed is None:
            return None
        try:
            fd = os.open(directory, unnamed | os.O_WRONLY, 0o644)
        except OSError as err:
            if err.errno in _NO_UNNAMED_FILES:
                return None
            raise
        try:
            with open(fd, "wb", closefd=False) as f:
                f.write(data)
                f.flush()
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def link_unnamed(self, fd: int, path: str) -> None:
        """Give the file of `write_unnamed`'s `fd` the name `path` (atomic; FileExistsError if `path` exists),
        and close `fd`. The caller fsyncs `path`'s directory."""
        try:
            try:
                os.link(f"/proc/self/fd/{fd}", path, follow_symlinks=True)  # open(2)'s way, unprivileged
            except OSError as err:
                if err.errno not in _LINK_REFUSED:
                    raise
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.linkat(fd, b"", _AT_FDCWD, os.fsencode(path), _AT_EMPTY_PATH) != 0:
                    code = ctypes.get_errno()
                    raise OSError(code, os.strerror(code), path) from err
        finally:
            os.close(fd)

    def links_unnamed(self, directory: str, probe: str) -> bool:
        """Whether files without a name can be written in local `directory` and linked into it (tried with an
        empty file linked as `probe`, then deleted)."""
        fd = self.write_unnamed(directory, b"")
        if fd is None:
            return False
        try:
            self.link_unnamed(fd, probe)
        except OSError as err:
            if err.errno in _LINK_REFUSED:
                return False
            raise
        self.remove(probe)
        return True

    def rename(self, src: str, dst: str, sync: bool = True) -> None:
        """Move `src` over `dst`; on local disks atomic, and durable unless `sync=False` (then the caller
        fsyncs `dst`'s directory)."""
        if self.is_local:
            os.replace(src, dst)
            if sync:
                self.fsync_dir(os.path.dirname(dst))
        else:
            self.fs.mv(src, dst)

    def write_atomic(self, path: str, data: bytes, tmp_dir: str) -> None:
        """Readers of `path` see the old content or all of `data`, never a torn file."""
        if not self.is_local:
            self.write_durable(path, data)
            return
        self.makedirs(tmp_dir)
        tmp = self.join(tmp_dir, f"{posixpath.basename(path)}.{uuid.uuid4().hex}")
        self.write_durable(tmp, data)
        try:
            self.rename(tmp, path)
        except BaseException:
            self.remove(tmp)
            raise

    def create_exclusive(self, path: str, data: bytes, tmp_dir: str, sync: bool = True) -> bool:
        """Create `path` holding `data` unless it exists; False if it existed. Durable when it returns True,
        unless `sync=False` (then the caller fsyncs `path`'s directory).

        Local: atomic (a complete temp file is hard-linked into place, so no reader sees a half-written
        file). Object stores: a conditional PUT.
        """
        if not self.is_local:
            try:
                self.fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                return False
            return True
        self.makedirs(tmp_dir)
        tmp = self.join(tmp_dir, f"{os.path.basename(path)}.{uuid.uuid4().hex}")
        self.write_durable(tmp, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as err:
            if err.errno in _FULL:
                raise
            # No hard links here (some FUSE mounts): exclusive create, briefly visible half-written.
            return self._create_exclusive_unlinked(path, data)
        finally:
            os.remove(tmp)
        if sync:
            self.fsync_dir(os.path.dirname(path))
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
        self.fsync_dir(os.path.dirname(path))
        return True

    def fsync_dir(self, directory: str) -> None:
        """Make a directory's entries (a create, rename or delete in it) survive a power loss."""
        if not self.is_local:
            return
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
