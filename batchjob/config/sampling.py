"""The `sampling.*` and `pipeline.*` keys read into the engine's `SamplingParams` and the pipeline's `PromptSpec`:
stops, number types, structured-output constraints given inline, as files or as URLs, and the prompt's kind."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from batchjob.config.values import flag
from batchjob.engine import SamplingParams
from batchjob.engine.grammar import GrammarError, check_constraint
from batchjob.errors import ConfigError
from batchjob.pipelines.prompts import PROMPT_KINDS, PromptSpec

# What a `SamplingParams` number field accepts (its annotations are strings: `from __future__ import annotations`).
_NUMBERS = {"int": ((int,), "an integer"), "float": ((int, float), "a number"), "bool": ((bool,), "true or false")}


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


def sampler_mode_name(sampling: SamplingParams) -> str:
    """The one sampler mode (`engine.graph_sampling`) that rows sampling as `sampling` need."""
    if sampling.greedy:
        return "greedy"
    return "filtering" if sampling.filtered else "temperature"


def sampling_params(cfg: DictConfig) -> SamplingParams:
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


def prompt_spec(cfg: DictConfig) -> PromptSpec:
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
        add_special_tokens=flag(pipeline.add_special_tokens, "pipeline.add_special_tokens"),
    )


def check_constraints_supported(engine_cfg: dict[str, Any], sampling: SamplingParams, schema_column: Any) -> None:
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


def check_stops_apply(sampling: SamplingParams) -> None:
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
