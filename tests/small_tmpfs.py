"""A small tmpfs mounted for one test, to fill a disk for real (needs root; skipped, saying so, without it).

Use from a conftest: `from small_tmpfs import small_tmpfs  # noqa: F401`. The fixture yields a `Tmpfs` whose
`path` is the mount point and whose `resize(bytes)` grows it (what a user freeing space amounts to).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SIZE = 256 * 1024


@dataclass(frozen=True)
class Tmpfs:
    path: Path

    def resize(self, size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Tmpfs]:
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root): {mounted.stderr.strip()}")
    try:
        yield Tmpfs(mount_point)
    finally:
        subprocess.run(["umount", "--lazy", str(mount_point)], check=True)
