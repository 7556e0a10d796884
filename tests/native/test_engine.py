"""The native engine, end to end on CPU in fp32: its greedy output equals transformers' for every supported
family (prompts longer than the sliding windows included), whatever the scheduling (preemption, chunked
prefill, batch width, async or sync loop)."""

from __future__ import annotations

import pytest
import torch
from engine_cases import CASES, assert_each_request_as_alone, open_ended, per_request_settings
from engine_cases import hf_greedy as _hf_greedy
from engine_cases import mixed_requests as _requests
from engine_cases import with_stops as _with_stops
from transformers import AutoModelForCausalLM

from batchjob.engine import Request, SamplingParams, create_engine
from batchjob.job.tiny_model import make_tiny_model


def _run(model_dir, requests, engine: str = "native", **options) -> dict:
    eng = create_engine(engine, str(model_dir), {"dtype": "float32", **options})
    got = {c.id: c for c in eng.generate(requests)}
    eng.stats_seen = eng.stats()
    return got, eng


# A KV cache of 29 usable blocks of 4 tokens and 24-token steps: prompts are chunked and sequences preempted.
TIGHT = dict(num_kv_blocks=30, block_size=4, max_model_len=80, max_num_batched_tokens=24)


@pytest.fixture(scope="module", params=CASES)
def arch_case(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    model_dir = make_tiny_model(tmp_path_factory.mktemp("m") / request.param, arch=arch, **overrides)
    base = _requests(64, seed=1)
    reqs, expected = _with_stops(base, _hf_greedy(model_dir, base))
    return model_dir, reqs, expected


@pytest.mark.parametrize("engine", ["native", "native_sync"])
def test_greedy_equals_transformers_for_64_mixed_requests(arch_case, engine):
    model_dir, reqs, expected = arch_case
    got, _ = _run(model_dir, reqs, engine)
    assert {i: c.token_ids for i, c in got.items()} == expected
    reasons = {i: ("stop" if r.sampling.stop_token_ids else "length") for i, r in ((r.id, r) for r in reqs)}
    assert {i: c.finish_reason for i, c in got.items()} == reasons


def test_chunked_prefill_and_preemption_keep_greedy_output(arch_case, monkeypatch):
    model_dir, reqs, expected = arch_case
    open_ended(monkeypatch)
    got, eng = _run(model_dir, reqs, **TIGHT)
    assert {i: c.token_ids for i, c in got.items()} == expected
    assert eng.stats_seen["preemptions"] > 0


@pytest.fixture(scope="module")
def llama_case(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("m") / "llama", arch="llama")
    base = _requests(40, seed=2)
    reqs, expected = _with_stops(base, _hf_greedy(model_dir, base))
    return model_dir, reqs, expected


SCHEDULES = {
    "tiny cache: preemption": TIGHT,
    "no chunked prefill": dict(enable_chunked_prefill=False, max_num_batched_tokens=1024),
    "chunked prefill, 7-token budget": dict(max_num_batched_tokens=7),
    "one sequence at a time": dict(max_num_seqs=1),
    "64 sequences": dict(max_num_seqs=64),
    "block size 1, no prefix cache": dict(block_size=1, enable_prefix_caching=False, num_kv_blocks=3000),
    "poisoned slots": dict(debug_poison_slots=True),
}


@pytest.mark.parametrize("engine", ["native", "native_sync"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_does_not_change_greedy_output(llama_case, engine, schedule, monkeypatch):
    model_dir, reqs, expected = llama_case
    if schedule.startswith("tiny cache"):
        open_ended(monkeypatch)
    got, eng = _run(model_dir, reqs, engine, **SCHEDULES[schedule])
    assert {i: c.token_ids for i, c in got.items()} == expected
    if schedule.startswith("tiny cache"):
        assert eng.stats_seen["preemptions"] > 0


@pytest.mark.parametrize("engine", ["native", "native_sync"])
def test_rows_of_known_length_run_in_a_tiny_cache_without_preemption(llama_case, engine):
    model_dir, reqs, expected = llama_case
    known = [r for r in reqs if not r.sampling.stop_token_ids]  # EOS ignored, no stop: each runs to its length
    got, eng = _run(model_dir, known, engine, **TIGHT)
    assert {i: c.token_ids for i, c in got.items()} == {r.id: expected[r.id] for r in known}
    assert eng.stats_seen["preemptions"] == 0


def test_shared_prompt_prefix_is_computed_once_and_output_unchanged(llama_case):
    model_dir, _, _ = llama_case
    prefix = tuple(range(10, 74))
    reqs = [Request(i, prefix + (100 + i, 101 + i), SamplingParams(max_new_tokens=5)) for i in range(6)]
    expected = _hf_greedy(model_dir, reqs)
    got, eng = _run(model_dir, reqs, max_num_batched_tokens=70)
    assert {i: c.token_ids for i, c in got.items()} == expected
    # 64 shared tokens are 4 full blocks of 16: the 5 later requests feed none of them.
    unshared = sum(len(r.prompt_ids) + r.sampling.max_new_tokens - 1 for r in reqs)
    assert eng.stats_seen["tokens_fed"] == unshared - 5 * 64


def test_prefix_hash_collisions_never_change_output(llama_case, monkeypatch):
    model_dir, _, _ = llama_case
    # Every prompt block hashes alike: only the kept token ids can tell the cached blocks apart.
    monkeypatch.setattr("batchjob.engine.native.scheduling.sequence.block_hash", lambda previous, tokens: 0)
    reqs = [Request(i, tuple(range(10 + 40 * i, 50 + 40 * i)), SamplingParams(max_new_tokens=4)) for i in range(3)]
    got, _ = _run(model_dir, reqs, max_num_seqs=1)
    assert {i: c.token_ids for i, c in got.items()} == _hf_greedy(model_dir, reqs)


def _sampled(model_dir, reqs, **options):
    got, _ = _run(model_dir, reqs, **options)
    return {i: c.token_ids for i, c in got.items()}


def test_seeded_sampling_is_reproducible_across_runs_and_batch_compositions(llama_case):
    model_dir, _, _ = llama_case
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=7, ignore_eos=True)
    target = Request("target", (5, 6, 7, 8, 9), params)
    others = [
        Request(i, tuple(range(20, 20 + i + 2)), SamplingParams(max_new_tokens=9, temperature=1.0)) for i in range(9)
    ]
    alone = _sampled(model_dir, [target])["target"]
    assert _sampled(model_dir, [target])["target"] == alone
    assert _sampled(model_dir, others[:3] + [target] + others[3:])["target"] == alone
    assert _sampled(model_dir, others + [target], engine="native_sync", max_num_seqs=4)["target"] == alone
    other_seed = Request("target", target.prompt_ids, SamplingParams(**{**params.__dict__, "seed": 8}))
    assert _sampled(model_dir, [other_seed])["target"] != alone


def test_n_samples_share_the_prompt_and_differ(llama_case):
    model_dir, _, _ = llama_case
    req = Request(
        0, tuple(range(30, 70)), SamplingParams(max_new_tokens=10, temperature=1.0, n=4, seed=3, ignore_eos=True)
    )
    got, _ = _run(model_dir, [req])
    samples = got[0].samples
    assert len(samples) == 4
    assert len({s.token_ids for s in samples}) > 1
    assert all(len(s.token_ids) == 10 for s in samples)
    greedy = Request(1, req.prompt_ids, SamplingParams(max_new_tokens=6, n=2, ignore_eos=True))
    pair = _run(model_dir, [greedy])[0][1].samples
    assert pair[0].token_ids == pair[1].token_ids == _hf_greedy(model_dir, [greedy])[1]


@pytest.mark.parametrize("engine", ["native", "native_sync"])
def test_each_request_generates_with_its_own_settings(llama_case, engine):
    model_dir, _, _ = llama_case
    reqs = per_request_settings([tuple(range(30, 45)), tuple(range(50, 58)), (9, 8, 7)])
    eng = create_engine(engine, str(model_dir), {"dtype": "float32"})
    together = {c.id: c for c in eng.generate(reqs)}
    alone = {r.id: next(iter(eng.generate([r]))) for r in reqs}
    assert_each_request_as_alone(together, alone, reqs)


def test_top_k_sampling_never_leaves_the_top_k(llama_case):
    model_dir, _, _ = llama_case
    reqs = [
        Request(
            i,
            tuple(range(40 + i, 60 + i)),
            SamplingParams(max_new_tokens=16, temperature=1.5, top_k=3, logprobs=3, seed=i),
        )
        for i in range(8)
    ]
    got, _ = _run(model_dir, reqs)
    for c in got.values():
        sample = c.samples[0]
        for token, top in zip(sample.token_ids, sample.top_logprobs, strict=True):
            assert token in top


def test_stop_string_ends_the_text_exactly(llama_case):
    model_dir, _, _ = llama_case
    eng = create_engine("native", str(model_dir), {"dtype": "float32"})
    prompt = tuple(eng.tokenizer.encode("Write a short poem about owls."))
    full = next(iter(eng.generate([Request(0, prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))])))
    text = full.text
    assert len(text) > 12
    stop = text[8:11]
    cut = text.index(stop)
    stopped = next(iter(eng.generate([Request(0, prompt, SamplingParams(max_new_tokens=40, stop=(stop,)))])))
    assert stopped.text == text[:cut]
    assert stopped.finish_reason == "stop"
    assert len(stopped.token_ids) < len(full.token_ids)


def test_greedy_logprobs_are_the_models_log_softmax(llama_case):
    model_dir, _, _ = llama_case
    prompt = (11, 12, 13, 14)
    got, _ = _run(model_dir, [Request(0, prompt, SamplingParams(max_new_tokens=3, logprobs=0, ignore_eos=True))])
    sample = got[0].samples[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + sample.token_ids])
    with torch.no_grad():
        logp = hf(ids).logits[0].log_softmax(-1)
    for i, token in enumerate(sample.token_ids):
        assert sample.logprobs[i] == pytest.approx(logp[len(prompt) - 1 + i, token].item(), abs=1e-4)


