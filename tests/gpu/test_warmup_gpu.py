"""After the engine's start-up (KV sizing, graph capture, warm-up), a mixed run compiles no Triton kernel and
makes no new device allocation: every kernel variant and every cached block it needs exists already.

Run on a machine with a CUDA GPU:  python -m pytest tests/gpu -q
"""

from __future__ import annotations

import importlib
import pkgutil

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from structured_cases import CODE_REGEX  # noqa: E402

from batchjob.engine import Request, SamplingParams, create_engine  # noqa: E402
from batchjob.job.tiny_model import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.gpu

SAMPLINGS = (
    dict(),
    dict(temperature=0.8),
    dict(temperature=0.8, top_p=0.95),
    dict(temperature=0.7, top_k=20, min_p=0.05),
    dict(logprobs=3),
    dict(temperature=0.8, top_p=0.9, logprobs=0),
)


def compiled_kernel_variants() -> dict[str, int]:
    """Compiled variants of every @triton.jit kernel of the native engine, by kernel (in-memory caches: a
    variant loaded from Triton's disk cache counts too, since loading it also stalls the step)."""
    from triton.runtime.jit import JITFunction

    import batchjob.engine.native as native

    counts = {}
    for info in pkgutil.iter_modules(native.__path__):
        module = importlib.import_module(f"{native.__name__}.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, JITFunction):
                # Triton 3.x: device -> (kernel cache, ...); older releases: device -> kernel cache.
                caches = getattr(value, "device_caches", None) or getattr(value, "cache", {})
                counts[f"{info.name}.{name}"] = sum(len(c[0] if isinstance(c, tuple) else c) for c in caches.values())
    return counts


def mixed_workload(n: int, seed: int, constrained: bool = False, logprobs: bool = True) -> list[Request]:
    """Prompts of 1-700 tokens, outputs of 1-80, every sampler mode (log-probabilities included unless not
    `logprobs`); with `constrained`, every fifth request under a regular expression (split steps)."""
    rng = np.random.default_rng(seed)
    samplings = SAMPLINGS if logprobs else [s for s in SAMPLINGS if "logprobs" not in s]
    requests = []
    for i in range(n):
        prompt = tuple(int(t) for t in rng.integers(6, 500, int(rng.integers(1, 700))))
        regex = CODE_REGEX if constrained and i % 5 == 0 else None
        params = SamplingParams(
            max_new_tokens=int(rng.integers(1, 80)),
            ignore_eos=True,
            seed=i,
            regex=regex,
            **samplings[i % len(samplings)],
        )
        requests.append(Request(i, prompt, params))
    return requests


@pytest.mark.parametrize(
    ("dtype", "constrained", "logprobs"),
    [("bfloat16", False, True), ("float32", False, True), ("bfloat16", True, True), ("bfloat16", False, False)],
    ids=str,
)
def test_a_mixed_run_after_start_up_compiles_nothing_and_allocates_no_device_memory(
    tmp_path, dtype, constrained, logprobs
):
    model_dir = make_tiny_model(tmp_path / "llama", arch="llama")
    # The KV cache sized from memory (not a block count), so the KV-sizing profile runs as in a real job.
    options = {"dtype": dtype, "max_num_seqs": 48, "max_num_batched_tokens": 1024, "gpu_memory_utilization": 0.25}
    engine = create_engine("native", str(model_dir), options)
    try:
        assert engine.stats()["warmup_s"] > 0
        kernels_before = compiled_kernel_variants()
        memory_before = torch.cuda.memory_stats()
        completions = list(engine.generate(mixed_workload(300, seed=7, constrained=constrained, logprobs=logprobs)))
        memory_after = torch.cuda.memory_stats()
        kernels_after = compiled_kernel_variants()
        stats = engine.stats()
    finally:
        engine.close()
    assert len(completions) == 300
    if logprobs or constrained:
        # Steps with log-probabilities or constrained chunks run eagerly; the others replay graphs.
        assert stats["steps"] > stats["graph_steps"] > 0
    else:
        # Every step replays a graph, decode or mixed.
        assert stats["eager_steps"] == 0 and stats["mixed_graph_steps"] > 0
    assert (stats.get("constrained_steps", 0) > 0) == constrained
    new = {
        k: kernels_after[k] - kernels_before.get(k, 0)
        for k in kernels_after
        if kernels_after[k] != kernels_before.get(k, 0)
    }
    assert not new, f"kernel variants compiled during the run: {new}"
    for key in ("segment.all.allocated", "num_alloc_retries"):
        assert memory_after[key] == memory_before[key], f"{key}: {memory_before[key]} -> {memory_after[key]}"


def test_start_up_hands_no_cached_block_back_to_the_driver(tmp_path):
    """Graph capture must not empty the allocator's cache: the blocks the KV-sizing profile left cached are
    what eager steps reuse (handing them back made each eager step cudaMalloc next to a nearly full card). Without
    compile workers: their listing pass empties the cache on purpose, before the KV sizing measures the card."""
    model_dir = make_tiny_model(tmp_path / "llama", arch="llama")
    options = {"dtype": "bfloat16", "max_num_seqs": 32, "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.25}
    options["compile_workers"] = 0
    freed_before = torch.cuda.memory_stats()["segment.all.freed"]
    engine = create_engine("native", str(model_dir), options)
    try:
        assert engine.stats()["graph_capture_s"] > 0
        assert torch.cuda.memory_stats()["segment.all.freed"] == freed_before
        assert torch.cuda.memory_reserved() > torch.cuda.memory_allocated()  # the profiled step's blocks, cached
    finally:
        engine.close()
