"""Where a local part is written before its commit makes it visible, and the commit's one atomic step.

On a local disk a part must never be seen half written: it is written and fsynced elsewhere, then made visible
under its final name in one step (a rename, or a link of a file without a name). Which elsewhere depends on
output.dir's mount, probed once when a shard opens (`PartStaging.choose`). Object stores need none of this: a PUT
under the final name is atomic (output.py).
"""

from __future__ import annotations

import enum
import errno
import logging
import uuid
from typing import TYPE_CHECKING

from batchjob.io.crash_points import crash_point
from batchjob.io.layout import ShardOutput, staged_name

if TYPE_CHECKING:
    from batchjob.io.recovery import ShardFiles
    from batchjob.io.storage import Storage

log = logging.getLogger(__name__)


class Staging(enum.Enum):
    """Where a local part is written before the commit makes it visible. `BESIDE`: in the temp folder beside
    output.dir, renamed in. Where that rename cannot reach output.dir (another mount: a mount point, a bind
    mount, a container volume), inside output.dir, so the commit stays one atomic step: `UNNAMED`, a file
    without a name (O_TMPFILE) linked under its final name, which no reader ever sees; or `NAMED`, where the
    filesystem has no such files, under its staged name (which polars does not skip), renamed."""

    BESIDE = "beside"
    UNNAMED = "unnamed"
    NAMED = "named"


class PartStaging:
    """A shard's staging of its local parts: chosen when the shard opens, used by every commit."""

    def __init__(self, storage: Storage, shard: ShardOutput, path: str, tmp_dir: str, files: ShardFiles) -> None:
        self.storage = storage
        self.shard = shard
        self.path = path
        self.tmp_dir = tmp_dir
        self.files = files
        self.kind = Staging.BESIDE

    def choose(self) -> None:
        """Try a rename from the temp folder into output.dir (an empty probe file): the one check that sees a
        bind mount, whose two sides share a device number but refuse renames between them (EXDEV)."""
        probe = f"{self.shard.part_prefix}probe-{uuid.uuid4().hex}"
        src, inside = self.storage.join(self.tmp_dir, f"{self.shard.tag}.{probe}"), self.files.staged_path(probe)
        self.storage.write_durable(src, b"")
        try:
            self.storage.rename(src, inside, sync=False)
        except OSError as err:
            self.storage.remove(src)
            if err.errno != errno.EXDEV:
                raise
        else:
            self.storage.remove(inside)
            self.kind = Staging.BESIDE
            return
        if self.storage.links_unnamed(self.path, inside):
            log.info(
                "output.dir=%s is another mount than %s: parts are written inside it", self.shard.dir, self.tmp_dir
            )
            self.kind = Staging.UNNAMED
            return
        log.warning(
            "output.dir=%s is another mount than %s, and its filesystem cannot write files without a name: a part "
            "being written is there for a moment as %s (polars refuses to read the directory then)",
            self.shard.dir,
            self.tmp_dir,
            staged_name(f"{self.shard.part_prefix}NNNNNN.parquet"),
        )
        self.kind = Staging.NAMED

    def staged(self, name: str) -> str:
        """Where part `name` is written before it is moved in (named staging): under its staged name, which no
        `*.parquet` glob matches, so a reader globbing the folder that holds output.dir and its bookkeeping folder
        (`runs/**/*.parquet`) never reads a part that is not committed."""
        if self.kind is Staging.BESIDE:
            return self.storage.join(self.tmp_dir, staged_name(name))
        return self.files.staged_path(name)

    def commit(self, name: str, data: bytes, final: str) -> None:
        """Write part `name` durably where it is staged, then make it visible as `final` in one step: the
        commit point."""
        if self.kind is Staging.UNNAMED:
            fd = self.storage.write_unnamed(self.path, data)
            if fd is None:
                raise RuntimeError(f"{self.shard.dir} took files without a name when opened, and now refuses them")
            crash_point("part-written")
            self.storage.link_unnamed(fd, final)
            return
        tmp = self.staged(name)
        self.storage.write_durable(tmp, data)
        crash_point("part-written")
        try:
            self.storage.rename(tmp, final, sync=False)
        except BaseException:
            self.storage.remove(tmp)
            raise
