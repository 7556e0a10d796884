"""The Hydra config, checked and turned into frozen values before anything heavy happens.

Every user mistake found here is a `ConfigError` naming the key, what was wrong and how to fix it; the
job turns it into a one-line message and exit status 2, before any model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from batchjob.config.interpolation import check_resolvable, raw_value
from batchjob.config.keys import check_known_keys
from batchjob.config.sampling import (
    check_constraints_supported,
    check_stops_apply,
    prompt_spec,
    sampler_mode_name,
    sampling_params,
)
from batchjob.config.values import flag, fraction, positive_int, seconds
from batchjob.engine import SamplingParams, check_engine_options
from batchjob.errors import ConfigError
from batchjob.io.layout import OutputDirError, bookkeeping_dir
from batchjob.io.openai_batch_reader import looks_like_openai_batch
from batchjob.io.storage import Storage
from batchjob.pipelines.prompts import PromptSpec

BUNDLED_PROMPTS = Path(__file__).parents[1] / "data" / "sample_prompts.parquet"
ON_ERROR = ("record", "skip", "fail")


@dataclass(frozen=True)
class DataSettings:
    path: str
    format: str
    split: str
    dataset_config: str | None
    data_files: Any
    streaming: bool
    id_column: str | None
    passthrough_columns: tuple[str, ...] | None
    limit: int | None
    batch_rows: int
    json_schema_column: str | None = None


@dataclass(frozen=True)
class OutputSettings:
    dir: str
    commit_every_rows: int
    commit_every_s: float
    ordered: bool
    token_ids: bool
    overwrite: bool
    lock_timeout_s: float


@dataclass(frozen=True)
class JobSettings:
    model_path: str | None
    engine_name: str  # the backend that runs the job, once `checks.choose_engine` resolved `engine=auto`
    engine_options: dict[str, Any]
    data: DataSettings
    prompt: PromptSpec
    sampling: SamplingParams
    output: OutputSettings
    shard_index: int
    shard_count: int
    resume: bool
    on_error: str
    max_error_fraction: float
    log_every_s: float
    tokenize_batch_rows: int
    queue_batches: int
    engine_asked: str | None = None  # the `engine=` the user gave, once `engine_name` was chosen for it


def data_parallel(cfg: DictConfig) -> int:
    """`engine.data_parallel`: GPU processes this command launches (batchjob/launch.py); 1 = run here."""
    check_resolvable(cfg)
    return positive_int(cfg.engine.get("data_parallel", 1), "engine.data_parallel")


def _may_be_openai_batch(data_format: str, path: Any) -> bool:
    """Whether the job reads an OpenAI batch file, whose lines each set their own sampling, `n` and response format
    (so the engine's graphs are not narrowed to the job's sampling): `data.format=openai_batch`, or under auto a
    .jsonl file whose first line is a batch request. One that cannot be opened here counts as one: the input
    checks report why later."""
    if data_format != "auto":
        return data_format == "openai_batch"
    if not path or not str(path).endswith(".jsonl"):
        return False
    try:
        storage, inner = Storage.for_uri(str(path))
        return looks_like_openai_batch(storage, inner)
    except Exception:  # noqa: BLE001 - unreadable here (missing, remote and unreachable): the input checks say why
        return True


def for_shard_rows(settings: JobSettings, rows: int | None) -> JobSettings:
    """`settings` for a shard of `rows` input rows (`data.limit` applied; None: unknown, as a stream's): no more
    sequences in flight (`engine.max_num_seqs`) than the rows make (x `sampling.n`), so a small job's engine
    captures and compiles only the steps it can run. Not for an OpenAI batch file, whose lines may set their own n,
    nor for an empty shard."""
    seqs = settings.engine_options.get("max_num_seqs")
    if not rows or isinstance(seqs, bool) or not isinstance(seqs, int):
        return settings
    if rows * settings.sampling.n >= seqs or _may_be_openai_batch(settings.data.format, settings.data.path):
        return settings
    return replace(settings, engine_options={**settings.engine_options, "max_num_seqs": rows * settings.sampling.n})


def load_settings(cfg: DictConfig) -> JobSettings:
    """Check `cfg` (and the engine options, through the backend's own check) without loading anything."""
    check_resolvable(cfg)
    check_known_keys(cfg)
    engine_cfg = OmegaConf.to_container(cfg.engine, resolve=True)
    engine_name = engine_cfg.pop("name", None)
    # A launcher setting, not a backend option: the launched processes each run one engine on one GPU.
    engine_cfg.pop("data_parallel", None)
    if not engine_name:
        raise ConfigError("engine.name is missing: pick a backend with engine=auto|native|native_sync|hf")
    try:
        check_engine_options(engine_name, engine_cfg)
    except (ValueError, ImportError) as err:
        raise ConfigError(f"engine={engine_name}: {err}") from err
    on_error = cfg.on_error
    if on_error not in ON_ERROR:
        raise ConfigError(f"on_error={on_error!r}: choose one of {', '.join(ON_ERROR)}")
    shard_count = positive_int(cfg.shard.count, "shard.count")
    shard_index = positive_int(cfg.shard.index, "shard.index", minimum=0)
    if shard_index >= shard_count:
        raise ConfigError(f"shard.index={shard_index} must be below shard.count={shard_count}")
    data = cfg.data
    for key, default in (("model.path", "the embedded tiny model"), ("data.path", "the bundled sample prompts")):
        value = OmegaConf.select(cfg, key)
        if isinstance(value, str) and not value.strip():
            # `data.path=$DATA` with DATA unset: the bundled prompts (for model.path: the working directory) would
            # run instead, and exit 0.
            raise ConfigError(f"{key} is empty (an unset shell variable?): set {key}=PATH, or {key}=null for {default}")
    passthrough = data.passthrough_columns
    if isinstance(passthrough, str):
        passthrough = [passthrough]
    listed = isinstance(passthrough, list) or OmegaConf.is_list(passthrough)
    if passthrough is not None and not (listed and all(isinstance(name, str) for name in passthrough)):
        raise ConfigError(
            f"data.passthrough_columns={raw_value(cfg, 'data.passthrough_columns')}: give a list of column names, "
            """data.passthrough_columns=[a,b] ([] for none), quoting a name Hydra reads as a number: '["2024"]'"""
        )
    out = cfg.output
    if not out.dir:
        raise ConfigError("output.dir is empty: set output.dir=/path/to/results")
    commit_every_s = seconds(out.commit_every_s, "output.commit_every_s")
    try:
        bookkeeping_dir(str(out.dir))
    except OutputDirError as err:
        raise ConfigError(str(err)) from None
    lock_timeout_s = seconds(
        out.lock_timeout_s,
        "output.lock_timeout_s",
        meaning=" (e.g. 300); a lock not refreshed for this long is taken over",
    )
    log_every_s = seconds(
        cfg.progress.log_every_s, "progress.log_every_s", zero=True, meaning=" (0: a line with every finished row)"
    )
    limit = data.limit
    if limit is not None:
        limit = positive_int(limit, "data.limit", minimum=0)
    sampling = sampling_params(cfg)
    check_constraints_supported(engine_cfg, sampling, data.json_schema_column)
    check_stops_apply(sampling)
    batch_file = _may_be_openai_batch(data.format, data.path)
    may_constrain = sampling.constraint is not None or data.json_schema_column or batch_file
    if not may_constrain and "graph_constrained" in engine_cfg:
        # No row of this job can carry a constraint: the graphs of its split steps would only cost start-up
        # (more than half the graphs a native engine captures).
        engine_cfg["graph_constrained"] = False
    if not batch_file and engine_cfg.get("graph_sampling") in (True, "all"):
        # Every row of this job samples alike (an OpenAI batch file may set a temperature per line): the graphs
        # of the other two sampler modes would be two thirds of the start-up's capture, never replayed.
        engine_cfg["graph_sampling"] = sampler_mode_name(sampling)
    return JobSettings(
        model_path=cfg.model.path,
        engine_name=engine_name,
        engine_options=engine_cfg,
        data=DataSettings(
            path=str(data.path) if data.path else str(BUNDLED_PROMPTS),
            format=data.format,
            split=data.split,
            dataset_config=data.dataset_config,
            data_files=OmegaConf.to_container(data.data_files)
            if OmegaConf.is_config(data.data_files)
            else data.data_files,
            streaming=flag(data.streaming, "data.streaming"),
            id_column=data.id_column,
            passthrough_columns=None if passthrough is None else tuple(passthrough),
            limit=limit,
            batch_rows=positive_int(data.batch_rows, "data.batch_rows"),
            json_schema_column=data.json_schema_column,
        ),
        prompt=prompt_spec(cfg),
        sampling=sampling,
        output=OutputSettings(
            dir=str(out.dir),
            commit_every_rows=positive_int(out.commit_every_rows, "output.commit_every_rows"),
            commit_every_s=commit_every_s,
            ordered=flag(out.ordered, "output.ordered"),
            token_ids=flag(out.token_ids, "output.token_ids"),
            overwrite=flag(out.overwrite, "output.overwrite"),
            lock_timeout_s=lock_timeout_s,
        ),
        shard_index=shard_index,
        shard_count=shard_count,
        resume=flag(cfg.resume, "resume"),
        on_error=on_error,
        max_error_fraction=fraction(
            cfg.job.max_error_fraction,
            "job.max_error_fraction",
            "the largest share of failed rows a complete job exits 0 with; 1 turns the check off",
        ),
        log_every_s=log_every_s,
        tokenize_batch_rows=positive_int(cfg.pipeline.tokenize_batch_rows, "pipeline.tokenize_batch_rows"),
        queue_batches=positive_int(cfg.pipeline.queue_batches, "pipeline.queue_batches"),
    )
