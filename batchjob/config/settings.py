"""The Hydra config, checked and turned into frozen values before anything heavy happens.

Every user mistake found here is a `ConfigError` naming the key, what was wrong and how to fix it; the
job turns it into a one-line message and exit status 2, before any model is loaded.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    InterpolationKeyError,
    InterpolationResolutionError,
    InterpolationToMissingValueError,
    MissingMandatoryValue,
    UnsupportedInterpolationType,
)

from batchjob.config.keys import check_known_keys
from batchjob.engine import SamplingParams, check_engine_options
from batchjob.engine.grammar import GrammarError, check_constraint
from batchjob.errors import ConfigError
from batchjob.io.layout import OutputDirError, bookkeeping_dir
from batchjob.io.openai_batch_reader import looks_like_openai_batch
from batchjob.io.storage import Storage
from batchjob.pipelines.prompts import PROMPT_KINDS, PromptSpec

BUNDLED_PROMPTS = Path(__file__).parents[1] / "data" / "sample_prompts.parquet"
ON_ERROR = ("record", "skip", "fail")
# What a `SamplingParams` number field accepts (its annotations are strings: `from __future__ import annotations`).
_NUMBERS = {"int": ((int,), "an integer"), "float": ((int, float), "a number"), "bool": ((bool,), "true or false")}


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


def _positive_int(value: Any, key: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key}={value!r}: must be an integer >= {minimum}")
    return value


def _seconds(value: Any, key: str, zero: bool = False, meaning: str = "") -> float:
    """A number of seconds, > 0 (or >= 0 with `zero`)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or (value == 0 and not zero):
        raise ConfigError(f"{key}={value!r}: must be a number of seconds {'>= 0' if zero else '> 0'}{meaning}")
    return float(value)


