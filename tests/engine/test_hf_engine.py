"""The hf backend against the engine contract, on the real tiny model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from engine_cases import assert_each_request_as_alone, per_request_settings

from batchjob.engine import Completion, Request, SamplingParams, check_engine_options, create_engine
from batchjob.job.tiny_model import default_tiny_model

PROMPTS = ["Hello world", "Tell me a story about a dragon", "x", "What is 2+2?", "Write a haiku about rain"]


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    engine = create_engine("hf", str(default_tiny_model()), {"max_batch_size": 4, "lookahead": 1})
    yield engine
    engine.close()


def requests(engine, sampling: SamplingParams, prompts=PROMPTS) -> list[Request]:
    return [Request(i, engine.tokenizer(p)["input_ids"], sampling) for i, p in enumerate(prompts)]


def by_id(completions: Iterator[Completion]) -> dict:
    return {c.id: c for c in completions}


def test_every_request_completes_once_within_max_new_tokens(engine) -> None:
    done = by_id(engine.generate(requests(engine, SamplingParams(max_new_tokens=5, ignore_eos=True))))
    assert sorted(done) == list(range(len(PROMPTS)))
    for completion in done.values():
        assert len(completion.token_ids) == 5
        assert completion.finish_reason == "length"
        assert completion.text == engine.tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_greedy_is_deterministic(engine) -> None:
    sampling = SamplingParams(max_new_tokens=6)
    first = by_id(engine.generate(requests(engine, sampling)))
    again = by_id(engine.generate(requests(engine, sampling)))
    assert {i: c.token_ids for i, c in first.items()} == {i: c.token_ids for i, c in again.items()}


def test_seeded_sampling_does_not_depend_on_batch_composition(engine) -> None:
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, seed=11, n=2)
    batched = by_id(engine.generate(requests(engine, sampling)))
    alone = by_id(engine.generate(requests(engine, sampling)[2:3]))
    assert [s.token_ids for s in batched[2].samples] == [s.token_ids for s in alone[2].samples]
    assert batched[2].samples[0].token_ids != batched[2].samples[1].token_ids


def test_stop_token_ids_end_generation_and_are_not_in_the_text(engine) -> None:
    free = by_id(engine.generate(requests(engine, SamplingParams(max_new_tokens=6, ignore_eos=True))))
    stop_at = free[1].token_ids[2]
    sampling = SamplingParams(max_new_tokens=6, ignore_eos=True, stop_token_ids=(stop_at,))
    stopped = by_id(engine.generate(requests(engine, sampling)))[1]
    first = free[1].token_ids.index(stop_at)
    assert stopped.token_ids == free[1].token_ids[: first + 1]
    assert stopped.finish_reason == "stop"
    assert stopped.text == engine.tokenizer.decode(free[1].token_ids[:first], skip_special_tokens=True)


def test_stop_strings_trim_the_text(engine) -> None:
    free = by_id(engine.generate(requests(engine, SamplingParams(max_new_tokens=8, ignore_eos=True))))[3]
    stop = free.text[3:5]
    assert stop.strip(), "the tiny model's text should have a usable substring"
    stopped = by_id(engine.generate(requests(engine, SamplingParams(max_new_tokens=8, ignore_eos=True, stop=(stop,)))))[
        3
    ]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.find(stop)]


def test_prompt_longer_than_the_context_fails_only_that_request(engine) -> None:
    too_long = Request("long", [5] * engine.max_model_len, SamplingParams(max_new_tokens=2))
    fine = Request("fine", [5, 6, 7], SamplingParams(max_new_tokens=2))
    done = by_id(engine.generate([too_long, fine]))
    assert done["long"].error and str(engine.max_model_len) in done["long"].error
    assert done["long"].finish_reason == "error"
    assert done["fine"].error is None and done["fine"].completion_tokens >= 1


def test_logprobs_are_reported_per_token(engine) -> None:
    done = by_id(engine.generate(requests(engine, SamplingParams(max_new_tokens=3, ignore_eos=True, logprobs=2))))[0]
    sample = done.samples[0]
    assert len(sample.logprobs) == len(sample.token_ids) == 3
    for token, logprob, top in zip(sample.token_ids, sample.logprobs, sample.top_logprobs, strict=True):
        assert len(top) == 2
        assert logprob == pytest.approx(top[token])  # greedy: the chosen token is the most likely


def test_each_request_generates_with_its_own_settings(engine) -> None:
    prompts = [tuple(engine.tokenizer(p)["input_ids"]) for p in PROMPTS]
    reqs = per_request_settings(prompts)
    together = by_id(engine.generate(reqs))
    alone = {r.id: next(iter(engine.generate([r]))) for r in reqs}
    assert_each_request_as_alone(together, alone, reqs)


def test_requests_are_pulled_lazily(engine) -> None:
    pulled = []

    def source():
        for i in range(100):
            pulled.append(i)
            yield Request(i, [5, 6, 7], SamplingParams(max_new_tokens=1))

    first = next(iter(engine.generate(source())))
    assert first is not None
    assert len(pulled) <= engine.max_batch_size + 1


def test_unknown_options_are_refused_before_loading() -> None:
    with pytest.raises(ValueError, match="unknown hf engine option"):
        check_engine_options("hf", {"max_batch_sise": 8})


def test_the_cache_keyword_is_read_from_forward_not_guessed() -> None:
    # transformers 5.24 renamed forward(past_key_values=) to forward(cache=); a name forward() does not list
    # would be swallowed by **kwargs and the model would run without its KV cache.
    from batchjob.engine.hf import cache_keyword

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs): ...

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs): ...

    class Neither(torch.nn.Module):
        def forward(self, input_ids, **kwargs): ...

    assert cache_keyword(New()) == "cache"
    assert cache_keyword(Old()) == "past_key_values"
    with pytest.raises(TypeError, match="neither `cache` nor `past_key_values`"):
        cache_keyword(Neither())
