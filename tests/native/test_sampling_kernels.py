"""The sampler's sort-free CUDA path, on CPU through the Triton interpreter: the split race with the filter checked
at its winner draws the token of a float64 reference (top-k, top-p, min-p and their combinations, per-row
parameters, ties, all-equal rows and -inf logits), whether a row settles in the checks or takes the exact
search; that search keeps exactly the tokens the sorted filter keeps; the per-row draw picks the torch path's
token; and the whole sampler draws the tokens the former sort-based sampler drew wherever no tie sits at a
boundary."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("on a GPU, tests/gpu/test_sampler_gpu.py runs these checks compiled", allow_module_level=True)

# Kernels are built as interpreted or compiled when their module is imported, so this must come first.
os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

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
    scaled_logits,
    sorted_row_filter,
    torch_exponential_noise,
)

if not isinstance(sampling_draw._draw_kernel, InterpretedFunction):
    # Imported compiled by another module: CPU needs them interpreted (sampling_race imports the other two's).
    sampling_filter, sampling_draw = importlib.reload(sampling_filter), importlib.reload(sampling_draw)
    sampling_race = importlib.reload(sampling_race)

VOCAB = 1500


def params_for(rows: list[tuple[float, int, float, float]], seed: int = 0) -> SamplingTensors:
    """(temperature, top_k, top_p, min_p) per row."""
    temperature, top_k, top_p, min_p = zip(*rows, strict=True)
    n = len(rows)
    return SamplingTensors(
        temperature=torch.tensor(temperature, dtype=torch.float32),
        top_k=torch.tensor(top_k, dtype=torch.int64),
        top_p=torch.tensor(top_p, dtype=torch.float32),
        min_p=torch.tensor(min_p, dtype=torch.float32),
        seeds=torch.arange(n, dtype=torch.int64) * 7919 + seed,
        positions=torch.arange(n, dtype=torch.int64) + 3,
    )


FILTERS = [
    (0.8, 0, 0.95, 0.0),  # top-p alone, over a wide bracket: several search passes
    (1.0, 0, 0.5, 0.0),
    (0.7, 0, 0.999, 0.0),  # most of the vocabulary kept
    (1.3, 0, 1e-4, 0.0),  # only the most probable token
    (1.0, 40, 1.0, 0.0),  # top-k alone
    (0.8, 1, 1.0, 0.0),
    (1.0, 1400, 1.0, 0.0),  # all but a hundred: the bracket is far down the row
    (1.0, VOCAB, 1.0, 0.0),  # k = vocabulary: off
    (1.0, 0, 1.0, 0.05),  # min-p alone
    (0.9, 50, 0.9, 0.0),  # top-p within the top-k
    (0.9, 700, 0.8, 0.02),  # all three
    (1.1, 5, 0.3, 0.1),
    (0.0, 50, 0.9, 0.1),  # greedy row with filters set: ignored
]


def random_logits(rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=gen) * torch.linspace(0.5, 4.0, rows)[:, None]


def tied_logits(rows: int, seed: int) -> torch.Tensor:
    """Few distinct values, each hundreds of times (more than one exact test holds), and some -inf tokens (as a
    grammar mask leaves them)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 6, (rows, VOCAB), generator=gen).float() * 0.75
    logits[torch.rand(rows, VOCAB, generator=gen) < 0.2] = float("-inf")
    return logits


