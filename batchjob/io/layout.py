"""Names of every file in an output directory.

Only part files may be visible to `pyarrow.dataset(output_dir)` / `pandas.read_parquet(output_dir)`: every
other file starts with `_`, which pyarrow's discovery skips, so reading the directory yields exactly the
committed rows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

JOB_RECORD_NAME = "_job.json"
TMP_DIR_NAME = "_tmp"
# The whole-job report for single-shard runs; `report.json` would break plain reads of the directory.
REPORT_NAME = "_report.json"
SUCCESS_NAME = "_SUCCESS"

PART_RE = re.compile(r"^part-s(\d{5})-(\d{6})\.parquet$")
MANIFEST_RE = re.compile(r"^_manifest-s(\d{5})\.jsonl$")
SHARD_SUCCESS_RE = re.compile(r"^_SUCCESS-s(\d{5})$")
LOCK_RE = re.compile(r"^_lock-s(\d{5})$")


@dataclass(frozen=True)
class ShardOutput:
    """Where one shard's outputs live inside an output directory."""

    dir: str
    shard_index: int = 0
    shard_count: int = 1

    def __post_init__(self) -> None:
        if self.shard_count < 1 or not 0 <= self.shard_index < self.shard_count:
            raise ValueError(
                f"shard.index={self.shard_index} is not in [0, shard.count={self.shard_count}): "
                "set shard.index to 0..shard.count-1"
            )

    @property
    def tag(self) -> str:
        return f"s{self.shard_index:05d}"

    @property
    def part_prefix(self) -> str:
        return f"part-{self.tag}-"

    def part_name(self, seq: int) -> str:
        return f"{self.part_prefix}{seq:06d}.parquet"

    @property
    def manifest_name(self) -> str:
        return f"_manifest-{self.tag}.jsonl"

    @property
    def lock_name(self) -> str:
        return f"_lock-{self.tag}"

    @property
    def success_name(self) -> str:
        return SUCCESS_NAME if self.shard_count == 1 else f"{SUCCESS_NAME}-{self.tag}"

    @property
    def report_name(self) -> str:
        return f"_report-{self.tag}.json"

    def owns_tmp(self, name: str) -> bool:
        """Whether a file in the temp dir was left by this shard (other shards' temps are theirs to clean)."""
        own = (self.part_prefix, self.manifest_name, self.lock_name, self.success_name, self.report_name)
        return name.startswith(own)
