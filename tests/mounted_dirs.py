"""An output.dir that is a mount point, as a container volume or a scratch mount is (needs root; skipped, saying
so, without it).

Use from a conftest: `from mounted_dirs import mounted_output  # noqa: F401`. The fixture yields the mount point,
`<tmp>/job/out`, with the folder beside it (`out.batchjob`) on the test's own disk, in two layouts:
- `tmpfs`: another filesystem than the folder beside it;
- `bind`: a folder of the test's own disk bind-mounted there: one device number on both sides, yet Linux refuses
  a rename between the two mounts (EXDEV), so only a real rename tells them apart.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

LAYOUTS = ("tmpfs", "bind")


def renames_reach(src_dir: Path, dst_dir: Path) -> bool:
    """Whether a file renamed from `src_dir` into `dst_dir` gets there (False on EXDEV)."""
    src, dst = src_dir / "rename-probe", dst_dir / ".rename-probe"
    src.write_bytes(b"")
    try:
        os.rename(src, dst)
    except OSError as err:
        src.unlink()
        if err.errno == errno.EXDEV:
            return False
        raise
    dst.unlink()
    return True


@pytest.fixture(params=LAYOUTS)
def mounted_output(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    out = tmp_path / "job" / "out"
    out.mkdir(parents=True)
    if request.param == "tmpfs":
        command = ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(out)]
    else:
        volume = tmp_path / "volume"
        volume.mkdir()
        command = ["mount", "--bind", str(volume), str(out)]
    mounted = subprocess.run(command, capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a {request.param} as output.dir (needs root): {mounted.stderr.strip()}")
    try:
        beside = out.with_name("out.probe")
        beside.mkdir()
        assert not renames_reach(beside, out), "the layout must refuse renames from beside output.dir"
        beside.rmdir()
        yield out
    finally:
        subprocess.run(["umount", "--lazy", str(out)], check=True)
