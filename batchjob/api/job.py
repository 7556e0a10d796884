"""`batchjob.run(...)`: a whole job from Python, through the command line's code path.

    import batchjob
    report = batchjob.run(model={"path": "/models/Llama-3.1-8B-Instruct"}, data={"path": "/data/prompts.parquet"},
                          output={"dir": "/scratch/run1"}, sampling={"max_new_tokens": 256})
    report = batchjob.run("engine=hf", "output.dir=/scratch/run2")          # command-line overrides work too
    report = batchjob.run({"output.dir": "/scratch/run3", "sampling.n": 2})  # or one dict, dotted or nested

Every argument becomes a Hydra override of the packaged config, composed exactly as `python -m batchjob`
composes it, and the job runs in this process (or, with `engine.data_parallel=N`, in N child processes).
A string value for a config group (`engine="hf"`, `model="qwen2.5-0.5b-instruct"`) picks that preset.
Mistakes raise `ConfigError` / `InputError` (what `python -m batchjob` reports with exit status 2); a job
that did not complete raises `JobIncomplete`; a complete job with more failed rows than `job.max_error_fraction`
allows raises `TooManyFailedRows` (exit status 3), which carries the report; otherwise the run's report is
returned, with `rows_this_call`: the rows this call generated (0 when the job was already complete).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig

from batchjob.cluster.data_parallel import plan_children, run_data_parallel
from batchjob.cluster.slurm import register_resolvers
from batchjob.config.keys import CONF_DIR, composition_error
from batchjob.config.settings import JobSettings, data_parallel, load_settings
from batchjob.errors import EXIT_TOO_MANY_FAILED, ConfigError
from batchjob.io.layout import ShardOutput, bookkeeping_dir
from batchjob.io.storage import Storage
from batchjob.job.failed_rows import exceeds
from batchjob.job.run import run_shard
from batchjob.job.startup import StartupClock

log = logging.getLogger("batchjob")


class JobIncomplete(RuntimeError):
    """The job stopped before its shard was complete (a signal, or a bad row under on_error=fail)."""

    def __init__(self, status: int) -> None:
        super().__init__(
            f"the job stopped with exit status {status} before it was complete: the committed rows are kept; "
            "run it again to resume"
        )
        self.status = status


class TooManyFailedRows(RuntimeError):
    """The job is complete (every row committed), but a larger share of its rows failed than
    `job.max_error_fraction` allows: what `python -m batchjob` exits 3 for. `report` is what `run` would have
    returned; its `failed_rows` counts them by reason."""

    def __init__(self, report: dict[str, Any], max_error_fraction: float) -> None:
        sections = [s["failed_rows"] for s in report.get("shards", [report])]
        over = [f for f in sections if exceeds(f, max_error_fraction)]
        failed, rows = sum(f["rows"] for f in over), sum(f["of_rows"] for f in over)
        where = f"in {len(over)} of {len(sections)} shards, " if len(sections) > 1 else ""
        super().__init__(
            f"{where}{failed} of {rows} rows failed, more than job.max_error_fraction={max_error_fraction:g} allows: "
            "every row is committed and the job is complete; the report's failed_rows (this exception's .report) "
            "and the output's error column say why. Fix the input and rerun with resume=false, or accept them with "
            "job.max_error_fraction=1"
        )
        self.report = report
        self.status = EXIT_TOO_MANY_FAILED


def overrides(*args: str | Mapping[str, Any], **kwargs: Any) -> list[str]:
    """Hydra override strings of `run`'s arguments: override strings as is, mappings flattened to dotted keys."""
    result: list[str] = []
    for arg in args:
        if isinstance(arg, str):
            result.append(arg)
        elif isinstance(arg, Mapping):
            result += _flatten(arg)
        else:
            raise TypeError(f"batchjob.run takes override strings and dicts, got {type(arg).__name__}")
    return result + _flatten(kwargs)


def _flatten(values: Mapping[str, Any], prefix: str = "") -> list[str]:
    result = []
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            result += _flatten(value, f"{name}.")
        elif not prefix and isinstance(value, str) and _is_group(name):
            result.append(f"{name}={value}")
        else:
            result.append(f"{name}={_value(value)}")
    return result


def _is_group(name: str) -> bool:
    return (CONF_DIR / name).is_dir()


def _value(value: Any) -> str:
    """A value in Hydra's override grammar: strings quoted (any character is safe inside), the rest as JSON."""
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, Path):
        return _value(str(value))
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def compose(*args: str | Mapping[str, Any], **kwargs: Any) -> DictConfig:
    """The job config `python -m batchjob` would run with these overrides; what the command line refuses while
    composing it (an unknown preset or key, a preset that is not YAML) is a `ConfigError` with the same message."""
    from hydra.errors import ConfigCompositionException, OverrideParseException
    from yaml import YAMLError

    register_resolvers()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return hydra_compose(config_name="config", overrides=overrides(*args, **kwargs))
    except (ConfigCompositionException, OverrideParseException, YAMLError) as err:
        raise ConfigError(composition_error(err)) from None


def run(*args: str | Mapping[str, Any], **kwargs: Any) -> dict[str, Any]:
    """Run a job to the end and return its report (`_report.json`'s content plus `rows_this_call`; with
    `engine.data_parallel=N`, `{"shards": [one report per GPU process], "rows_this_call": ...}`). Resumes like
    the command line does when rerun; a complete job generates nothing, and its report says `rows_this_call: 0`."""
    startup = StartupClock()
    cfg = compose(*args, **kwargs)
    processes = data_parallel(cfg)
    settings = load_settings(cfg)
    if processes > 1:
        children = plan_children(processes, settings.shard_index, settings.shard_count)
        shards = [(c.shard_index, c.shard_count) for c in children]
    else:
        shards = [(settings.shard_index, settings.shard_count)]
    before = [_stored_report(settings, shard) for shard in shards]
    if processes > 1:
        tensor_parallel = int(settings.engine_options.get("tensor_parallel", 1))
        status = run_data_parallel(
            overrides(*args, **kwargs), processes, settings.shard_index, settings.shard_count, tensor_parallel
        )
    else:
        status = run_shard(cfg, startup)
    if status not in (0, EXIT_TOO_MANY_FAILED):
        raise JobIncomplete(status)
    reports = []
    for shard, earlier in zip(shards, before, strict=True):
        stored = _stored_report(settings, shard)
        shard_report = json.loads(stored)
        # A shard that was complete already keeps its report as it was: this call generated none of its rows.
        shard_report["rows_this_call"] = shard_report["rows"] if stored != earlier else 0
        reports.append(shard_report)
    rows = sum(r["rows_this_call"] for r in reports)
    log.info("batchjob.run: %d rows generated by this call; %s", rows, settings.output.dir)
    report = reports[0] if processes == 1 else {"shards": reports, "rows_this_call": rows}
    if status == EXIT_TOO_MANY_FAILED:
        raise TooManyFailedRows(report, settings.max_error_fraction)
    return report


def _stored_report(settings: JobSettings, shard: tuple[int, int]) -> bytes | None:
    """Shard `shard`'s report file as it is stored (None before the shard first completes)."""
    storage, meta = Storage.for_uri(bookkeeping_dir(settings.output.dir))
    try:
        return storage.read_bytes(storage.join(meta, ShardOutput(settings.output.dir, *shard).report_name))
    except FileNotFoundError:
        return None
