"""Structured outputs through the hf backend (the same matchers and mask as the native engine): every `stop`
row satisfies its constraint, and a schema that cannot compile fails only its own request."""

from __future__ import annotations

import json

import pytest
import torch
from structured_cases import CHOICES, CODE_REGEX, PET_SCHEMA, check_stop_rows, matches_code, valid_json

from batchjob.engine import Request, SamplingParams, create_engine
from batchjob.job.tiny_model import default_tiny_model


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    engine = create_engine("hf", str(default_tiny_model()), {"max_batch_size": 12, "lookahead": 2})
    yield engine
    engine.close()


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_every_stopped_row_follows_its_json_schema_regex_or_choice(engine, temperature):
    kinds = [{"json_schema": json.dumps(PET_SCHEMA)}, {"regex": CODE_REGEX}, {"choice": CHOICES}]
    reqs = [
        Request(i, (6 + i, 30, 41), SamplingParams(160, temperature=temperature, seed=i, **kinds[i % 3]))
        for i in range(24)
    ]
    done = {c.id: c for c in engine.generate(reqs)}
    checks = [lambda t: valid_json(t, PET_SCHEMA), matches_code, lambda t: t in CHOICES]
    for k, check in enumerate(checks):
        assert check_stop_rows([done[r.id] for r in reqs if r.id % 3 == k], check) >= 0.8


def test_a_schema_that_cannot_compile_fails_only_its_own_request(engine):
    reqs = [
        Request(0, (6, 7), SamplingParams(20, json_schema='{"type": "object", "minProperties": "two"}')),
        Request(1, (6, 7), SamplingParams(20, choice=CHOICES)),
    ]
    done = {c.id: c for c in engine.generate(reqs)}
    assert done[0].finish_reason == "error" and "json_schema cannot be compiled" in done[0].error
    assert done[1].text in CHOICES


def test_stop_strings_and_stop_token_ids_never_cut_a_constrained_row(engine):
    # A JSON text holds '"' from its first key on: a stop there would leave "{" finishing `stop`, and a complete
    # text's strings could be cut at a "}" in them.
    quote_id = 7  # '"' in the tiny model's byte-level vocabulary
    stops = {"stop": ('"', "}"), "stop_token_ids": (quote_id,)}
    reqs = [
        Request(i, (6 + i, 30, 41), SamplingParams(160, json_schema=json.dumps(PET_SCHEMA), **stops)) for i in range(6)
    ]
    common = ("e", "a", " ")  # random text has one of these within a few tokens
    reqs.append(Request(6, (6, 30, 41), SamplingParams(160, temperature=1.0, seed=3, ignore_eos=True, stop=common)))
    done = {c.id: c for c in engine.generate(reqs)}
    assert check_stop_rows([done[i] for i in range(6)], lambda t: valid_json(t, PET_SCHEMA)) >= 0.8
    assert done[6].finish_reason == "stop" and not any(s in done[6].text for s in common)