def test_bad_requests_are_refused_one_by_one(llama_case):
    model_dir, _, _ = llama_case
    reqs = [
        Request("empty", (), SamplingParams(max_new_tokens=2)),
        Request("long", tuple([7] * 200), SamplingParams(max_new_tokens=2)),
        Request("vocab", (7, 100000), SamplingParams(max_new_tokens=2)),
        Request("fine", (7, 8), SamplingParams(max_new_tokens=2)),
    ]
    got, _ = _run(model_dir, reqs, max_model_len=100)
    assert "empty prompt" in got["empty"].error
    assert "context is 100 tokens" in got["long"].error
    assert "token ids" in got["vocab"].error
    assert got["fine"].error is None and len(got["fine"].token_ids) == 2


def test_context_limit_ends_generation_with_length(llama_case):
    model_dir, _, _ = llama_case
    got, _ = _run(
        model_dir,
        [Request(0, tuple(range(10, 40)), SamplingParams(max_new_tokens=100, ignore_eos=True))],
        max_model_len=36,
    )
    assert len(got[0].token_ids) == 6 and got[0].finish_reason == "length"


@pytest.mark.parametrize("window", [0, 16])
def test_requests_are_pulled_only_as_room_and_the_admission_window_allow(llama_case, window):
    model_dir, _, _ = llama_case
    pulled = []

    def source():
        for i in range(200):
            pulled.append(i)
            yield Request(i, (5, 6, 7), SamplingParams(max_new_tokens=2))

    options = {"dtype": "float32", "max_num_seqs": 8, "admission_window": window}
    eng = create_engine("native", str(model_dir), options)
    stream = eng.generate(source())
    next(stream)
    assert len(pulled) <= 8 + window + 1
    assert len(list(stream)) == 199


