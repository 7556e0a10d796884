"""`python -m batchjob [key=value ...]`: run one shard of a batch generation job (Hydra app).

The config lives inside the package (batchjob/conf), so an installed batchjob finds it; add your own
presets with `--config-dir DIR` or `hydra.searchpath=[file://DIR]` (e.g. DIR/model/my_model.yaml).
With `engine.data_parallel=N` this process only launches N children, one GPU and one sub-shard each.
"""

from __future__ import annotations

import sys
import time

# Start-up is reported from here (interpreter start is ~0.05 s earlier): imports and config count too.
_STARTED = time.perf_counter()

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from batchjob.slurm import register_resolvers  # noqa: E402

# The conf's shard defaults are `${slurm_shard_index:}`/`${slurm_shard_count:}`, and Hydra resolves
# them (hydra.run.dir names the shard) before main() is called.
register_resolvers()


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from batchjob.config import data_parallel, load_settings
    from batchjob.errors import ConfigError
    from batchjob.job import EXIT_USAGE, run_job

    try:
        processes = data_parallel(cfg)
        if processes > 1:
            from hydra.core.hydra_config import HydraConfig

            from batchjob.launch import run_data_parallel

            # Checked once here, so a bad config is one message, not one per child.
            settings = load_settings(cfg)
            overrides = HydraConfig.get().overrides.task
            tensor_parallel = int(settings.engine_options.get("tensor_parallel", 1))
            sys.exit(
                run_data_parallel(
                    overrides, processes, settings.shard_index, settings.shard_count, tensor_parallel=tensor_parallel
                )
            )
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    status = run_job(cfg, started=_STARTED)
    if status:
        sys.exit(status)


if __name__ == "__main__":
    main()
