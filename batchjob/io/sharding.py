"""Which rows a shard owns, and which rows a resumed run skips, as vectorised numpy operations.

Shard i of k owns the contiguous input rows [i*N//k, (i+1)*N//k): contiguous ranges let Parquet readers
touch only the row groups they need, and the k ranges tile [0, N) exactly once. When N is unknown
(streaming), shard i owns the rows whose index is i modulo k instead.
"""

from __future__ import annotations

import numpy as np


def shard_range(n_rows: int, shard_index: int, shard_count: int) -> tuple[int, int]:
    return shard_index * n_rows // shard_count, (shard_index + 1) * n_rows // shard_count


def keep_mask(row_ids: np.ndarray, skip_row_ids: np.ndarray | None) -> np.ndarray | None:
    """Boolean mask of `row_ids` absent from the sorted `skip_row_ids`; None when nothing is skipped.

    Binary search per row (O(batch * log skipped)): `skip_row_ids` may hold tens of millions of ids, far
    too many to re-sort per batch as `np.isin` would.
    """
    if skip_row_ids is None or len(skip_row_ids) == 0 or len(row_ids) == 0:
        return None
    slots = np.searchsorted(skip_row_ids, row_ids)
    found = skip_row_ids[np.minimum(slots, len(skip_row_ids) - 1)] == row_ids
    return None if not found.any() else ~found


def all_skipped(skip_row_ids: np.ndarray | None, start: int, stop: int) -> bool:
    """Whether every id in [start, stop) is in the sorted, unique `skip_row_ids` (a finished stretch)."""
    if skip_row_ids is None or stop <= start:
        return False
    covered = np.searchsorted(skip_row_ids, stop) - np.searchsorted(skip_row_ids, start)
    return int(covered) == stop - start
