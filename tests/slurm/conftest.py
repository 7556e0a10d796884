import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from slurm_cluster import ENGINES, JOB_OVERRIDES, REPO, cluster_answers, job_env

from batchjob.job.tiny_model import make_tiny_model


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if any(item.get_closest_marker("slurm") for item in items) and not cluster_answers():
        skip = pytest.mark.skip(reason="no Slurm cluster answers (start one: scripts/slurm/local-cluster.sh start)")
        for item in items:
            if item.get_closest_marker("slurm"):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def job_inputs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """`model.path` and `data.path` of an 80-row job (20 rows a shard) on a tiny model, in files every Slurm
    task can read."""
    root = tmp_path_factory.mktemp("slurm_workload")
    model = make_tiny_model(root / "model")
    prompts = pq.read_table(REPO / "batchjob" / "data" / "sample_prompts.parquet").slice(0, 80)
    pq.write_table(prompts, root / "prompts.parquet", row_group_size=10)
    return [f"model.path={model}", f"data.path={root / 'prompts.parquet'}"]


@pytest.fixture(scope="session")
def workload(request: pytest.FixtureRequest, job_inputs: list[str]) -> list[str]:
    """Overrides for the job of `job_inputs`. The engine is `hf` unless a test parametrises `workload`
    (indirectly) by name."""
    return [*job_inputs, *ENGINES[getattr(request, "param", "hf")], *JOB_OVERRIDES]


@pytest.fixture(scope="session")
def references() -> dict[tuple[str, ...], Path]:
    """The reference output of each workload run so far. Pytest sets `workload` up again for a test that
    does not parametrise it after one that does (its default and a parametrised `hf` are different
    instances to pytest), and `reference` with it: this keeps the job from running again."""
    return {}


@pytest.fixture(scope="session")
def reference(
    workload: list[str], references: dict[tuple[str, ...], Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The same job, uninterrupted, in one local process: what every Slurm run must reproduce."""
    key = tuple(workload)
    if key not in references:
        out = tmp_path_factory.mktemp("slurm_reference") / "out"
        cmd = [sys.executable, "-m", "batchjob", *workload, f"output.dir={out}", "shard.index=0", "shard.count=1"]
        subprocess.run(cmd, check=True, env=job_env(), cwd=out.parent, capture_output=True)
        references[key] = out
    return references[key]