def test_unknown_engine_option_is_named_before_loading():
    with pytest.raises(ValueError, match="max_num_seq"):
        create_engine("native", "/nonexistent", {"max_num_seq": 3})


@pytest.mark.parametrize("engine", ["native", "native_sync"])
def test_an_abandoned_generate_leaves_the_engine_clean_for_the_next(llama_case, engine):
    model_dir, reqs, expected = llama_case
    eng = create_engine(engine, str(model_dir), {"dtype": "float32", "max_num_seqs": 8})
    stream = eng.generate(reqs)
    next(stream)
    stream.close()  # what a signal or an error in the consumer does mid-run
    assert eng.blocks.num_free == eng.blocks.num_blocks - 1
    got = {c.id: c.token_ids for c in eng.generate(reqs)}
    assert got == expected


def test_an_engine_option_of_the_wrong_type_is_named_before_loading():
    with pytest.raises(ValueError, match=r"engine.max_num_seqs='many': must be int"):
        create_engine("native", "/nonexistent", {"max_num_seqs": "many"})
    with pytest.raises(ValueError, match=r"engine.cuda_graphs=1: must be bool"):
        create_engine("native", "/nonexistent", {"cuda_graphs": 1})


def test_a_closed_engine_frees_its_runner_without_the_garbage_collector(llama_case):
    """The KV cache is most of a card: it must go when the engine closes, not when a collection happens to run
    (a second engine in the same process would otherwise find no memory)."""
    import gc
    import weakref

    model_dir = llama_case[0]
    eng = create_engine("native", str(model_dir), {"dtype": "float32", "device": "cpu"})
    list(eng.generate([Request(id=0, prompt_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=2))]))
    runner = weakref.ref(eng.runner)
    gc.disable()
    try:
        eng.close()
        assert runner() is None
    finally:
        gc.enable()


