"""A real S3 API server (moto in server mode, on 127.0.0.1 only) for output tests against an object store.

Use from a conftest: `from s3_server import s3_endpoint, s3_output_dir  # noqa: F401`. `s3_output_dir` points
the AWS variables of this process (and so of every subprocess a test starts) at the server and returns an
`s3://` output.dir in a fresh bucket.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_output_dir(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    import s3fs

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    bucket = f"batchjob-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
    return f"s3://{bucket}/out"