def kept(keep: RowFilter, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    return keep.keep(scaled_logits(logits, params.temperature))


def searched_filter(logits: torch.Tensor, params: SamplingTensors, copies: tuple[int, int] | None = None) -> RowFilter:
    wide, narrow = copies or (sampling_filter.WIDE, sampling_filter.NARROW)
    threshold, row_max = sampling_filter.filter_thresholds(
        logits, params.temperature, params.top_k, params.top_p, params.min_p, wide=wide, narrow=narrow
    )
    return RowFilter(threshold, row_max, params.min_p)


# At this vocabulary the whole row fits the first copy and one pivot pass over it leaves fewer tokens than
# the exact test takes; small copies make the search narrow over the row, then over the copy, and meet ties
# it cannot split.
@pytest.mark.parametrize("copies", [None, (256, 32)], ids=["default", "narrowing"])
@pytest.mark.parametrize("make_logits", [random_logits, tied_logits], ids=["distinct", "ties-and-inf"])
def test_search_keeps_exactly_the_sorted_filters_tokens(make_logits, copies):
    params = params_for(FILTERS)
    logits = make_logits(len(FILTERS), seed=1)
    searched = kept(searched_filter(logits, params, copies), logits, params)
    want = kept(sorted_row_filter(scaled_logits(logits, params.temperature), params), logits, params)
    sampled = params.temperature > 0
    for row in range(len(FILTERS)):
        if sampled[row]:
            assert torch.equal(searched[row], want[row]), f"row {row} {FILTERS[row]}"
    # The kept sets are real filters: never empty, never all of a filtering row.
    assert searched[sampled].any(dim=-1).all()
    assert (searched.sum(dim=-1) < (logits > float("-inf")).sum(dim=-1))[[0, 1, 3, 4, 5, 9, 10, 11]].all()


def test_ties_at_the_top_k_boundary_are_all_kept():
    logits = torch.zeros(1, VOCAB)
    logits[0, :10] = 5.0
    logits[0, 10:40] = 3.0  # the 20th largest is one of thirty tied values
    params = params_for([(1.0, 20, 1.0, 0.0)])
    keep = kept(searched_filter(logits, params), logits, params)[0]
    assert keep.sum() == 40 and keep[:40].all()


def reference_kept_set(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """The former sort-based filter in float64, by position in the sorted row."""
    scaled = scaled_logits(logits, params.temperature).double()
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(scaled.shape[-1])[None, :]
    k = torch.where(params.top_k > 0, params.top_k, scaled.shape[-1])[:, None]
    probs = sorted_logits.masked_fill(rank >= k, float("-inf")).softmax(dim=-1)
    drop = (probs.cumsum(dim=-1) - probs) > params.top_p[:, None].double()
    drop |= probs < params.min_p[:, None].double() * probs[:, :1]
    drop[:, 0] = False
    keep_sorted = (probs > 0) & ~drop
    return torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)


def test_without_ties_the_kept_set_is_the_former_sort_based_one():
    params = params_for(FILTERS[:-1])
    logits = random_logits(len(FILTERS) - 1, seed=2)
    assert torch.equal(kept(searched_filter(logits, params), logits, params), reference_kept_set(logits, params))


@pytest.mark.parametrize("filtered", [False, True], ids=["temperature-only", "filtered"])
def test_fused_draw_picks_the_torch_paths_token(filtered):
    params = params_for(FILTERS, seed=5)
    logits = random_logits(len(FILTERS), seed=3)
    keep = sorted_row_filter(scaled_logits(logits, params.temperature), params) if filtered else None
    want = draw(logits, params, keep)  # the torch path: noise from torch_exponential_noise
    filters = None if keep is None else (keep.threshold, keep.row_max, keep.min_p)
    got = sampling_draw.draw(logits, params.temperature, noise_keys(params.seeds, params.positions), filters)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert got[-1] == logits[-1].argmax()  # the greedy row


@pytest.mark.parametrize("filtered", [False, True], ids=["temperature-only", "filtered"])
def test_fused_draw_after_a_grammar_mask_picks_the_torch_paths_allowed_token(filtered):
    params = params_for(FILTERS, seed=6)
    gen = torch.Generator().manual_seed(6)
    allowed = torch.rand(len(FILTERS), VOCAB, generator=gen) < 0.02
    allowed[:, 7] = True
    logits = random_logits(len(FILTERS), seed=6).masked_fill(~allowed, float("-inf"))
    keep = sorted_row_filter(scaled_logits(logits, params.temperature), params) if filtered else None
    want = draw(logits, params, keep)
    filters = None if keep is None else (keep.threshold, keep.row_max, keep.min_p)
    got = sampling_draw.draw(logits, params.temperature, noise_keys(params.seeds, params.positions), filters)
    assert torch.equal(got, want)
    assert allowed.gather(1, got[:, None]).all()


def test_sampler_draws_the_former_sort_based_samplers_tokens():
    params = params_for(FILTERS)
    logits = random_logits(len(FILTERS), seed=4)
    sampled = params.temperature > 0
    for position in range(5):
        params.positions.fill_(position)
        keys = noise_keys(params.seeds, params.positions)
        noise = torch_exponential_noise(keys, VOCAB).double()
        race = reference_kept_set(logits, params).double() * scaled_logits(logits, params.temperature).softmax(-1)
        want = torch.where(sampled, (race / noise).argmax(dim=-1), logits.argmax(dim=-1))
        got = sample(logits, params, SamplerMode(sampling=True, filtering=True)).tokens
        assert torch.equal(got, want), f"position {position}"


# Every filter on its own and together, p = 1 and k = 1, k past the vocabulary, greedy rows with filters set.
RACE_FILTERS = FILTERS + [
    (0.8, 0, 1.0, 0.0),  # temperature only, in a filtering step
    (1.0, 1, 0.5, 0.0),  # k = 1 with top-p: the top-k and top-p case
    (0.6, 20, 0.95, 0.0),
    (1.0, 3000, 0.9, 0.0),  # k past the vocabulary: top-p alone
    (1.0, 10, 1.0, 0.3),
    (2.0, 0, 0.2, 0.01),
    (0.0, 0, 1.0, 0.0),
]


def reference_tokens(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """The race among the tokens the filters keep, each filter tested at every token value in float64, ties
    never split: top-k keeps a token with at most k - 1 tokens strictly above it, top-p (over the top-k
    survivors) one whose survivors strictly above weigh at most top_p of all survivors, min-p one at least
    min_p times as probable as the most probable."""
    scaled = scaled_logits(logits, params.temperature).double()
    noise = torch_exponential_noise(noise_keys(params.seeds, params.positions), logits.shape[-1]).double()
    tokens = []
    for row, values in enumerate(scaled):
        if params.temperature[row] == 0:
            tokens.append(int(logits[row].argmax()))
            continue
        above = values[None, :] > values[:, None]  # [token, other]: other strictly above token
        weight = (values - values.max()).exp()
        k, p = int(params.top_k[row]), float(params.top_p[row])
        keep = values > float("-inf")
        if 0 < k < len(values):
            keep &= above.sum(dim=1) <= k - 1
        if p < 1:
            survivors = weight * keep
            keep &= (above * survivors[None, :]).sum(dim=1) <= p * survivors.sum()
        keep &= weight >= float(params.min_p[row])
        tokens.append(int(torch.where(keep, values - noise[row].log(), float("-inf")).argmax()))
    return torch.tensor(tokens)


def equal_rows_logits(rows: int, seed: int) -> torch.Tensor:
    """Rows whose tokens all share one value, but for a few -inf (a grammar mask) in every other row."""
    logits = torch.full((rows, VOCAB), 1.5)
    logits[::2, : VOCAB // 3] = float("-inf")
    return logits


def race(logits: torch.Tensor, params: SamplingTensors, filtering: bool = True, **kwargs) -> torch.Tensor:
    filters = (params.top_k, params.top_p, params.min_p) if filtering else None
    keys = noise_keys(params.seeds, params.positions)
    return sampling_race.sample_tokens(logits, params.temperature, keys, filters, **kwargs)


# A chunk of 512 splits the 1500 tokens over three programs per row, the last one partly past the vocabulary.
@pytest.mark.parametrize(
    "make_logits", [random_logits, tied_logits, equal_rows_logits], ids=["distinct", "ties-and-inf", "all-equal"]
)
def test_race_draws_the_reference_token(make_logits):
    params = params_for(RACE_FILTERS, seed=11)
    logits = make_logits(len(RACE_FILTERS), seed=7)
    assert torch.equal(race(logits, params, chunk=512), reference_tokens(logits, params))


def test_most_rows_settle_at_the_races_winner_and_match_the_exact_search():
    params = params_for(RACE_FILTERS, seed=12)
    logits = random_logits(len(RACE_FILTERS), seed=8)
    keys = noise_keys(params.seeds, params.positions)
    filters = (params.top_k, params.top_p, params.min_p)
    tokens, state = sampling_race.settle(logits, params.temperature, keys, filters, chunk=512)
    settled = state == 0
    want = reference_tokens(logits, params)
    assert torch.equal(tokens[settled], want[settled])
    # Rows with top-k and top-p together go to the search unless the row's best token won; of the others only
    # the top_p = 1e-4 row is still open after four checks (each about halves the candidates left).
    both = (params.top_k > 0) & (params.top_k < VOCAB) & (params.top_p < 1) & (params.temperature > 0)
    assert torch.equal(state == 2, both & (tokens != logits.argmax(dim=-1)))
    assert (state == 1).nonzero().flatten().tolist() == [RACE_FILTERS.index((1.3, 0, 1e-4, 0.0))]
    # With no checks at all every filtered row takes the exact search, and draws the same tokens.
    assert torch.equal(race(logits, params, chunk=512, rounds=0), want)


def test_rejected_candidates_move_up_until_one_is_kept():
    # A flat tail holding half the mass: the unfiltered winner is mostly a tail token, which each filter rejects,
    # and so may the next winners, among the few values above it.
    logits = torch.zeros(8, VOCAB)
    logits[:, 100] = 7.0
    logits[:, 200:204] = torch.tensor([6.0, 5.0, 4.0, 3.0])
    params = params_for([(1.0, 0, 0.5, 0.0), (1.0, 0, 0.9, 0.0), (1.0, 3, 1.0, 0.0), (1.0, 0, 1.0, 0.04)] * 2)
    keys = noise_keys(params.seeds, params.positions)
    filters = (params.top_k, params.top_p, params.min_p)
    _, after_one = sampling_race.settle(logits, params.temperature, keys, filters, chunk=512, rounds=1)
    tokens, state = sampling_race.settle(logits, params.temperature, keys, filters, chunk=512, rounds=6)
    assert (after_one == 1).any() and (state == 0).all()
    assert torch.equal(tokens, reference_tokens(logits, params))


def test_temperature_only_race_draws_the_torch_paths_token():
    params = params_for(RACE_FILTERS, seed=13)
    logits = random_logits(len(RACE_FILTERS), seed=9)
    got = race(logits, params, filtering=False, chunk=512)
    assert got.dtype == torch.int64 and torch.equal(got, draw(logits, params, None))


def test_a_rows_token_does_not_depend_on_the_rest_of_the_batch():
    params = params_for(RACE_FILTERS, seed=14)
    logits = random_logits(len(RACE_FILTERS), seed=10)
    together = race(logits, params, chunk=512)
    for row in (0, 10, 14):
        alone = SamplingTensors(*(getattr(params, f)[row : row + 1] for f in params.__dataclass_fields__))
        assert race(logits[row : row + 1], alone, chunk=512).item() == together[row].item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_tokens_are_torch_argmax_in_the_models_own_dtype(dtype):
    # Ties across chunks and within one take the first maximum, as torch.argmax does; a row of one value and a
    # row whose maximum sits in the last, partial chunk too.
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 20_000, generator=gen).to(dtype)
    logits[1, 100] = logits[1, 19_999] = 60.0
    logits[2, 5_000] = logits[2, 5_001] = 60.0
    logits[3] = 1.0
    logits[4, 19_998] = 60.0
    logits[5, :300] = float("-inf")
    got = sampling_race.greedy_tokens(logits, chunk=4096)
    assert got.dtype == torch.int64
    assert got.tolist() == logits.argmax(dim=-1).tolist()
    assert got[1:5].tolist() == [100, 5_000, 0, 19_998]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_greedy_tokens_read_the_bitmask_beside_the_logits(dtype):
    # Constrained rows take the argmax among the tokens their bitmask row allows, unconstrained rows (-1) their
    # plain argmax; the logits are not written. Rows allowing: every other token, one token in the last partial
    # chunk, one token tied with another allowed one (the first wins), none at all (the row's first token, as
    # torch.argmax of a row of -inf).
    from batchjob.engine.native.sampling.token_mask import torch_apply_token_bitmask_

    gen = torch.Generator().manual_seed(11)
    vocab = 20_000
    logits = torch.randn(6, vocab, generator=gen).to(dtype)
    logits[3, 70] = logits[3, 9_000] = 50.0
    logits[3, 8_000] = 60.0  # forbidden: the row's plain argmax
    words = (vocab + 31) // 32
    bitmask = torch.zeros(5, words, dtype=torch.int32)
    bitmask[0] = 0x55555555  # every even token
    bitmask[1, 19_990 // 32] = 1 << (19_990 % 32)
    bitmask[2, 70 // 32] = 1 << (70 % 32)
    bitmask[2, 9_000 // 32] = 1 << (9_000 % 32)
    rows = torch.tensor([0, -1, 1, 2, 4, -1])  # bitmask row 3 unused, row 4 allows nothing
    before = logits.clone()
    got = sampling_race.greedy_tokens(logits, (bitmask, rows), chunk=4096)
    assert torch.equal(logits, before)
    expected = torch_apply_token_bitmask_(logits.float().clone(), bitmask, rows).argmax(dim=-1)
    assert got.tolist() == expected.tolist()
    assert got[2:5].tolist() == [19_990, 70, 0]
    assert got[0].item() % 2 == 0
