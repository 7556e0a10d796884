"""Offline admission order: requests pulled within a bounded window are admitted sorted by prompt, so prompts
sharing a prefix run together and hit the prefix cache, and the outputs are those of input order."""

from __future__ import annotations

import numpy as np
import pytest

from batchjob.engine import Request, SamplingParams, create_engine
from batchjob.engine.native.scheduling.admission import AdmissionQueue
from batchjob.job.tiny_model import make_tiny_model


def _requests(prompts: list[tuple[int, ...]]) -> list[Request]:
    return [Request(i, p, SamplingParams(max_new_tokens=4, ignore_eos=True)) for i, p in enumerate(prompts)]


def _drain(queue: AdmissionQueue) -> list:
    order = []
    while (request := queue.pop()) is not None:
        order.append(request.id)
    return order


def test_window_zero_keeps_input_order():
    reqs = _requests([(5,), (1,), (3,)])
    assert _drain(AdmissionQueue(reqs, 0)) == [0, 1, 2]


def test_prompts_sharing_a_prefix_come_out_together():
    prompts = [(9, 9, i) if i % 2 else (1, 2, i) for i in range(8)]
    order = _drain(AdmissionQueue(_requests(prompts), 8))
    assert order == [0, 2, 4, 6, 1, 3, 5, 7]


def test_the_queue_pulls_at_most_its_window_ahead():
    pulled = []

    def source():
        for request in _requests([(i % 3, i) for i in range(20)]):
            pulled.append(request.id)
            yield request

    queue = AdmissionQueue(source(), 4)
    for taken in range(1, 21):
        queue.pop()
        assert len(pulled) == min(20, taken + 3)  # what was handed out plus at most a full window
        assert len(queue) <= 4


def test_the_sweep_wraps_round_so_every_request_comes_out_once():
    rng = np.random.default_rng(0)
    prompts = [tuple(int(t) for t in rng.integers(0, 4, 3)) for _ in range(50)]
    order = _drain(AdmissionQueue(_requests(prompts), 7))
    assert sorted(order) == list(range(50))


def test_a_negative_window_is_refused():
    with pytest.raises(ValueError, match="admission window"):
        AdmissionQueue([], -1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "llama", arch="llama")


def _interleaved_shared_prefixes() -> list[Request]:
    """Three 48-token prefixes, six requests each, interleaved with 18 prompts that share nothing."""
    rng = np.random.default_rng(3)
    prefixes = [tuple(int(t) for t in rng.integers(6, 500, 48)) for _ in range(3)]
    prompts = []
    for i in range(18):
        prompts.append(prefixes[i % 3] + tuple(int(t) for t in rng.integers(6, 500, 5)))
        prompts.append(tuple(int(t) for t in rng.integers(6, 500, 40)))
    return _requests(prompts)


def test_ordering_within_the_window_raises_prefix_hits_and_keeps_greedy_outputs(model_dir):
    requests = _interleaved_shared_prefixes()
    # Two sequences at a time and a small cache: in input order, a prefix's blocks are evicted before the
    # next request that shares it arrives.
    options = {"dtype": "float32", "max_num_seqs": 2, "num_kv_blocks": 14, "max_model_len": 64}
    results = {}
    for window in (0, 64):
        engine = create_engine("native", str(model_dir), {**options, "admission_window": window})
        results[window] = ({c.id: c.token_ids for c in engine.generate(requests)}, engine.stats())
    (in_order, in_order_stats), (sorted_, sorted_stats) = results[0], results[64]
    assert sorted_ == in_order
    assert sorted_stats["prefix_cache_hit_tokens"] >= 15 * 48  # all but the first of each prefix group
    assert sorted_stats["prefix_cache_hit_tokens"] > in_order_stats["prefix_cache_hit_tokens"]
    assert sorted_stats["tokens_fed"] < in_order_stats["tokens_fed"]
