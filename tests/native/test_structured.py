"""Structured outputs in the native engine, on CPU with a tiny random model: every `stop` row satisfies its
constraint (JSON schema, regex, choice), most rows stop within max_new_tokens, per-row constraints mix with
unconstrained rows without touching them, async equals sync, and a schedule that chunks or preempts changes
nothing."""

from __future__ import annotations

import json
import shutil

import pytest
from structured_cases import CHOICES, PET_SCHEMA, POINT_SCHEMA, check_stop_rows, matches_code, valid_json

from batchjob.engine import Request, SamplingParams, create_engine
from batchjob.job.tiny_model import default_tiny_model

PET = json.dumps(PET_SCHEMA)
POINT = json.dumps(POINT_SCHEMA)


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(default_tiny_model())


def _run(model_dir: str, requests: list[Request], engine: str = "native", **options):
    eng = create_engine(engine, model_dir, {"dtype": "float32", **options})
    try:
        return {c.id: c for c in eng.generate(requests)}, eng.stats()
    finally:
        eng.close()


def _requests(n: int, temperature: float, max_new_tokens: int = 160, **constraint) -> list[Request]:
    return [
        Request(
            i, (6 + i % 40, 30, 41 + i), SamplingParams(max_new_tokens, temperature=temperature, seed=i, **constraint)
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_every_stopped_json_row_parses_and_validates(model_dir, temperature):
    done, stats = _run(model_dir, _requests(24, temperature, json_schema=PET))
    assert check_stop_rows(list(done.values()), lambda t: valid_json(t, PET_SCHEMA)) >= 0.8
    # Each step's masks began filling as soon as the step before had its tokens in the matchers.
    assert stats["constrained_steps_masked_early"] > 0 and stats["jump_forward_tokens"] == 0


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_with_jump_forward_rows_still_validate_and_async_equals_sync(model_dir, temperature):
    # The schema's keys and punctuation are forced: jump-forward appends them without a step of their own; the
    # next step's masks then wait until the whole step is processed.
    reqs = _mixed(temperature) + _requests(24, temperature, json_schema=PET)
    reqs = [Request(i, r.prompt_ids, r.sampling) for i, r in enumerate(reqs)]
    async_done, stats = _run(model_dir, reqs, "native", jump_forward=True)
    sync_done, _ = _run(model_dir, reqs, "native_sync", jump_forward=True)
    assert stats["jump_forward_tokens"] > 0 and stats["constrained_steps_masked_early"] == 0
    assert {i: c.token_ids for i, c in async_done.items()} == {i: c.token_ids for i, c in sync_done.items()}
    assert check_stop_rows([async_done[r.id] for r in reqs[-24:]], lambda t: valid_json(t, PET_SCHEMA)) >= 0.8


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_every_stopped_regex_row_matches_and_every_choice_row_is_a_choice(model_dir, temperature):
    reqs = _requests(12, temperature, regex=r"[a-z]{3}-[0-9]{2,3}")
    reqs += [Request(100 + r.id, r.prompt_ids, SamplingParams(20, choice=CHOICES, seed=r.id)) for r in reqs]
    done, _ = _run(model_dir, reqs)
    assert check_stop_rows([done[r.id] for r in reqs[:12]], matches_code) >= 0.8
    assert check_stop_rows([done[r.id] for r in reqs[12:]], lambda t: t in CHOICES) == 1.0


def _mixed(temperature: float) -> list[Request]:
    """Per-row schemas, a regex and unconstrained rows in one batch."""
    out = []
    for i in range(30):
        kind = ({"json_schema": PET}, {"json_schema": POINT}, {"regex": r"[a-z]{3}-[0-9]{2,3}"}, {})[i % 4]
        params = SamplingParams(60, temperature=temperature, seed=i, ignore_eos=not kind, **kind)
        out.append(Request(i, (7 + i, 33, 50 + i % 9), params))
    return out


def test_constrained_and_unconstrained_rows_share_a_batch_without_touching_each_other(model_dir):
    reqs = _mixed(0.9)
    done, stats = _run(model_dir, reqs)
    alone, _ = _run(model_dir, [r for r in reqs if r.sampling.constraint is None])
    for r in reqs:
        c = done[r.id]
        if r.sampling.constraint is None:
            assert c.token_ids == alone[r.id].token_ids  # masks never reach another row
        elif c.finish_reason == "stop":
            schema = json.loads(r.sampling.json_schema) if r.sampling.json_schema else None
            assert valid_json(c.text, schema) if schema else matches_code(c.text), repr(c.text)
    assert stats["constrained_steps"] > 0 and stats["grammars_compiled"] == 3


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_async_equals_sync_with_constrained_rows(model_dir, temperature):
    reqs = _mixed(temperature)
    async_done, _ = _run(model_dir, reqs, "native")
    sync_done, _ = _run(model_dir, reqs, "native_sync")
    assert {i: c.token_ids for i, c in async_done.items()} == {i: c.token_ids for i, c in sync_done.items()}


def test_the_loop_polls_for_filled_masks_between_pieces_of_its_work(model_dir):
    """A step's sampler goes to the GPU once its masks are filled, at the loop's next poll: after admitting, after
    scheduling, and every few dozen sequences it processes (the enqueue itself: test_step_masks.py)."""
    reqs = _mixed(0.0) + [Request(100 + i, (9, 31, 40 + i), SamplingParams(30, ignore_eos=True)) for i in range(40)]
    eng = create_engine("native", model_dir, {"dtype": "float32"})
    polls = []
    poll = eng.masks.poll
    eng.masks.poll = lambda: (polls.append(len(eng.scheduler.running)), poll())
    try:
        done = {c.id: c.token_ids for c in eng.generate(reqs)}
        stats = eng.stats()
    finally:
        eng.close()
    sync_done, _ = _run(model_dir, reqs, "native_sync")
    assert done == {i: c.token_ids for i, c in sync_done.items()}
    assert len(polls) >= 2 * stats["steps"]  # after admitting and after scheduling, every step
    assert len(polls) > 2 * stats["steps"] + 10  # and inside the processing of the steps of 32 sequences or more
    assert 0 <= stats["constrained_steps_sampled_at_poll"] <= stats["constrained_steps"]


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_constrained_rows_that_sit_out_a_step_generate_what_sync_does(model_dir, temperature):
    reqs = _mixed(temperature) + _requests(12, temperature, max_new_tokens=80, json_schema=PET)
    reqs = [Request(i, r.prompt_ids, r.sampling) for i, r in enumerate(reqs)]
    lagged, stats = _run(model_dir, reqs, "native", constrained_lag=True)
    plain, plain_stats = _run(model_dir, reqs, "native")
    sync_done, _ = _run(model_dir, reqs, "native_sync", constrained_lag=True)
    assert {i: c.token_ids for i, c in lagged.items()} == {i: c.token_ids for i, c in sync_done.items()}
    assert {i: c.token_ids for i, c in lagged.items()} == {i: c.token_ids for i, c in plain.items()}
    # The masks of most constrained steps began at launch, beside the processing of the step before.
    assert stats["constrained_steps_masked_at_launch"] > stats["constrained_steps"] // 2
    assert plain_stats["constrained_steps_masked_at_launch"] == 0
    check_stop_rows([lagged[r.id] for r in reqs if r.sampling.json_schema == PET], lambda t: valid_json(t, PET_SCHEMA))


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_masks_filled_chunk_by_chunk_generate_what_sync_does(model_dir, temperature, chunk):
    # Each chunk of processed rows sends its masks of the step in flight at once, in a call of its own.
    reqs = _mixed(temperature) + _requests(12, temperature, max_new_tokens=80, json_schema=PET)
    reqs = [Request(i, r.prompt_ids, r.sampling) for i, r in enumerate(reqs)]
    chunked, stats = _run(model_dir, reqs, "native", mask_chunk_rows=chunk)
    sync_done, _ = _run(model_dir, reqs, "native_sync", mask_chunk_rows=chunk)
    assert {i: c.token_ids for i, c in chunked.items()} == {i: c.token_ids for i, c in sync_done.items()}
    assert stats["constrained_steps"] > 0 and stats["mask_ms_per_constrained_step"] > 0
    # Small chunks split most steps' masks into several calls; one chunk of 64 holds every row here.
    assert (stats["mask_calls_per_constrained_step"] > 1.5) == (chunk < 64)
    check_stop_rows([chunked[r.id] for r in reqs if r.sampling.json_schema == PET], lambda t: valid_json(t, PET_SCHEMA))


def test_a_negative_mask_chunk_is_refused_before_loading(model_dir):
    with pytest.raises(ValueError, match="engine.mask_chunk_rows=-1: must be >= 0"):
        create_engine("native", model_dir, {"mask_chunk_rows": -1})
    with pytest.raises(ValueError, match="engine.mask_threads=-2: must be >= 0"):
        create_engine("native", model_dir, {"mask_threads": -2})


def test_mask_threads_sets_the_grammar_library_threads_and_lexer_copies(model_dir):
    engine = create_engine("native", model_dir, {"dtype": "float32", "mask_threads": 3})
    try:
        assert (engine.grammars.threads, engine.grammars.lexers) == (3, 13)
        reqs = _requests(6, 0.0, json_schema=PET)
        done = {c.id: c for c in engine.generate(reqs)}
    finally:
        engine.close()
    assert check_stop_rows([done[r.id] for r in reqs], lambda t: valid_json(t, PET_SCHEMA)) > 0


@pytest.mark.parametrize(
    "schedule",
    [
        dict(max_num_batched_tokens=7),  # forced-token chunks split over steps
        dict(num_kv_blocks=30, block_size=4, max_model_len=100, max_num_batched_tokens=24),  # preemption
        dict(debug_poison_slots=True),  # an unfilled bitmask row would forbid every token
        dict(constrained_lag=True, num_kv_blocks=30, block_size=4, max_model_len=100, max_num_batched_tokens=24),
        dict(mask_chunk_rows=3, num_kv_blocks=30, block_size=4, max_model_len=100, max_num_batched_tokens=24),
        dict(mask_chunk_rows=2, debug_poison_slots=True),
    ],
    ids=[
        "7-token budget",
        "tiny cache: preemption",
        "poisoned slots",
        "sitting out steps, with preemption",
        "masks in chunks, with preemption",
        "masks in chunks, poisoned slots",
    ],
)
def test_schedule_does_not_change_constrained_greedy_output(model_dir, schedule):
    reqs = _requests(10, 0.0, max_new_tokens=80, json_schema=PET)
    expected, _ = _run(model_dir, reqs)
    got, stats = _run(model_dir, reqs, **schedule)
    assert {i: c.token_ids for i, c in got.items()} == {i: c.token_ids for i, c in expected.items()}
    if "num_kv_blocks" in schedule:
        assert stats["preemptions"] > 0


def test_one_string_given_as_the_choices_is_refused_naming_the_list_form():
    # A string is a sequence of one-letter strings: taken as it is, the output would be one letter of it.
    with pytest.raises(ValueError, match=r"choice must be a list of strings, not one string \('yes'\)"):
        SamplingParams(8, choice="yes")


def test_an_example_value_or_a_python_dict_given_as_the_schema_is_refused():
    # Unknown keys are ignored by JSON Schema: {"name": "Alice"} would allow any JSON value at all.
    with pytest.raises(ValueError, match="only age, name: it looks like an example value, not a schema"):
        SamplingParams(8, json_schema={"name": "Alice", "age": 30})
    with pytest.raises(ValueError, match="the wrapper of an OpenAI response_format"):
        SamplingParams(8, json_schema={"name": "pet", "strict": True, "schema": PET_SCHEMA})
    # str() of a dict, as a column written from pandas can hold
    with pytest.raises(ValueError, match="a Python dict's text .*, not JSON: write it with json.dumps"):
        SamplingParams(8, json_schema=str(PET_SCHEMA))
    for schema in ({}, True, {"title": "anything"}, {"$ref": "#/$defs/a", "$defs": {"a": {"type": "string"}}}):
        assert SamplingParams(8, json_schema=schema).constraint is not None


def test_what_a_caller_naturally_writes_is_taken_as_meant(model_dir):
    # A schema as a dict, one stop string, one stop token id, a list of choices: as their usual forms.
    assert SamplingParams(8, json_schema=PET_SCHEMA) == SamplingParams(8, json_schema=json.dumps(PET_SCHEMA))
    assert SamplingParams(8, stop="END", stop_token_ids=5) == SamplingParams(8, stop=("END",), stop_token_ids=(5,))
    assert SamplingParams(8, choice=list(CHOICES)).constraint == SamplingParams(8, choice=CHOICES).constraint
    as_dict = [Request(0, (6, 7, 8), SamplingParams(60, json_schema=PET_SCHEMA))]
    as_text = [Request(0, (6, 7, 8), SamplingParams(60, json_schema=PET))]
    assert _run(model_dir, as_dict)[0][0].token_ids == _run(model_dir, as_text)[0][0].token_ids


def test_a_schema_that_cannot_compile_fails_only_its_own_request(model_dir):
    reqs = [
        Request(0, (6, 7), SamplingParams(30, json_schema='{"type": "object", "minProperties": "two"}')),
        Request(1, (6, 7), SamplingParams(30, regex="(unclosed")),
        Request(2, (6, 7), SamplingParams(30, json_schema=POINT)),
    ]
    done, _ = _run(model_dir, reqs)
    assert done[0].finish_reason == "error" and "json_schema cannot be compiled" in done[0].error
    assert done[1].finish_reason == "error" and "regex cannot be compiled" in done[1].error
    assert done[2].error is None and valid_json(done[2].text, POINT_SCHEMA)


def test_a_tokenizer_with_a_pad_token_beyond_the_logits_still_constrains(model_dir, tmp_path):
    # A pad token appended to the tokenizer without resizing the model (as some fine-tunes ship): one id more
    # than the logits. The constrained rows must still run and stop valid, not fail the job.
    from transformers import AutoTokenizer

    copied = tmp_path / "padded"
    shutil.copytree(model_dir, copied)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"pad_token": "<|extra_pad|>"})
    tokenizer.save_pretrained(copied)
    done, stats = _run(str(copied), _requests(8, 0.0, json_schema=PET))
    assert check_stop_rows(list(done.values()), lambda t: valid_json(t, PET_SCHEMA)) >= 0.8
    assert stats["constrained_steps"] > 0


