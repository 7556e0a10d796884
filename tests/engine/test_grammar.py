"""The host side of structured outputs: the finer string slices give exactly the masks a mask computation
without any slices gives, along random walks through a schema with bounded strings; the vocabulary index built
beside start-up is the one the first constraint uses; a tokenizer and logits of different widths still index
(EOS ids beyond the tokenizer, added tokens beyond the logits); `scripts/dev/profile_masks.py` runs and finds no mask
that differs."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch
from structured_cases import PET_SCHEMA
from transformers import AutoTokenizer

from batchjob.engine.api import Constraint
from batchjob.engine.grammar import GrammarCompiler, GrammarError, bitmask_words, grammar_text
from batchjob.engine.grammar_vocab import STRING_SLICE_LENGTHS, string_slices
from batchjob.job.tiny_model import default_tiny_model


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_tiny_model())


def _allowed(bitmask: torch.Tensor, vocab: int) -> np.ndarray:
    return np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab].astype(bool)


def test_string_slices_replace_only_the_bounded_content_sets():
    general = llguidance.LLTokenizer.general_slices()
    slices = string_slices(general)
    assert slices[0] == general[0] and slices[-1] == general[-1]  # whitespace first, unbounded content last
    assert [s[s.rindex("{") :] for s in slices[1:-1]] == [f"{{1,{n}}}" for n in STRING_SLICE_LENGTHS]
    assert string_slices(["[a-z]+"]) == ["[a-z]+"]


@pytest.mark.parametrize("seed", range(4))
def test_masks_with_the_finer_slices_equal_masks_without_slices(tokenizer, seed):
    vocab = len(tokenizer)
    eos = [tokenizer.eos_token_id]
    # Strings bounded near the slice lengths: the walk crosses every slice as the characters left shrink.
    schema = {**PET_SCHEMA, "properties": {**PET_SCHEMA["properties"], "name": {"type": "string", "maxLength": 17}}}
    constraint = Constraint("json_schema", json.dumps(schema))
    compiler = GrammarCompiler(tokenizer, vocab, eos)
    plain = llguidance.LLMatcher(
        llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos, slices=[]),
        grammar_text(constraint),
        log_level=0,
    )
    sliced = compiler.matcher(constraint)
    rng = np.random.default_rng(seed)
    words = bitmask_words(vocab)
    for _ in range(120):
        got, want = torch.zeros((1, words), dtype=torch.int32), torch.zeros((1, words), dtype=torch.int32)
        compiler.fill_bitmasks([(sliced, 0)], got)
        plain.unsafe_compute_mask_ptr(want.data_ptr(), words * 4)
        assert torch.equal(got, want)
        allowed = np.flatnonzero(_allowed(want[0], vocab))
        token = int(rng.choice(allowed))
        assert compiler.consume([(sliced, token)]) == [True] and plain.consume_token(token)
        if plain.is_stopped():
            break
    assert plain.is_stopped(), "the walk should finish the schema within its budget"


@pytest.mark.parametrize("beyond_only", [True, False], ids=["only-beyond", "one-inside"])
def test_eos_ids_beyond_the_tokenizer_leave_the_grammar_its_own_eos(tokenizer, beyond_only):
    # The model's logits are 64 ids wider than its tokenizer, and its config names an EOS among those ids.
    vocab = len(tokenizer) + 64
    eos = [vocab - 3] if beyond_only else [vocab - 3, tokenizer.eos_token_id]
    compiler = GrammarCompiler(tokenizer, vocab, eos)
    matcher = compiler.matcher(Constraint("choice", json.dumps(["yes"])))
    forced = matcher.forced_tokens()
    assert forced and matcher.consume_forced(forced)
    bitmask = torch.zeros((1, bitmask_words(vocab)), dtype=torch.int32)
    compiler.fill_bitmasks([(matcher, 0)], bitmask)
    allowed = np.flatnonzero(_allowed(bitmask[0], vocab))
    # Complete: the tokenizer's EOS ends it, and nothing beyond the tokenizer is ever allowed.
    assert allowed.tolist() == [tokenizer.eos_token_id]


def test_added_tokens_beyond_the_logits_are_left_out_of_the_index(tokenizer):
    # A pad token appended to the tokenizer without resizing the model: the tokenizer has one id more than the
    # logits. Before, llguidance refused the tokenizer and the first constrained request failed the job.
    padded = copy.deepcopy(tokenizer)
    padded.add_special_tokens({"additional_special_tokens": ["<|extra_pad|>"]})
    vocab = len(tokenizer)
    assert len(padded) == vocab + 1
    compiler = GrammarCompiler(padded, vocab, [tokenizer.eos_token_id])
    matcher = compiler.matcher(Constraint("json_schema", json.dumps(PET_SCHEMA)))
    bitmask = torch.zeros((1, bitmask_words(vocab)), dtype=torch.int32)
    rng = np.random.default_rng(0)
    for _ in range(200):
        compiler.fill_bitmasks([(matcher, 0)], bitmask)
        allowed = np.flatnonzero(_allowed(bitmask[0], vocab))
        token = int(rng.choice(allowed))
        if token == tokenizer.eos_token_id:
            break
        assert compiler.consume([(matcher, token)]) == [True]
    assert matcher.is_stopped and token == tokenizer.eos_token_id


def test_a_tokenizer_whose_ordinary_tokens_pass_the_logits_fails_each_constrained_request_by_name(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer) - 10, [tokenizer.eos_token_id])
    with pytest.raises(GrammarError, match=f"tokenizer has {len(tokenizer)} ids and the model's logits"):
        compiler.matcher(Constraint("regex", "[a-z]{3}"))


def test_matchers_of_one_constraint_come_from_as_many_compiled_copies_as_lexers_in_turn(tokenizer):
    # Copies of one llguidance matcher share its lexer behind one lock; rows drawing from several compiled copies
    # fill their masks in parallel. The copies are the same grammar: every matcher allows the same tokens.
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    compiler.lexers = 3
    constraint = Constraint("json_schema", json.dumps(PET_SCHEMA))
    matchers = [compiler.matcher(constraint) for _ in range(7)]
    starts = compiler._cache[constraint].matchers
    assert len(starts) == 3 and compiler.compiled == 1 and compiler.cache_hits == 6
    bitmask = torch.zeros(len(matchers), compiler.words, dtype=torch.int32)
    compiler.fill_bitmasks([(m, i) for i, m in enumerate(matchers)], bitmask)
    assert all(torch.equal(bitmask[0], row) for row in bitmask)
    token = int(np.flatnonzero(_allowed(bitmask[0], len(tokenizer)))[0])
    assert all(m.consume(token) for m in matchers)
    compiler.fill_bitmasks([(m, i) for i, m in enumerate(matchers)], bitmask)
    assert all(torch.equal(bitmask[0], row) for row in bitmask)


def test_a_steps_matchers_advance_in_the_librarys_threads_as_they_do_one_by_one(tokenizer):
    # A step's rows are consumed in one parallel call: the same answers as one row at a time, a refused token
    # included, and every matcher left where one-by-one leaves it (the same masks next).
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    constraint = Constraint("json_schema", json.dumps(PET_SCHEMA))
    rng = np.random.default_rng(0)
    rows = 24
    parallel = [compiler.matcher(constraint) for _ in range(rows)]
    serial = [compiler.matcher(constraint) for _ in range(rows)]
    bitmask = torch.zeros(rows, compiler.words, dtype=torch.int32)
    for step in range(12):
        compiler.fill_bitmasks([(m, i) for i, m in enumerate(parallel)], bitmask)
        allowed = [np.flatnonzero(_allowed(row, len(tokenizer))) for row in bitmask]
        tokens = [int(rng.choice(a)) if len(a) else tokenizer.eos_token_id for a in allowed]
        if step == 5:  # a token the mask refuses
            tokens[3] = int(np.setdiff1d(np.arange(len(tokenizer)), allowed[3])[0])
        pairs = [(m, t) for m, t in zip(parallel, tokens, strict=True) if not m.is_stopped]
        expected = [m.consume(t) for m, t in zip(serial, tokens, strict=True) if not m.is_stopped]
        assert compiler.consume(pairs) == expected
        if step == 5:
            assert expected[3] is False
        after = torch.zeros_like(bitmask)
        compiler.fill_bitmasks([(m, i) for i, m in enumerate(serial)], after)
        compiler.fill_bitmasks([(m, i) for i, m in enumerate(parallel)], bitmask)
        assert torch.equal(bitmask, after)


def test_copies_of_a_shared_constraint_are_compiled_in_parallel_batches_doubling_as_rows_come(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    compiler.lexers, compiler.threads = 9, 4
    constraint = Constraint("json_schema", json.dumps(PET_SCHEMA))
    copies = []
    for _ in range(12):
        compiler.matcher(constraint)
        copies.append(len(compiler._cache[constraint].matchers))
    assert copies == [1, 2, 4, 4, 8, 8, 8, 8, 9, 9, 9, 9]
    # A constraint of one row is one compile.
    compiler.matcher(Constraint("regex", "[a-z]{3}"))
    assert len(compiler._cache[Constraint("regex", "[a-z]{3}")].matchers) == 1


def test_a_row_given_a_copy_still_compiling_waits_for_it_at_its_first_mask(tokenizer):
    # Admission never waits for copies of a shared constraint: they compile in the background (here held up
    # behind a blocked thread), and a matcher handed one resolves it when first used, with the same masks.
    import threading
    from concurrent.futures import ThreadPoolExecutor

    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    compiler.lexers = 5
    compiler._compiler = pool = ThreadPoolExecutor(1)
    release = threading.Event()
    pool.submit(release.wait)
    constraint = Constraint("json_schema", json.dumps(PET_SCHEMA))
    matchers = [compiler.matcher(constraint) for _ in range(6)]
    assert [m._compiling is not None for m in matchers] == [False, True, True, True, True, False]
    release.set()
    bitmask = torch.zeros(len(matchers), compiler.words, dtype=torch.int32)
    compiler.fill_bitmasks([(m, i) for i, m in enumerate(matchers)], bitmask)
    assert all(m._compiling is None for m in matchers)
    assert all(torch.equal(bitmask[0], row) for row in bitmask)
    assert len({id(m.inner) for m in matchers}) == 6  # each row its own copy of its compiled start
    compiler.close()


def test_the_engine_runs_more_lexers_than_mask_threads():
    from batchjob.engine.grammar import lexers_per_constraint, mask_threads

    assert 1 <= mask_threads() <= 32
    assert mask_threads(5) == 5  # engine.mask_threads
    assert all(lexers_per_constraint(n) > 2 * n and lexers_per_constraint(n) % 2 for n in (1, 12, 32))


def test_the_index_built_beside_start_up_is_the_one_constraints_use(tokenizer):
    from concurrent.futures import Future

    future: Future = Future()
    compiler = GrammarCompiler(None, len(tokenizer), [tokenizer.eos_token_id])
    compiler.prepare_beside(future)
    future.set_result(tokenizer)
    matcher = compiler.matcher(Constraint("regex", "[a-z]{3}"))
    assert compiler.tokenizer is tokenizer  # from the future, not loaded again from a model directory
    built = compiler._lltokenizer
    assert built is not None and compiler.matcher(Constraint("regex", "[0-9]+")) is not matcher
    assert compiler._lltokenizer is built


def test_the_mask_profile_script_finds_the_same_masks_with_every_slice_setting():
    script = Path(__file__).resolve().parents[2] / "scripts" / "dev" / "profile_masks.py"
    command = [sys.executable, str(script), "--tokenizer", str(default_tiny_model()), "--walks", "2", "--steps", "40"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "masks that differed: 0" in run.stdout and "slices engine" in run.stdout
    share = float(run.stdout.split("allowed share of the vocabulary: mean ")[1].split(";")[0])
    assert 0 < share < 1
