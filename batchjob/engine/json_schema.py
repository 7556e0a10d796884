"""Reading a request's JSON schema: what is wrong with it, and its compact text (the key compiled grammars are
cached by). A job's rows mostly share a few schemas (one per job, or one per kind of record), each read for every
request that carries it: the last ones are kept, by text."""

from __future__ import annotations

import ast
import functools
import json

# JSON Schema's keywords (drafts 4 to 2020-12): a schema object without any of them constrains nothing.
_KEYWORDS = (
    "$schema $id id $ref $defs definitions $anchor $dynamicRef $dynamicAnchor $vocabulary $comment allOf anyOf "
    "oneOf not if then else dependentSchemas prefixItems items contains properties patternProperties "
    "additionalProperties propertyNames additionalItems dependencies unevaluatedItems unevaluatedProperties type "
    "enum const multipleOf maximum exclusiveMaximum minimum exclusiveMinimum maxLength minLength pattern maxItems "
    "minItems uniqueItems maxContains minContains maxProperties minProperties required dependentRequired format "
    "contentEncoding contentMediaType contentSchema title description default deprecated readOnly writeOnly "
    "examples"
)
SCHEMA_KEYWORDS = frozenset(_KEYWORDS.split())
KEYWORD_EXAMPLES = ("type", "properties", "enum", "$ref", "anyOf")


@functools.lru_cache(maxsize=64)
def schema_problem(text: str | bytes) -> str:
    """What is wrong with `text` as a JSON schema, or "" if nothing."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as err:
        if isinstance(_python_literal(text), dict):
            # str() of a dict, as a column written from pandas often holds
            return "json_schema is a Python dict's text (single quotes, True, None), not JSON: write it with json.dumps"
        return f"json_schema is not JSON text ({err})"
    if not isinstance(schema, (dict, bool)):
        return f"json_schema must be a JSON object, got {type(schema).__name__}"
    if isinstance(schema, dict) and schema and not SCHEMA_KEYWORDS.intersection(schema):
        # Unknown keys are ignored: such a "schema" allows any JSON value, which is never what was meant.
        keys = ", ".join(sorted(schema)[:5])
        if isinstance(schema.get("schema"), dict):
            return (
                f"json_schema has no schema keyword, only {keys}: it looks like the wrapper of an OpenAI "
                'response_format; give the schema inside it (its "schema" value)'
            )
        return (
            f"json_schema has no schema keyword ({', '.join(KEYWORD_EXAMPLES)}, ...), only {keys}: it looks like an "
            'example value, not a schema; e.g. {"type": "object", "properties": {"name": {"type": "string"}}}'
        )
    return ""


def _python_literal(text: str | bytes) -> object:
    try:
        return ast.literal_eval(text.decode() if isinstance(text, bytes) else text)
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError):
        return None


@functools.lru_cache(maxsize=64)
def compact_json(text: str) -> str:
    """`text` without free whitespace; key order is kept (properties are generated in the order a schema lists
    them)."""
    return json.dumps(json.loads(text), separators=(",", ":"))