def test_n_samples_each_follow_the_constraint(model_dir):
    req = Request(0, (9, 10, 11), SamplingParams(40, temperature=1.0, seed=3, n=4, choice=CHOICES))
    done, _ = _run(model_dir, [req])
    assert [s.text in CHOICES for s in done[0].samples] == [True] * 4


def test_logprob_requests_get_one_logprob_per_token_under_a_constraint(model_dir):
    params = [SamplingParams(80, temperature=1.0, seed=i, logprobs=1, json_schema=POINT) for i in range(4)]
    done, _ = _run(model_dir, [Request(i, (6 + i, 30, 41), p) for i, p in enumerate(params)])
    for c in done.values():
        assert len(c.samples[0].logprobs) == len(c.token_ids) and valid_json(c.text, POINT_SCHEMA)


def test_an_engine_that_does_not_detokenize_loads_the_tokenizer_for_its_first_constraint(model_dir):
    reqs = _requests(4, 0.0, max_new_tokens=20, regex=r"[a-z]{3}-[0-9]{2,3}")
    done, stats = _run(model_dir, reqs, detokenize=False)
    with_text, _ = _run(model_dir, reqs)
    assert {i: c.token_ids for i, c in done.items()} == {i: c.token_ids for i, c in with_text.items()}
    assert stats["constrained_steps"] > 0


