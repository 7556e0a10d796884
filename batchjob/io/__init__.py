"""The IO layer: sharded input readers, the exactly-once Parquet output, and output status.

Knows nothing of CUDA, torch or the engine: it moves Arrow batches with `row_id`s in and out.
"""

from batchjob.io.access import StorageAccessError
from batchjob.io.inputs import InputError, InputSource, InputSpec
from batchjob.io.job_record import JobRecordMismatch
from batchjob.io.layout import OutputDirError, ShardOutput
from batchjob.io.lock import LockError, LockLost
from batchjob.io.output import OutputDataset
from batchjob.io.readers import open_input
from batchjob.io.status import shard_status
from batchjob.io.storage import StorageFull

__all__ = [
    "InputError",
    "InputSource",
    "InputSpec",
    "JobRecordMismatch",
    "LockError",
    "LockLost",
    "OutputDataset",
    "OutputDirError",
    "ShardOutput",
    "StorageAccessError",
    "StorageFull",
    "open_input",
    "shard_status",
]