def test_a_run_leaves_start_up_objects_to_no_collection_and_close_hands_them_back(llama_case):
    """A full collection mid-run scans everything the process holds (imports, the model): a stall of the GPU.
    The run freezes what exists at its start; close unfreezes it, so a cycle made before the run that the engine
    later drops is still collected."""
    import gc
    import weakref

    class Node:
        pass

    model_dir = llama_case[0]
    eng = create_engine("native", str(model_dir), {"dtype": "float32", "device": "cpu"})
    gc.disable()  # no collection between dropping the cycle and the run's start
    try:
        cycle = Node()
        cycle.me = cycle
        dropped = weakref.ref(cycle)
        del cycle
        stream = eng.generate([Request(id=0, prompt_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=4))])
        next(stream)
    finally:
        gc.enable()
    assert gc.get_freeze_count() > 0
    gc.collect()
    assert dropped() is not None  # frozen: no collection looks at it during the run
    list(stream)
    # A later run freezes nothing more: what a caller makes between runs stays collectable.
    between = Node()
    between.me = between
    later = weakref.ref(between)
    del between
    list(eng.generate([Request(id=1, prompt_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=4))]))
    gc.collect()
    assert later() is None
    eng.close()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert dropped() is None


def test_a_dynamic_ntk_rope_model_generates_what_transformers_does_up_to_its_length_and_no_further(tmp_path):
    """transformers' "dynamic" rope raises theta once a forward call passes max_position_embeddings; the engine,
    which never runs past it, uses the default frequencies and must agree to the last position."""
    scaling = {"rope_type": "dynamic", "factor": 4.0}
    model_dir = make_tiny_model(tmp_path / "m", arch="llama", max_position_embeddings=64, rope_scaling=scaling)
    requests = [
        Request(0, tuple(range(10, 50)), SamplingParams(max_new_tokens=24, ignore_eos=True)),  # up to position 63
        Request(1, tuple(range(100, 107)), SamplingParams(max_new_tokens=12, ignore_eos=True)),
    ]
    got, _ = _run(model_dir, requests)
    assert {i: c.token_ids for i, c in got.items()} == _hf_greedy(model_dir, requests)
    with pytest.raises(ValueError, match="max_model_len=128 exceeds"):
        create_engine("native", str(model_dir), {"dtype": "float32", "max_model_len": 128})
