"""Mixed prefill+decode steps replay CUDA graphs: in a run with chunked prefill, every step without
log-probabilities is a graph replay (mixed steps by token-count bucket), and fp32 greedy output equals the run
with mixed graphs off and transformers', for a dense, a sliding-window and an MoE family; sampled runs, and runs
where log-probability steps stay eager, equal mixed graphs off too.

Run on a machine with a CUDA GPU:  python -m pytest tests/gpu/test_mixed_graphs_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from engine_cases import hf_greedy, mixed_requests  # noqa: E402

from batchjob.engine import Request, SamplingParams, create_engine  # noqa: E402
from batchjob.job.tiny_model import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.gpu

# 512-token steps: mixed buckets of 256 and 512 tokens; prompts up to 300 tokens chunk beside decodes.
OPTIONS = {"dtype": "float32", "max_num_seqs": 32, "max_num_batched_tokens": 512}


def _run(model_dir, requests, **options) -> tuple[dict, dict]:
    engine = create_engine("native", str(model_dir), {**OPTIONS, **options})
    try:
        completions = {c.id: c for c in engine.generate(requests)}
        return completions, engine.stats()
    finally:
        engine.close()


def _tokens(completions: dict) -> dict:
    return {i: c.token_ids for i, c in completions.items()}


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_moe"])
def test_every_step_of_a_greedy_mixed_run_replays_a_graph_and_equals_transformers(tmp_path, arch):
    model_dir = make_tiny_model(tmp_path / arch, arch=arch)
    requests = mixed_requests(60, seed=9, max_prompt=300, max_new=24)
    expected = hf_greedy(model_dir, requests, device="cuda")

    graphed, stats = _run(model_dir, requests)
    eager, eager_stats = _run(model_dir, requests, graph_mixed=False)

    assert stats["mixed_graph_modes"] == 3
    assert stats["eager_steps"] == 0 and stats["graph_steps"] == stats["steps"]
    assert 0 < stats["mixed_graph_steps"] < stats["steps"]
    assert eager_stats["mixed_graph_steps"] == 0 and eager_stats["eager_steps"] > 0
    assert _tokens(graphed) == _tokens(eager) == expected


def test_sampled_mixed_steps_replay_graphs_and_only_log_probability_steps_run_eagerly(tmp_path):
    model_dir = make_tiny_model(tmp_path / "llama", arch="llama")
    modes = [dict(temperature=0.8), dict(temperature=0.8, top_p=0.9), dict(temperature=0.7, top_k=20, min_p=0.05)]
    prompts = [r.prompt_ids for r in mixed_requests(48, seed=11, max_prompt=300)]
    sampled = [
        Request(i, prompt, SamplingParams(max_new_tokens=16, ignore_eos=True, seed=i, **modes[i % 3]))
        for i, prompt in enumerate(prompts)
    ]

    graphed, stats = _run(model_dir, sampled)
    eager, _ = _run(model_dir, sampled, graph_mixed=False)
    assert stats["eager_steps"] == 0 and stats["mixed_graph_steps"] > 0
    assert _tokens(graphed) == _tokens(eager)

    # Requests that ask for log-probabilities make their steps eager; every other step still replays a graph.
    # Only early requests ask, so the later admissions' mixed steps run without them.
    with_logprobs = [
        Request(r.id, r.prompt_ids, SamplingParams(max_new_tokens=16, ignore_eos=True, logprobs=2))
        if r.id in (0, 8, 16)
        else r
        for r in sampled
    ]
    graphed, stats = _run(model_dir, with_logprobs)
    eager, _ = _run(model_dir, with_logprobs, graph_mixed=False)
    assert 0 < stats["eager_steps"] < stats["steps"] and stats["mixed_graph_steps"] > 0
    assert _tokens(graphed) == _tokens(eager)
    for r in with_logprobs:
        if r.sampling.logprobs is not None:
            # The same eager step, over a KV cache that graphed and eager steps filled alike up to rounding.
            got, want = graphed[r.id].samples[0], eager[r.id].samples[0]
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def test_graphs_of_one_sampler_mode_run_every_step_a_cheaper_mode_needs_and_equal_all_modes(tmp_path):
    """A job whose rows all filter captures the filtering graphs alone (`graph_sampling=filtering`): greedy and
    temperature-only rows, and steps that sample nothing (prefill chunks), replay those graphs with the tokens
    they draw under every mode's graphs, and nothing runs eagerly."""
    model_dir = make_tiny_model(tmp_path / "llama", arch="llama")
    modes = [dict(), dict(temperature=0.8), dict(temperature=0.8, top_p=0.9)]
    prompts = [r.prompt_ids for r in mixed_requests(48, seed=12, max_prompt=300)]
    requests = [
        Request(id=i, prompt_ids=p, sampling=SamplingParams(max_new_tokens=16, seed=i, **modes[i % 3]))
        for i, p in enumerate(prompts)
    ]
    one, one_stats = _run(model_dir, requests, graph_sampling="filtering")
    every, every_stats = _run(model_dir, requests, graph_sampling="all")
    assert one_stats["graph_modes"] == one_stats["mixed_graph_modes"] == 1
    assert every_stats["graph_modes"] == 3
    assert one_stats["eager_steps"] == 0 and one_stats["graph_steps"] == one_stats["steps"]
    assert _tokens(one) == _tokens(every)
