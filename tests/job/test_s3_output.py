"""A job writing to a real S3 API server (moto, on 127.0.0.1, started by the tests): killed mid-run and
rerun, every row exactly once and identical to the same job on a local disk."""

from __future__ import annotations

import subprocess
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.dataset as pads
from jobtools import HUNG_S, read_output, run_cli, start_cli, wait_for, write_prompts

ROWS = 24
SMALL_PARTS = ("engine.max_batch_size=1", "output.commit_every_rows=3", "output.commit_every_s=1000")


def s3_parts(uri: str) -> list[str]:
    fs, path = fsspec.core.url_to_fs(uri, use_listings_cache=False)
    return fs.glob(f"{path}/part-*.parquet")


def read_s3_output(uri: str) -> pa.Table:
    fs, path = fsspec.core.url_to_fs(uri, use_listings_cache=False)
    return pads.dataset(path, filesystem=fs, format="parquet").to_table().sort_by("row_id")


def start_after_parts(args: tuple[str, ...], out: str, cwd: Path, parts: int = 2) -> subprocess.Popen:
    """The job started, once it has committed `parts` parts to `out`."""
    job = start_cli(*args, cwd=cwd)
    wait_for(lambda: len(s3_parts(out)) >= parts, job, f"{parts} committed parts")
    return job


def start_beside_a_local_run(out: str, tmp_path: Path) -> tuple[tuple[str, ...], Path, subprocess.Popen]:
    """The same job run whole into a local folder, then started towards `out` until it has committed parts:
    the job's arguments, the local folder and the started job."""
    prompts = write_prompts(tmp_path / "prompts.parquet", ROWS)
    local = tmp_path / "local"
    assert run_cli(f"data.path={prompts}", f"output.dir={local}", *SMALL_PARTS).returncode == 0
    args = (f"data.path={prompts}", f"output.dir={out}", *SMALL_PARTS)
    return args, local, start_after_parts(args, out, tmp_path)


def test_sigkill_on_s3_then_rerun_yields_every_row_once_identically(s3_output_dir: str, tmp_path: Path) -> None:
    args, local, job = start_beside_a_local_run(s3_output_dir, tmp_path)
    job.kill()
    job.wait()
    resumed = run_cli(*args, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming:" in resumed.stderr
    # Logs cannot be appended to on S3: both runs' go to a local folder named after output.dir.
    log = tmp_path / "batchjob-logs" / "s3" / s3_output_dir.removeprefix("s3://")
    log = log.with_name(log.name + ".batchjob") / "_hydra" / "shard-0-of-1" / "batchjob.log"
    assert log.read_text().count("ready to generate") == 2
    got, want = read_s3_output(s3_output_dir), read_output(local)
    assert got.column("row_id").to_pylist() == list(range(ROWS))
    assert got.column("generation").to_pylist() == want.column("generation").to_pylist()


def test_a_store_lost_mid_run_exits_resumable_and_the_rerun_yields_every_row_once(
    s3_output_dir: str, tmp_path: Path, monkeypatch
) -> None:
    del s3_output_dir  # wanted for the credentials it sets, not its server
    import logging

    from moto.server import ThreadedMotoServer

    # A server of this test's own, stopped mid-run and started again on the same port; moto keeps its buckets
    # in this process, so the objects are there again, as after an outage.
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
    fsspec.filesystem("s3", skip_instance_cache=True).mkdir("outage")
    out = "s3://outage/out"
    args, local, job = start_beside_a_local_run(out, tmp_path)
    server.stop()
    _, stderr = job.communicate(timeout=HUNG_S)
    assert job.returncode == 75, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]  # nor asyncio's records of the tasks the lost server cut off
    assert "lost access to the output or input mid-run" in stderr
    assert "resumable: rerun the same command" in stderr
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        resumed = run_cli(*args, cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stderr
        got, want = read_s3_output(out), read_output(local)
    finally:
        server.stop()
    assert got.column("row_id").to_pylist() == list(range(ROWS))
    assert got.column("generation").to_pylist() == want.column("generation").to_pylist()
