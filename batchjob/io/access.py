"""Inputs and outputs this machine cannot reach: missing or refused credentials, permission denied, an endpoint
that does not answer. Found while a job is prepared, they are the user's to fix (`StorageAccessError`, exit 2);
mid-run, the job stops with what it committed and a rerun resumes (job.py)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence


class StorageAccessError(ValueError):
    """The input or output location cannot be reached with this machine's credentials and network."""


# Raised by the object stores' client libraries (botocore, google-auth, azure) when the credentials are missing
# or refused, or the endpoint cannot be reached; named, so that none of them need be importable here.
_ACCESS_ERRORS = frozenset(
    {
        "NoCredentialsError",
        "PartialCredentialsError",
        "NoRegionError",
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "InvalidAccessKeyId",
        "DefaultCredentialsError",
        "RefreshError",
        "ClientAuthenticationError",
        "ClientConnectionError",
        "ServerDisconnectedError",
    }
)


class _LostConnectionRecords(logging.Filter):
    """Drops asyncio's "exception was never retrieved" records of an object store's lost connections: the
    async filesystems (s3fs, gcsfs) leave such tasks behind when the endpoint goes away, and the job reports
    the loss itself, in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        err = record.exc_info[1] if record.exc_info else None
        return err is None or not is_access_error(err)


def quiet_lost_connections() -> None:
    """Install `_LostConnectionRecords` on asyncio's logger (once)."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _LostConnectionRecords) for f in logger.filters):
        logger.addFilter(_LostConnectionRecords())


def is_access_error(err: BaseException) -> bool:
    """True for a location this process cannot reach: refused or missing credentials, permission denied, a
    connection that failed or timed out."""
    if isinstance(err, (PermissionError, ConnectionError, TimeoutError)):
        return True
    return any(cls.__name__ in _ACCESS_ERRORS for cls in type(err).__mro__)


@contextlib.contextmanager
def access_reported(locations: Sequence[str | None]) -> Iterator[None]:
    """Turn a failure to reach any of `locations` (missing or refused credentials, an unreachable endpoint, a
    permission denied) into `StorageAccessError`, whose message names the locations and the fix."""
    try:
        yield
    except Exception as err:
        if not is_access_error(err):
            raise
        remote = [where for where in locations if where and "://" in where]
        if remote:
            fix = (
                "Check that this machine has credentials for it (for S3: AWS_PROFILE, or AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY; AWS_ENDPOINT_URL for an S3-compatible server), that they may read and "
                "write there, and that the endpoint is reachable"
            )
        else:
            fix = "Check that this user may read the input and write beside output.dir"
        where = " or ".join(remote or [where for where in locations if where])
        raise StorageAccessError(f"cannot access {where}: {type(err).__name__}: {err}. {fix}") from None
