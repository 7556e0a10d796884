"""The compiled sampler kernels at a Llama-3 vocabulary (128,256) and 256 rows: the split race with the filter
checked at its winner draws the exact search's token and a float64 reference's, the exact search keeps the
sorted filter's tokens, every sampler mode replays from a CUDA graph with new parameters and draws what it
draws eagerly, and the step times of greedy, temperature-only, top-p, top-k, min-p and top-k with top-p."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Importing the kernels here, uninterpreted, would leave them unusable for the CPU interpreter tests.
    pytest.skip("needs CUDA", allow_module_level=True)

from batchjob.engine.native.kernels import (
    sampling_draw,  # noqa: E402
    sampling_filter,  # noqa: E402
    sampling_race,  # noqa: E402
)
from batchjob.engine.native.sampling.sampler import (  # noqa: E402
    RowFilter,
    SamplerMode,
    SamplingTensors,
    draw,
    noise_keys,
    sample,
    sampled_tokens,
    scaled_logits,
    sorted_row_filter,
    torch_exponential_noise,
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
# 256 rows: the above, k = 1, p = 1 with k past the vocabulary, a tiny top-p, top-k with min-p.
MANY_FILTERS = (
    (FILTERS + [(1.0, 1, 1.0, 0.0), (0.8, VOCAB + 5, 1.0, 0.0), (1.3, 0, 1e-4, 0.0), (0.6, 20, 1.0, 0.1)]) * 6
)[:256]


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
    threshold, row_max = sampling_filter.filter_thresholds(
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


def reference_keep(scaled: torch.Tensor, params: SamplingTensors, slack: float = 0.0) -> torch.Tensor:
    """The filters in float64 off the sorted row, ties never split: top-k keeps a token with at most k - 1 tokens
    strictly above it, top-p (over the top-k survivors) one whose survivors strictly above weigh at most top_p
    (times 1 + slack) of all survivors, min-p one at least min_p (times 1 - slack) times the most probable."""
    values, order = scaled.double().sort(dim=-1, descending=True)
    vocab = values.shape[-1]
    # Tokens strictly above each: the position of the first of its run of equal values.
    above = torch.searchsorted(-values, -values, side="left")
    weight = (values - values[:, :1]).exp()
    k = torch.where((params.top_k > 0) & (params.top_k < vocab), params.top_k, vocab)[:, None]
    keep = (above <= k - 1) & (values > float("-inf"))
    survivors = weight * keep
    mass_above = (survivors.cumsum(dim=-1) - survivors).gather(1, above)
    bound = params.top_p.double()[:, None] * survivors.sum(dim=-1, keepdim=True) * (1 + slack)
    keep &= (mass_above <= bound) | (params.top_p[:, None] >= 1)
    keep &= weight >= params.min_p.double()[:, None] * (1 - slack)
    return torch.zeros_like(keep).scatter(1, order, keep)


def test_race_draws_the_exact_searchs_and_the_float64_references_tokens():
    params = params_for(MANY_FILTERS, seed=4)
    logits = random_logits(len(MANY_FILTERS), seed=4)
    logits[-1] = 0.5  # all tokens equal
    keys = noise_keys(params.seeds, params.positions)
    filters = (params.top_k, params.top_p, params.min_p)
    got = sampling_race.sample_tokens(logits, params.temperature, keys, filters)
    _, state = sampling_race.settle(logits, params.temperature, keys, filters)
    exact = sampling_race.sample_tokens(logits, params.temperature, keys, filters, rounds=0)
    # The checks and the search sum the probabilities in different orders: a boundary token may differ.
    differ = (got != exact).nonzero().flatten().tolist()
    assert len(differ) <= 2, f"rows {differ} differ from the exact search"
    settled_share = (state == 0).float().mean().item()
    print(f"\n{settled_share:.1%} of rows settled without the exact search")

    scaled = scaled_logits(logits, params.temperature)
    keep = reference_keep(scaled, params)
    noise = torch_exponential_noise(keys, VOCAB).double()
    race = torch.where(keep, scaled.double() - noise.log(), float("-inf")).argmax(dim=-1)
    want = torch.where(params.temperature > 0, race, logits.argmax(dim=-1))
    # The kernels' exp/log run in the GPU's fast float32 forms: near-ties of the two best scores may go the
    # other way, rarely; every token must still be one the filters keep, up to float32 rounding of the sums.
    differ = (got != want).nonzero().flatten().tolist()
    assert len(differ) <= len(MANY_FILTERS) // 50, f"rows {differ} picked other tokens than the reference"
    loose = reference_keep(scaled, params, slack=1e-4)
    sampled = params.temperature > 0
    assert loose.gather(1, got[:, None]).squeeze(1)[sampled].all()


@pytest.mark.parametrize("mode", [TEMPERATURE, FILTERING], ids=["temperature-only", "filtered"])
def test_race_picks_the_torch_paths_token(mode):
    params = params_for(FILTERS, seed=5)
    logits = random_logits(len(FILTERS), seed=2)
    got = sampled_tokens(logits, params, mode.filtering)  # CUDA: the split race, noise in registers
    want = sampled_tokens(logits.cpu(), on_cpu(params), mode.filtering)  # the torch path, sorted filter
    differ = (got.cpu() != want).nonzero().flatten().tolist()
    assert len(differ) <= len(FILTERS) // 50, f"rows {differ} picked other tokens"
    if mode.filtering:
        keep = sorted_row_filter(scaled_logits(logits, params.temperature), params)
        allowed = keep.keep(scaled_logits(logits, params.temperature)).cpu()
        assert all(bool(allowed[row, got[row]]) for row in differ)


def test_exact_draw_picks_the_torch_paths_token():
    params = params_for(FILTERS, seed=5)
    logits = random_logits(len(FILTERS), seed=2)
    keep = sorted_row_filter(scaled_logits(logits, params.temperature), params)
    filters = (keep.threshold, keep.row_max, keep.min_p)
    got = sampling_draw.draw(logits, params.temperature, noise_keys(params.seeds, params.positions), filters)
    want = draw(logits.cpu(), on_cpu(params), on_cpu(keep))
    differ = (got.cpu() != want).nonzero().flatten().tolist()
    assert len(differ) <= len(FILTERS) // 50, f"rows {differ} picked other tokens"


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
    modes = {
        "greedy": (top_p, GREEDY),
        "temperature only": (params_for([(0.8, 0, 1.0, 0.0)] * rows), TEMPERATURE),
        "top_p=0.95": (top_p, FILTERING),
        "top_k=50": (params_for([(0.8, 50, 1.0, 0.0)] * rows), FILTERING),
        "min_p=0.05": (params_for([(0.8, 0, 1.0, 0.05)] * rows), FILTERING),
        "top_k=50 top_p=0.95": (params_for([(0.8, 50, 0.95, 0.0)] * rows), FILTERING),
    }
    ms = {name: graph_ms(lambda p=p, m=m: sample(logits, p, m), reps=50) for name, (p, m) in modes.items()}
    ms["the exact search alone, every row"] = graph_ms(
        lambda: sampling_filter.filter_thresholds(logits, top_p.temperature, top_p.top_k, top_p.top_p, top_p.min_p),
        reps=20,
    )
    ms["a full sort (what filtering used to start with)"] = graph_ms(lambda: logits.sort(dim=-1), reps=20)
    print(f"\nsampler step, {rows} x {VOCAB} float32 logits, T=0.8, CUDA graph:")
    for name, value in ms.items():
        print(f"  {value:7.3f} ms  {name}")
    assert ms["top_p=0.95"] < 0.25 * ms["a full sort (what filtering used to start with)"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_are_torch_argmax_and_faster_than_it(dtype, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from bench_lib.hardware import graph_ms

    gen = torch.Generator(device=DEVICE).manual_seed(11)
    logits = torch.randn(512, VOCAB, device=DEVICE, generator=gen).to(dtype)
    logits[1, 7] = logits[1, VOCAB - 1] = 99.0  # a tie across chunks: the first wins
    logits[2] = 0.5
    assert torch.equal(sampling_race.greedy_tokens(logits), logits.argmax(dim=-1))
    rows = logits[:32]
    ours = graph_ms(lambda: sampling_race.greedy_tokens(rows), reps=50)
    torchs = graph_ms(lambda: rows.float().argmax(dim=-1), reps=50)
    print(f"32 rows, {dtype}: greedy_tokens {ours * 1e3:.1f} us, float() + argmax {torchs * 1e3:.1f} us")
    assert ours < torchs