def _fraction(value: Any, key: str, meaning: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ConfigError(f"{key}={value!r}: must be a number from 0 to 1 ({meaning})")
    return float(value)


def _flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: must be true or false")
    return value


def _check_number(key: str, value: Any, annotation: str) -> None:
    """`sampling.max_new_tokens=abc` fails naming the key and the type, not deep inside a comparison."""
    base, _, optional = annotation.partition(" | ")
    if base not in _NUMBERS or (value is None and optional == "None"):
        return
    types, wanted = _NUMBERS[base]
    if value is None or (isinstance(value, bool) and base != "bool") or not isinstance(value, types):
        raise ConfigError(f"sampling.{key}={value!r}: must be {wanted}{' or null' if optional else ''}")


def _is_url(value: str) -> bool:
    """`s3://bucket/schema.json` and the like: a scheme, then no whitespace (grammar text has some)."""
    return re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*://\S+", value.strip()) is not None


def _text_or_file(value: Any, key: str, inline: bool) -> str | None:
    """`value` itself when `inline` says it is text, else the content of the file or URL (an object store's, as
    for data.path) it names."""
    if value is None or inline:
        return value
    if _is_url(str(value)):
        return _read_url(str(value).strip(), key)
    path = Path(str(value)).expanduser()
    if not path.is_file():
        raise ConfigError(f"{key}={value!r} is neither inline text nor an existing file: give the text or a path")
    return path.read_text()


def _read_url(url: str, key: str) -> str:
    from batchjob.io.access import StorageAccessError, access_reported
    from batchjob.io.storage import Storage

    try:
        with access_reported([url]):
            storage, path = Storage.for_uri(url)
            return storage.read_bytes(path).decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{key}={url!r}: no such object or file") from None
    except (StorageAccessError, UnicodeDecodeError, ValueError, ImportError) as err:
        raise ConfigError(f"{key}={url!r}: {err}") from None


def _constraint_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """sampling.json_schema (inline JSON, a YAML mapping, or a .json file), .regex, .choice, .grammar (inline
    Lark/GBNF or a file), as SamplingParams fields."""
    schema = raw.get("json_schema")
    if isinstance(schema, (dict, list, bool)):
        schema = json.dumps(schema)
    elif schema is not None:
        schema = _text_or_file(schema, "sampling.json_schema", inline=str(schema).lstrip().startswith("{"))
    grammar = raw.get("grammar")
    if grammar is not None:
        inline = not _is_url(str(grammar)) and not Path(str(grammar)).expanduser().is_file()
        grammar = _text_or_file(grammar, "sampling.grammar", inline=inline)
    choice = raw.get("choice")
    if isinstance(choice, str):
        # One choice would make every output the same; `sampling.choice="yes,no"` is also one string.
        example = ",".join(part.strip() for part in choice.split(",")) if "," in choice else f"{choice},..."
        raise ConfigError(
            f"sampling.choice={choice!r} is one string: give the choices as a list, sampling.choice=[{example}]"
        )
    return {
        "json_schema": schema,
        "grammar": grammar,
        "choice": None if choice is None else tuple(_choice_text(c) for c in choice),
    }


def _choice_text(value: Any) -> str:
    """A choice as the user wrote it: Hydra reads `sampling.choice=[true,false,null]` as YAML values, whose
    Python spelling ("True", "None") is not what was typed."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    return str(value)


def _sampler_mode_name(sampling: SamplingParams) -> str:
    """The one sampler mode (`engine.graph_sampling`) that rows sampling as `sampling` need."""
    if sampling.greedy:
        return "greedy"
    return "filtering" if sampling.filtered else "temperature"


def _sampling(cfg: DictConfig) -> SamplingParams:
    raw = OmegaConf.to_container(cfg.sampling, resolve=True)
    stop = raw.pop("stop", None) or []
    stop_ids = raw.pop("stop_token_ids", None) or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ConfigError(f"sampling.stop={stop!r}: must be a string or a list of strings")
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise ConfigError(f"sampling.stop_token_ids={stop_ids!r}: must be a list of token ids (integers)")
    fields = SamplingParams.__dataclass_fields__
    for key, value in raw.items():
        _check_number(key, value, str(fields[key].type))
    raw.update(_constraint_fields(raw))
    try:
        params = SamplingParams(**raw, stop=tuple(stop), stop_token_ids=tuple(stop_ids))
    except ValueError as err:
        raise ConfigError(f"{err} (fix the sampling.* override)") from err
    if params.constraint is not None:
        try:
            check_constraint(params.constraint)
        except GrammarError as err:
            raise ConfigError(f"sampling.{params.constraint.kind}: {err}") from err
    return params


def _prompt(cfg: DictConfig) -> PromptSpec:
    pipeline, data = cfg.pipeline, cfg.data
    kind = pipeline.kind
    if kind not in (*PROMPT_KINDS, "auto"):
        raise ConfigError(f"pipeline.kind={kind!r}: choose auto, {', '.join(PROMPT_KINDS)}")
    if kind == "auto":
        if data.messages_column or pipeline.system_prompt:
            kind = "chat"
        elif pipeline.template:
            kind = "template"
        else:
            kind = "raw"
    for key in ("template", "system_prompt"):
        if pipeline[key] is not None and not isinstance(pipeline[key], str):
            typed = _choice_text(pipeline[key])
            raise ConfigError(
                f"pipeline.{key}={typed}: must be text; quote it for Hydra inside the shell's quotes, "
                f"""'pipeline.{key}="{typed}"'"""
            )
    if kind == "template" and not pipeline.template:
        raise ConfigError('pipeline.kind=template needs pipeline.template, e.g. "Q: {question}\\nA:"')
    return PromptSpec(
        kind=kind,
        prompt_column=data.prompt_column,
        messages_column=data.messages_column,
        template=pipeline.template,
        system_prompt=pipeline.system_prompt,
        add_special_tokens=_flag(pipeline.add_special_tokens, "pipeline.add_special_tokens"),
    )


def _check_constraints_supported(engine_cfg: dict[str, Any], sampling: SamplingParams, schema_column: Any) -> None:
    """Structured outputs need the split step of a single-device engine; a tensor-parallel engine's ranks run
    whole steps only, so the combination is refused before any model loads."""
    tensor_parallel = engine_cfg.get("tensor_parallel", 1)
    if tensor_parallel == 1:
        return
    given = f"sampling.{sampling.constraint.kind}" if sampling.constraint is not None else None
    given = given or (f"data.json_schema_column={schema_column}" if schema_column else None)
    if given:
        raise ConfigError(
            f"{given}: structured outputs are not supported with engine.tensor_parallel={tensor_parallel}; set "
            "engine.tensor_parallel=1 (several engines: engine.data_parallel)"
        )


def _check_stops_apply(sampling: SamplingParams) -> None:
    """A constrained output ends where its constraint is complete, and ignores stop strings and stop token ids
    (they could only cut it short of valid): with a job-level constraint they would apply to no row."""
    if sampling.constraint is None:
        return
    for key, value in (("sampling.stop", sampling.stop), ("sampling.stop_token_ids", sampling.stop_token_ids)):
        if value:
            raise ConfigError(
                f"{key} with sampling.{sampling.constraint.kind}: a constrained output ends where its constraint "
                f"is complete and ignores stops, which could only cut it short of valid (a JSON text at a "
                f"'}}' inside a string), so here they would apply to no row; remove {key}"
            )


def check_resolvable(cfg: DictConfig) -> None:
    """Resolve every `${...}` of `cfg` once, so that one that cannot be resolved (a key or resolver that does not
    exist, an unset environment variable, a value left `???`) is a `ConfigError` naming the key and the fix, not
    OmegaConf's exception wherever the value is first read."""
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except (InterpolationResolutionError, MissingMandatoryValue) as err:
        raise ConfigError(_unresolvable(cfg, err)) from None


def _unresolvable(cfg: DictConfig, err: InterpolationResolutionError | MissingMandatoryValue) -> str:
    key = err.full_key
    # OmegaConf's first line says what failed; a resolver's own exception is rewrapped there without its cause.
    reason = str(err).splitlines()[0].split(" while resolving interpolation: ", 1)[-1].strip("\"'")
    named = re.search(r"'([^']*)'", reason) or re.search(r"(\S+)$", reason)
    if isinstance(err, MissingMandatoryValue):
        return f"{key} is not set (???): set {key}=VALUE"
    given = f"{key}={_raw_value(cfg, key)}"
    if isinstance(err, InterpolationToMissingValueError):
        return f"{given}: it refers to {named.group(1)}, which is not set (???): set {named.group(1)}=VALUE"
    if isinstance(err, InterpolationKeyError):
        return (
            f"{given}: the config has no key {named.group(1)} to refer to; give the value itself, or a key that "
            "`python -m batchjob --cfg job` shows (an environment variable: ${oc.env:NAME})"
        )
    if isinstance(err, UnsupportedInterpolationType):
        return (
            f"{given}: there is no resolver named {named.group(1)}; give the value itself (an environment "
            "variable: ${oc.env:NAME})"
        )
    if str(err).startswith(f"{ConfigError.__name__} raised"):  # batchjob's own resolvers say what to fix
        return f"{key}: {reason}"
    return f"{given} cannot be resolved ({reason}): give the value itself, or fix the interpolation"


def _raw_value(cfg: DictConfig, key: str) -> Any:
    """The value of dotted `key` (`a.b`, `a.b[0]`) as written, before resolving."""
    value: Any = OmegaConf.to_container(cfg, resolve=False)
    for part in re.findall(r"[^.\[\]]+", key):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return value


def data_parallel(cfg: DictConfig) -> int:
    """`engine.data_parallel`: GPU processes this command launches (batchjob/launch.py); 1 = run here."""
    check_resolvable(cfg)
    return _positive_int(cfg.engine.get("data_parallel", 1), "engine.data_parallel")


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
    shard_count = _positive_int(cfg.shard.count, "shard.count")
    shard_index = _positive_int(cfg.shard.index, "shard.index", minimum=0)
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
            f"data.passthrough_columns={_raw_value(cfg, 'data.passthrough_columns')}: give a list of column names, "
            """data.passthrough_columns=[a,b] ([] for none), quoting a name Hydra reads as a number: '["2024"]'"""
        )
    out = cfg.output
    if not out.dir:
        raise ConfigError("output.dir is empty: set output.dir=/path/to/results")
    commit_every_s = _seconds(out.commit_every_s, "output.commit_every_s")
    try:
        bookkeeping_dir(str(out.dir))
    except OutputDirError as err:
        raise ConfigError(str(err)) from None
    lock_timeout_s = _seconds(
        out.lock_timeout_s,
        "output.lock_timeout_s",
        meaning=" (e.g. 300); a lock not refreshed for this long is taken over",
    )
    log_every_s = _seconds(
        cfg.progress.log_every_s, "progress.log_every_s", zero=True, meaning=" (0: a line with every finished row)"
    )
    limit = data.limit
    if limit is not None:
        limit = _positive_int(limit, "data.limit", minimum=0)
    sampling = _sampling(cfg)
    _check_constraints_supported(engine_cfg, sampling, data.json_schema_column)
    _check_stops_apply(sampling)
    batch_file = _may_be_openai_batch(data.format, data.path)
    may_constrain = sampling.constraint is not None or data.json_schema_column or batch_file
    if not may_constrain and "graph_constrained" in engine_cfg:
        # No row of this job can carry a constraint: the graphs of its split steps would only cost start-up
        # (more than half the graphs a native engine captures).
        engine_cfg["graph_constrained"] = False
    if not batch_file and engine_cfg.get("graph_sampling") in (True, "all"):
        # Every row of this job samples alike (an OpenAI batch file may set a temperature per line): the graphs
        # of the other two sampler modes would be two thirds of the start-up's capture, never replayed.
        engine_cfg["graph_sampling"] = _sampler_mode_name(sampling)
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
            streaming=_flag(data.streaming, "data.streaming"),
            id_column=data.id_column,
            passthrough_columns=None if passthrough is None else tuple(passthrough),
            limit=limit,
            batch_rows=_positive_int(data.batch_rows, "data.batch_rows"),
            json_schema_column=data.json_schema_column,
        ),
        prompt=_prompt(cfg),
        sampling=sampling,
        output=OutputSettings(
            dir=str(out.dir),
            commit_every_rows=_positive_int(out.commit_every_rows, "output.commit_every_rows"),
            commit_every_s=commit_every_s,
            ordered=_flag(out.ordered, "output.ordered"),
            token_ids=_flag(out.token_ids, "output.token_ids"),
            overwrite=_flag(out.overwrite, "output.overwrite"),
            lock_timeout_s=lock_timeout_s,
        ),
        shard_index=shard_index,
        shard_count=shard_count,
        resume=_flag(cfg.resume, "resume"),
        on_error=on_error,
        max_error_fraction=_fraction(
            cfg.job.max_error_fraction,
            "job.max_error_fraction",
            "the largest share of failed rows a complete job exits 0 with; 1 turns the check off",
        ),
        log_every_s=log_every_s,
        tokenize_batch_rows=_positive_int(cfg.pipeline.tokenize_batch_rows, "pipeline.tokenize_batch_rows"),
        queue_batches=_positive_int(cfg.pipeline.queue_batches, "pipeline.queue_batches"),
    )
