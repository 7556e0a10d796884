"""Hydra's per-process log and config go beside output.dir, never inside it (where readers would trip)."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from jobtools import CONF_DIR

from batchjob.slurm import register_resolvers


def hydra_dirs(output_dir: str) -> tuple[str, str]:
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=[f"output.dir={output_dir}"], return_hydra_config=True)
        return cfg.hydra.run.dir, cfg.hydra.sweep.dir


@pytest.mark.parametrize("output_dir", ["/scratch/run1", "/scratch/run1/", "file:///scratch/run1"])
def test_logs_go_to_the_folder_beside_a_local_output_dir(output_dir: str) -> None:
    assert hydra_dirs(output_dir) == (
        "/scratch/run1.batchjob/_hydra/shard-0-of-1",
        "/scratch/run1.batchjob/_hydra/multirun",
    )


def test_logs_of_an_object_store_output_go_to_a_local_folder_named_after_it() -> None:
    run_dir, _ = hydra_dirs("s3://bucket/run1/")
    assert run_dir == "batchjob-logs/s3/bucket/run1.batchjob/_hydra/shard-0-of-1"
