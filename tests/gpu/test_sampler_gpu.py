"""The compiled sampler kernels at a Llama-3 vocabulary (128,256): the threshold search keeps the sorted filter's
tokens, the fused draw picks the torch path's token, every sampler mode replays from a CUDA graph with new
parameters, and the step times of greedy, temperature-only and top-p sampling at 256 rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Importing the kernels here, uninterpreted, would leave them unusable for the CPU interpreter tests.
    pytest.skip("needs CUDA", allow_module_level=True)

from batchjob.engine.native import triton_filter  # noqa: E402
from batchjob.engine.native.sampler import (  # noqa: E402
    RowFilter,
    SamplerMode,
    SamplingTensors,
    draw,
    sample,
    scaled_logits,
    sorted_row_filter,
)

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
VOCAB = 128256
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
GREEDY, TEMPERATURE, FILTERING = SamplerMode(), SamplerMode(sampling=True), SamplerMode(sampling=True, filtering=True)


def params_for(rows: list[tuple[float, int, float, float]], seed: int = 0) -> SamplingTensors:
    """(temperature, top_k, top_p, min_p) per row."""
    temperature, top_k, top_p, min_p = zip(*rows, strict=True)
    n = len(rows)
    return SamplingTensors(
        temperature=torch.tensor(temperature, dtype=torch.float32, device=DEVICE),
        top_k=torch.tensor(top_k, dtype=torch.int64, device=DEVICE),
        top_p=torch.tensor(top_p, dtype=torch.float32, device=DEVICE),
        min_p=torch.tensor(min_p, dtype=torch.float32, device=DEVICE),
        seeds=torch.arange(n, dtype=torch.int64, device=DEVICE) * 7919 + seed,
        positions=torch.arange(n, dtype=torch.int64, device=DEVICE) + 3,
    )


FILTERS = [
    (0.8, 0, 0.95, 0.0),
    (1.0, 0, 0.5, 0.0),
    (0.7, 0, 0.999, 0.0),  # most of the vocabulary: the search narrows over the row before copying
    (1.0, 40, 1.0, 0.0),
    (1.0, 100000, 1.0, 0.0),
    (1.0, 0, 1.0, 0.05),
    (0.9, 50, 0.9, 0.0),
    (0.9, 5000, 0.8, 0.02),
    (1.2, 0, 1.0, 0.0),  # temperature only
    (0.0, 50, 0.9, 0.1),  # greedy
] * 4


def random_logits(rows: int, seed: int) -> torch.Tensor:
    """Rows of different spread; every fourth rounded through bf16 (a bf16 model's logits: many exact ties),
    every third with a fifth of its tokens at -inf (a grammar mask)."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    spread = torch.linspace(0.5, 4.0, rows, device=DEVICE)[:, None]
    logits = torch.randn(rows, VOCAB, device=DEVICE, generator=gen) * spread
    logits[::4] = logits[::4].bfloat16().float()
    masked = torch.rand(rows, VOCAB, device=DEVICE, generator=gen) < 0.2
    masked[1::3] = False
    masked[2::3] = False
    return logits.masked_fill(masked, float("-inf"))


def test_search_keeps_exactly_the_sorted_filters_tokens():
    params = params_for(FILTERS)
    logits = random_logits(len(FILTERS), seed=1)
    scaled = scaled_logits(logits, params.temperature)
    threshold, row_max = triton_filter.filter_thresholds(
        logits, params.temperature, params.top_k, params.top_p, params.min_p
    )
    searched = RowFilter(threshold, row_max, params.min_p).keep(scaled)
    want = sorted_row_filter(scaled, params).keep(scaled)
    sampled = (params.temperature > 0).tolist()
    probs = scaled.softmax(dim=-1)
    for row, filters in enumerate(FILTERS):
        if sampled[row]:
            # The two sum probabilities in different orders: at a top-p boundary over ~10^5 tokens the float32
            # sums may disagree on the last few tokens. What may differ is bounded by that rounding, not a count.
            differ = searched[row] ^ want[row]
            mass = probs[row][differ].sum().item()
            assert mass < 1e-4, f"row {row} {filters}: {int(differ.sum())} tokens differ, mass {mass:.2e}"


def on_cpu(value):
    """A SamplingTensors or RowFilter with every tensor moved to the CPU."""
    return type(value)(*(getattr(value, f).cpu() for f in value.__dataclass_fields__))


@pytest.mark.parametrize("mode", [TEMPERATURE, FILTERING], ids=["temperature-only", "filtered"])
def test_fused_draw_picks_the_torch_paths_token(mode):
    params = params_for(FILTERS, seed=5)
    logits = random_logits(len(FILTERS), seed=2)
    keep = sorted_row_filter(scaled_logits(logits, params.temperature), params) if mode.filtering else None
    got = draw(logits, params, keep)  # CUDA: the fused kernel, noise in registers
    want = draw(logits.cpu(), on_cpu(params), None if keep is None else on_cpu(keep))  # the torch path
    # The fused kernel's exp/log run in the GPU's fast float32 forms: a row whose two best noisy scores lie within
    # that rounding may pick the other one. Such near-ties are rare; every pick must still be an allowed token.
    differ = (got.cpu() != want).nonzero().flatten().tolist()
    assert len(differ) <= len(FILTERS) // 50, f"rows {differ} picked other tokens"
    if keep is not None:
        allowed = keep.keep(scaled_logits(logits, params.temperature)).cpu()
        assert all(bool(allowed[row, got[row]]) for row in differ)


@pytest.mark.parametrize("mode", [GREEDY, TEMPERATURE, FILTERING], ids=["greedy", "temperature-only", "filtered"])
def test_captured_sampler_replays_with_new_parameters(mode):
    rows = len(FILTERS)
    logits = random_logits(rows, seed=3)
    params = params_for(FILTERS)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        sample(logits, params, mode)  # compile outside the capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = sample(logits, params, mode)
    for seed in (1, 2):
        new = params_for(FILTERS[seed:] + FILTERS[:seed], seed=seed)
        for field in params.__dataclass_fields__:
            getattr(params, field).copy_(getattr(new, field))
        logits.copy_(random_logits(rows, seed=10 + seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.tokens, sample(logits, params, mode).tokens), f"replay {seed}"


def test_sampler_step_times_at_256_rows(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from bench_lib.hardware import graph_ms

    rows = 256
    logits = torch.randn(rows, VOCAB, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0)) * 3
    top_p = params_for([(0.8, 0, 0.95, 0.0)] * rows)
    plain = params_for([(0.8, 0, 1.0, 0.0)] * rows)
    ms = {
        "greedy": graph_ms(lambda: sample(logits, top_p, GREEDY), reps=50),
        "temperature only": graph_ms(lambda: sample(logits, plain, TEMPERATURE), reps=50),
        "top_p=0.95": graph_ms(lambda: sample(logits, top_p, FILTERING), reps=50),
    }
    ms["a full sort (what filtering used to start with)"] = graph_ms(lambda: logits.sort(dim=-1), reps=50)
    print(f"\nsampler step, {rows} x {VOCAB} float32 logits, T=0.8, CUDA graph:")
    for name, value in ms.items():
        print(f"  {value:7.3f} ms  {name}")
    assert ms["top_p=0.95"] < 0.6 * ms["a full sort (what filtering used to start with)"]
