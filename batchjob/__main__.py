"""`python -m batchjob [key=value ...]`: run one shard of a batch generation job (Hydra app).

The config tree (conf/ in the repository) ships inside the package as batchjob.conf, so an installed
batchjob finds it; add your own presets with `--config-dir DIR` or `hydra.searchpath=[file://DIR]`
(e.g. DIR/model/my_model.yaml).
With `engine.data_parallel=N` this process only launches N children, one GPU and one sub-shard each.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from batchjob.job.startup import StartupClock, keep_bytecode

# Start-up is reported from here (interpreter start is ~0.05 s earlier): imports and config count too.
_STARTUP = StartupClock()
# Before the imports it speeds up: an environment that cannot keep its own bytecode keeps it in the cache.
keep_bytecode()

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from batchjob.cluster.slurm import register_resolvers  # noqa: E402
from batchjob.config.help import register_help_resolver  # noqa: E402
from batchjob.errors import EXIT_USAGE, ConfigError  # noqa: E402
from batchjob.job.run_files import register_sweep_dir_resolver  # noqa: E402

_STARTUP.lap("imports_s")

# Hydra reports an exception raised while composing the config itself (a trimmed traceback, exit 1)
# unless this is "1"; `cli` sets it for the composition only, to report those errors as batchjob does.
_FULL_ERROR = "HYDRA_FULL_ERROR"
_USERS_FULL_ERROR = os.environ.get(_FULL_ERROR)

# The conf calls these resolvers: the shard defaults (`${slurm_shard_index:}`), the multirun folder and
# the --help text; Hydra may resolve them before main() is called.
register_resolvers()
register_sweep_dir_resolver()
register_help_resolver()


def composed() -> None:
    """Composition is over: errors of the job itself get Hydra's usual report, and children (engine.
    data_parallel, submitit) inherit the user's setting, not `cli`'s."""
    if _USERS_FULL_ERROR is None:
        os.environ.pop(_FULL_ERROR, None)
    else:
        os.environ[_FULL_ERROR] = _USERS_FULL_ERROR


@hydra.main(config_path="pkg://batchjob.conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from batchjob.config.settings import data_parallel, load_settings
    from batchjob.job.run import run_job

    composed()
    try:
        processes = data_parallel(cfg)
        if processes > 1:
            from hydra.core.hydra_config import HydraConfig

            from batchjob.cluster.data_parallel import run_data_parallel
            from batchjob.job.run_files import save_run_config

            # Checked once here, so a bad config is one message, not one per child.
            settings = load_settings(cfg)
            overrides = HydraConfig.get().overrides.task
            tensor_parallel = int(settings.engine_options.get("tensor_parallel", 1))
            status = run_data_parallel(
                overrides, processes, settings.shard_index, settings.shard_count, tensor_parallel=tensor_parallel
            )
            if status != EXIT_USAGE:  # a refused child: this command belongs to another job's directory
                save_run_config(cfg, settings.output.dir, settings.shard_index, settings.shard_count)
            sys.exit(status)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    status = run_job(cfg, _STARTUP)
    if status:
        sys.exit(status)


def cli(app: Callable[[], None] = main) -> None:
    """Run `app` (a Hydra app of batchjob's config: `main`, or `batchjob.warmup`'s), reporting Hydra's errors while
    composing the config (an unknown preset or key, an override it cannot parse, a preset file that is not YAML) as
    one line and exit status 2, like batchjob's own config errors."""
    from hydra.errors import ConfigCompositionException, OverrideParseException
    from yaml import YAMLError

    from batchjob.config.keys import composition_error

    if _USERS_FULL_ERROR == "1":  # the user asked for Hydra's full traces
        app()
        return
    os.environ[_FULL_ERROR] = "1"
    try:
        app()
    except (ConfigCompositionException, OverrideParseException, YAMLError) as err:
        print(f"error: {composition_error(err)}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


if __name__ == "__main__":
    from batchjob.job.stderr import drop_stderr_when_unread
    from batchjob.quick_exit import exit_now

    drop_stderr_when_unread()
    try:
        cli()
    except SystemExit as done:
        exit_now(done.code)
    exit_now(0)
