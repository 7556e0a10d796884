"""`python -m batchjob [key=value ...]`: run one shard of a batch generation job (Hydra app).

The config lives inside the package (batchjob/conf), so an installed batchjob finds it; add your own
presets with `--config-dir DIR` or `hydra.searchpath=[file://DIR]` (e.g. DIR/model/my_model.yaml).
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from batchjob.job import run_job

    status = run_job(cfg)
    if status:
        sys.exit(status)


if __name__ == "__main__":
    main()
