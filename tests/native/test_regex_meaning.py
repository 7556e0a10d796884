r"""`\d` means [0-9] in generation too: a tiny model whose vocabulary holds non-ASCII digits and spaces as whole
tokens ('۱', '١', '꩒', '𐴵', ..., a no-break space), which llguidance's own classes allow, sampled at temperature 1
under regexes and under a JSON schema's patterns, writes only ASCII digits, and every output matches with Python's
`re`, with re.ASCII (so `\s` wrote an ASCII space) and without (so `\D` wrote no digit of another script)."""

from __future__ import annotations

import json
import re

import llguidance
import numpy as np
import pytest
import torch
from structured_cases import check_stop_rows, valid_json
from transformers import AutoTokenizer

from batchjob.engine import Request, SamplingParams, create_engine
from batchjob.engine.api import Constraint
from batchjob.engine.grammar import GrammarCompiler, bitmask_words, grammar_text
from batchjob.engine.grammar_vocab import vocabulary_index
from batchjob.job.tiny_model import make_tiny_model, train_tokenizer

# Decimal digits (Unicode category Nd) of Arabic-Indic, Extended Arabic-Indic, Tai Tham, Hanifi Rohingya, NKo,
# Khmer and fullwidth forms; spaces to Python's Unicode \s and to JavaScript's.
NON_ASCII_DIGITS = ["۱", "١", "꩒", "𐴵", "٣", "߁", "០", "１"]
NON_ASCII_SPACES = ["\u00a0", "\u3000", "\u2028"]
CODE = r"[A-Z]{2}-\d{3,5}"
CODE_SCHEMA = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "pattern": r"^[A-Z]{2}-\d{3,5}$"},
        "label": {"type": "string", "pattern": r"^\D{2,4}$"},
        "pair": {"type": "string", "pattern": r"^[a-z]{1,3}\s[a-z]{1,3}$"},
    },
    "required": ["code", "label", "pair"],
    "additionalProperties": False,
}


def _matches_in_both_modes(pattern: str, text: str) -> bool:
    return bool(re.fullmatch(pattern, text) and re.fullmatch(pattern, text, re.ASCII))


def _ascii_digits_only(text: str) -> bool:
    return all(c.isascii() for c in text if c.isdigit() or c.isnumeric())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    tokenizer = train_tokenizer()
    added = NON_ASCII_DIGITS + NON_ASCII_SPACES
    assert tokenizer.add_tokens(added) == len(added)
    return str(make_tiny_model(tmp_path_factory.mktemp("digits") / "model", tokenizer=tokenizer))


def _run(model_dir: str, n: int, **constraint) -> list:
    engine = create_engine("native", model_dir, {"dtype": "float32"})
    requests = [
        Request(i, (6 + i % 40, 30, 41 + i), SamplingParams(60, temperature=1.0, seed=i, **constraint))
        for i in range(n)
    ]
    try:
        return list(engine.generate(requests))
    finally:
        engine.close()


def _mask(compiler: GrammarCompiler, matcher, vocab: int) -> set[int]:
    words = bitmask_words(vocab)
    bitmask = torch.zeros((1, words), dtype=torch.int32)
    if isinstance(matcher, llguidance.LLMatcher):
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), words * 4)
    else:
        compiler.fill_bitmasks([(matcher, 0)], bitmask)
    bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(bits).tolist())


@pytest.mark.parametrize(
    ("constraint", "kept_out"),
    [
        (Constraint("regex", r"\d+"), NON_ASCII_DIGITS),
        (Constraint("regex", r"\s+"), NON_ASCII_SPACES),
        # In a schema llguidance reads patterns as JavaScript does: \d is ASCII there, \D and \s are not.
        (Constraint("json_schema", json.dumps({"type": "string", "pattern": r"^\D+$"})), NON_ASCII_DIGITS),
        (Constraint("json_schema", json.dumps({"type": "string", "pattern": r"^\s+$"})), NON_ASCII_SPACES),
    ],
    ids=["regex-digits", "regex-spaces", "schema-non-digits", "schema-spaces"],
)
def test_the_vocabularys_non_ascii_tokens_are_allowed_by_llguidance_alone_and_kept_out_by_the_translation(
    model_dir, constraint, kept_out
):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = len(tokenizer)
    ids = set(tokenizer.convert_tokens_to_ids(kept_out))
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
    index = vocabulary_index(tokenizer, vocab, [tokenizer.eos_token_id])
    raw = llguidance.LLMatcher(index, grammar_text(constraint, translated=False), log_level=0)
    ours = compiler.matcher(constraint)
    if constraint.kind == "json_schema":  # into the string
        quote = tokenizer.convert_tokens_to_ids('"')
        assert raw.consume_token(quote) and ours.consume(quote)
    assert ids <= _mask(compiler, raw, vocab)
    assert not ids & _mask(compiler, ours, vocab)


@pytest.mark.parametrize("pattern", [CODE, r"\w{1,4}\s\D{1,4}"], ids=["code", "word-space-nondigits"])
def test_sampled_rows_under_a_regex_hold_only_ascii_digits_and_match_in_both_modes_of_re(model_dir, pattern):
    done = _run(model_dir, 64, regex=pattern)
    assert check_stop_rows(done, lambda text: _matches_in_both_modes(pattern, text)) == 1.0
    assert [c.text for c in done if not _ascii_digits_only(c.text)] == []


def test_sampled_rows_under_a_schemas_patterns_hold_only_ascii_digits_and_match_in_both_modes_of_re(model_dir):
    done = _run(model_dir, 32, json_schema=json.dumps(CODE_SCHEMA))

    def valid(text: str) -> bool:
        patterns = {k: v["pattern"] for k, v in CODE_SCHEMA["properties"].items()}
        return valid_json(text, CODE_SCHEMA) and all(
            _matches_in_both_modes(patterns[k], v) for k, v in json.loads(text).items()
        )

    assert check_stop_rows(done, valid) >= 0.9
    assert [c.text for c in done if not _ascii_digits_only(c.text)] == []
