"""Each process's log and config go beside output.dir, never inside it (where readers would trip)."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from jobtools import CONF_DIR

from batchjob.cluster.slurm import register_resolvers
from batchjob.job.run_files import register_sweep_dir_resolver, run_folder


def sweep_dir(*overrides: str) -> str:
    register_resolvers()
    register_sweep_dir_resolver()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
        return cfg.hydra.sweep.dir


@pytest.mark.parametrize("output_dir", ["/scratch/run1", "/scratch/run1/", "file:///scratch/run1"])
def test_logs_go_to_the_folder_beside_a_local_output_dir(output_dir: str) -> None:
    assert run_folder(output_dir, 0, 1) == "/scratch/run1.batchjob/_hydra/shard-0-of-1"
    assert sweep_dir(f"output.dir={output_dir}") == "/scratch/run1.batchjob/_hydra/multirun"


def test_logs_of_an_object_store_output_go_to_a_local_folder_named_after_it() -> None:
    assert run_folder("s3://bucket/run1/", 2, 4) == "batchjob-logs/s3/bucket/run1.batchjob/_hydra/shard-2-of-4"
    assert sweep_dir("output.dir=s3://bucket/run1") == "batchjob-logs/s3/bucket/run1.batchjob/_hydra/multirun"
