"""Each process's resolved config and log, in `<output.dir>.batchjob/_hydra/shard-I-of-N/`, written by batchjob.

Hydra would create its run folder and save the config before the job's checks run, so a refused run (a
different model pointed at a finished job's directory, a typo) would overwrite the saved config of the
job it refused, and an unusable `output.dir` would fail inside Hydra with a traceback. The conf turns
Hydra's own files off (`hydra.output_subdir: null`, no log file handler); batchjob saves them here only
once every check has passed and the shard's lock is held. The folder name carries the shard count, so an
`engine.data_parallel` parent (shard I of N) and its children (of N*data_parallel) never share one.

The folder is the bookkeeping folder beside output.dir (batchjob/io/layout.py: nothing but parts may live
in output.dir). A log file and Hydra's launcher write local files only, so for an object-store output.dir
it is `batchjob-logs/<scheme>/<path>.batchjob/` in the working directory instead.

Under a multirun, Hydra's `multirun.yaml` and the submitit launcher's logs go to `hydra.sweep.dir`:
`<that folder>/_hydra/multirun`, or `multirun/<date>_<time>` in the working directory when `output.dir` is
swept (there is then no single output.dir, and the default one would be a stray folder).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from omegaconf import DictConfig, OmegaConf

SWEEP_DIR_RESOLVER = "batchjob_sweep_dir"
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


def log_root(output_dir: str) -> str:
    """The local folder for this job's logs and configs: the bookkeeping folder beside a local output.dir,
    else `batchjob-logs/<scheme>/<path>.batchjob`. Never raises: a bad output.dir is the config check's to
    report, not a traceback from a resolver."""
    from batchjob.io.layout import BOOKKEEPING_SUFFIX, local_dir  # here: the IO package costs a second to import

    path = local_dir(str(output_dir))
    if path is None:
        scheme, _, path = str(output_dir).partition("://")
        path = os.path.join("batchjob-logs", scheme, path)
    return path.rstrip("/") + BOOKKEEPING_SUFFIX


def run_folder(output_dir: str, shard_index: int, shard_count: int) -> str:
    return os.path.join(hydra_dir(output_dir), f"shard-{shard_index}-of-{shard_count}")


def hydra_dir(output_dir: str) -> str:
    from batchjob.io.layout import HYDRA_DIR_NAME

    return os.path.join(log_root(output_dir), HYDRA_DIR_NAME)


def save_run_config(cfg: DictConfig, output_dir: str, shard_index: int, shard_count: int) -> None:
    """`.hydra/config.yaml` (resolved), `overrides.yaml` and `hydra.yaml`, as Hydra itself would save them.
    Only under `python -m batchjob`: a caller of run_job() with a composed config has no Hydra run."""
    from hydra.core.hydra_config import HydraConfig

    from batchjob.io.storage import Storage

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    storage, folder = Storage.for_uri(os.path.join(run_folder(output_dir, shard_index, shard_count), ".hydra"))
    storage.makedirs(folder)
    files = {
        "config.yaml": OmegaConf.to_yaml(cfg, resolve=True),
        "overrides.yaml": OmegaConf.to_yaml(hydra_cfg.overrides.task),
        "hydra.yaml": OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra_cfg})),
    }
    for name, text in files.items():
        storage.write_atomic(storage.join(folder, name), text.encode(), folder)


@contextlib.contextmanager
def recorded_run(cfg: DictConfig, output_dir: str, shard_index: int, shard_count: int) -> Iterator[None]:
    """Save the run's config, and copy every log line to `batchjob.log` beside it while the block runs
    (appended: the folder keeps the log of every attempt)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        yield
        return
    save_run_config(cfg, output_dir, shard_index, shard_count)
    handler = logging.FileHandler(os.path.join(run_folder(output_dir, shard_index, shard_count), "batchjob.log"))
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()


def _sweep_dir(started: str, *, _root_: DictConfig) -> str:
    """`started`: Hydra's cached `${now:...}`, the same for the sweeper, the launcher and submitit's tasks."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = OverridesParser.create().parse_overrides(list(_root_.hydra.overrides.task))
    swept = any(o.key_or_group in ("output", "output.dir") and o.is_sweep_override() for o in overrides)
    if swept:
        return f"multirun/{started}"
    return os.path.join(hydra_dir(str(_root_.output.dir)), "multirun")


def register_sweep_dir_resolver() -> None:
    if not OmegaConf.has_resolver(SWEEP_DIR_RESOLVER):
        OmegaConf.register_new_resolver(SWEEP_DIR_RESOLVER, _sweep_dir)
