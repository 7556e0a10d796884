"""Request sets and transformers references shared by the CPU (tests/native) and GPU (tests/gpu) engine suites."""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from batchjob.engine import Request, SamplingParams
from batchjob.job.tiny_model import ARCHITECTURES

EOS = 2  # the tiny models' <|end|>

# Tiny model cases of the engine suites: every tiny architecture (those with sliding windows use windows of 8
# tokens), plus Mistral and Qwen2 with windows far shorter than the prompts. Phi-3's LongRoPE switches to its long
# factors past the original length: transformers switches per forward call (every position, while the cached keys
# keep the short ones), the engine per position, so the two agree only while prompt + generation stay within it.
CASES: dict[str, tuple[str, dict]] = {arch: (arch, {}) for arch in ARCHITECTURES} | {
    "phi3": ("phi3", {"original_max_position_embeddings": 128}),
    "mistral_window": ("mistral", {"sliding_window": 8}),
    "qwen2_window": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
}


def mixed_requests(n: int, seed: int, max_prompt: int = 48, max_new: int = 24) -> list[Request]:
    """`n` greedy requests of random prompt and output lengths, EOS ignored."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = tuple(int(t) for t in rng.integers(6, 500, int(rng.integers(1, max_prompt))))
        new = int(rng.integers(1, max_new))
        out.append(Request(i, prompt, SamplingParams(max_new_tokens=new, ignore_eos=True)))
    return out


def hf_greedy(model_dir, requests: list[Request], device: str = "cpu") -> dict:
    """transformers' greedy tokens, generated past EOS (what `ignore_eos` means: EOS may be sampled, but
    does not end the request)."""
    # Eager attention: the plainest reference, and the only one of every transformers version that soft-caps
    # Gemma 2's attention scores.
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    hf = hf.to(device).eval()
    hf.generation_config.eos_token_id = None
    ref = {}
    for r in requests:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([r.prompt_ids], device=device),
                max_new_tokens=r.sampling.max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        ref[r.id] = tuple(out[0, len(r.prompt_ids) :].tolist())
    return ref


def open_ended(monkeypatch) -> None:
    """Have the scheduler take every row for one that may end early (at EOS): it then keeps no room for rows to
    reach their ends, so a tiny cache preempts and recomputes, the path a test of preemption exercises."""
    monkeypatch.setattr("batchjob.engine.native.scheduling.scheduler.runs_to_max_len", lambda seq: False)


def with_stops(requests: list[Request], ref: dict) -> tuple[list[Request], dict]:
    """Every third request stops on EOS or on a token it generates mid-way (a stop while the next step is
    already in flight); returns the requests and the tokens each must produce."""
    reqs, expected = [], {}
    for r in requests:
        tokens = ref[r.id]
        if r.id % 3 == 0 and len(tokens) > 3:
            stop = tokens[len(tokens) // 2]
            cut = next(i for i, t in enumerate(tokens) if t in (stop, EOS)) + 1
            r = Request(r.id, r.prompt_ids, SamplingParams(max_new_tokens=len(tokens), stop_token_ids=(stop,)))
            tokens = tokens[:cut]
        reqs.append(r)
        expected[r.id] = tokens
    return reqs, expected


def per_request_settings(prompts: list[tuple[int, ...]]) -> list[Request]:
    """Requests that each ask for different settings (as the lines of one OpenAI batch file do): greedy and
    sampled, n > 1, top-k / top-p / min-p, logprobs, different lengths."""
    settings = [
        SamplingParams(max_new_tokens=3, ignore_eos=True),
        SamplingParams(max_new_tokens=7, temperature=1.0, top_p=0.9, seed=3, n=2, ignore_eos=True),
        SamplingParams(max_new_tokens=5, temperature=0.7, top_k=5, seed=4, logprobs=2, ignore_eos=True),
        SamplingParams(max_new_tokens=6, temperature=1.2, min_p=0.05, seed=5, ignore_eos=True),
        SamplingParams(max_new_tokens=4, logprobs=0, ignore_eos=True),
    ]
    return [Request(i, prompts[i % len(prompts)], s) for i, s in enumerate(settings)]


def assert_each_request_as_alone(together: dict, alone: dict, requests: list[Request]) -> None:
    """Every request of a mixed call generated what it generates alone, with its own n, length and logprobs."""
    for r in requests:
        samples = together[r.id].samples
        assert [s.token_ids for s in samples] == [s.token_ids for s in alone[r.id].samples], r.sampling
        assert len(samples) == r.sampling.n
        assert all(len(s.token_ids) == r.sampling.max_new_tokens for s in samples)
        assert all((s.logprobs is None) == (r.sampling.logprobs is None) for s in samples)