def test_constrained_steps_padded_to_split_graph_shapes_generate_what_unpadded_steps_do(model_dir):
    """Jump-forward chunks make most constrained steps mixed: laid out for the split halves of mixed and decode
    graphs (run eagerly on the CPU at the graph's padded shape), they sample exactly the same tokens."""
    from batchjob.engine.native.runtime.step_layout import GRAPH_MODES, GraphBuckets

    reqs = _mixed(0.9)
    expected, _ = _run(model_dir, reqs, max_num_seqs=16)
    every = frozenset(GRAPH_MODES)
    eng = create_engine("native", model_dir, {"dtype": "float32", "max_num_seqs": 16})
    runner = eng.runner
    # Buckets as a GPU runner would have captured them, split halves included.
    runner.graphs.buckets = GraphBuckets(
        decode=(4, 16),
        modes=every,
        masked_modes=every,
        mixed=(64, 128),
        mixed_modes=every,
        mixed_masked_modes=every,
        mixed_seqs=16,
    )
    shapes = []
    prepare = runner.prepare

    def prepare_and_record(plan):
        prepared = prepare(plan)
        shapes.append((prepared.masked_rows, prepared.layout))
        return prepared

    runner.prepare = prepare_and_record
    try:
        got = {c.id: c.token_ids for c in eng.generate(reqs)}
    finally:
        eng.close()
    assert got == {i: c.token_ids for i, c in expected.items()}
    assert any(masked and layout.mixed and layout.shape.tokens == 64 for masked, layout in shapes)
    assert any(masked and not layout.mixed and layout.bucket == 16 for masked, layout in shapes)


@pytest.mark.parametrize("engine", ["native", "native_sync"])
def test_stop_strings_and_stop_token_ids_never_cut_a_constrained_row(model_dir, engine):
    # A JSON text holds '"' from its first key on: a stop there would leave "{" finishing `stop`. A constrained
    # row ends where its constraint is complete instead; an unconstrained row beside it still stops.
    quote_id = 7  # '"' in the tiny model's byte-level vocabulary
    stops = {"stop": ('"', "}"), "stop_token_ids": (quote_id,)}
    reqs = _requests(12, 0.0, json_schema=PET, **stops)
    common = ("e", "a", " ")  # random text has one of these within a few tokens
    reqs.append(Request(12, (6, 30, 41), SamplingParams(160, temperature=1.0, seed=3, ignore_eos=True, stop=common)))
    done, _ = _run(model_dir, reqs, engine)
    assert check_stop_rows([done[i] for i in range(12)], lambda t: valid_json(t, PET_SCHEMA)) >= 0.8
    free = done[12]
    assert free.finish_reason == "stop" and not any(s in free.text for s in common)
