"""How a step runs: eagerly at its own size, or padded to the shape of a captured CUDA graph.

Two kinds of graph, each captured per sampler mode and IO slot (model_runner.py):

- decode graphs, per batch-size bucket: B one-token sequences padded up to the bucket with one-token padding
  sequences, so tokens T, sequences B and sampled rows S all equal the bucket; attention by the decode kernels.
- mixed graphs, per token-count bucket, for steps that carry prefill chunks (or decodes beyond the largest
  decode bucket): T padded up to the bucket, B and S to `max_num_seqs`. Attention by the decode kernels for the
  one-token sequences and the varlen prefill kernel for the rest, each skipping the other's; their grids
  depend only on T and B, and the varlen kernel finds each program's sequence on the device, so one graph
  serves every mix of chunk lengths that fits its bucket.

Padding (io_slot.py fills it): a padding sequence takes one padding token while they last and none after
that; padding tokens past the last sequence's belong to no sequence; every padding token writes its K/V into
the scratch block 0 and no real sequence reads it. Padding rows are sampled and discarded.

A step with log-probabilities runs eagerly (no graph returns them). A step with constrained rows replays the
split halves of its decode or mixed bucket (forward, then masked sampler) where they were captured.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchjob.engine.native.options import GRAPH_SAMPLING
from batchjob.engine.native.runtime.io_slot import StepShape
from batchjob.engine.native.sampling.sampler import SamplerMode
from batchjob.engine.native.scheduling.plan import StepPlan

GREEDY = SamplerMode()
# Temperature-only steps get their own graphs: their draw is one pass over the logits, as cheap as greedy,
# while a filtering step adds the filter's checks. Rows without a filter draw the same token in either mode,
# and greedy rows stay greedy in both.
SAMPLING = SamplerMode(sampling=True)
FILTERING = SamplerMode(sampling=True, filtering=True)
GRAPH_MODES = (GREEDY, SAMPLING, FILTERING)
# `engine.graph_sampling`: the modes captured for a job whose rows all sample alike, or any row
GRAPH_MODES_BY_NAME = dict(zip(GRAPH_SAMPLING, (GRAPH_MODES, (GREEDY,), (SAMPLING,), (FILTERING,)), strict=True))

# Below this many tokens a mixed step pads up to it: a smaller step is launch-bound, not compute-bound, so
# finer buckets would buy little for the graphs they cost.
SMALLEST_MIXED_BUCKET = 256


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes of the decode graphs: 1, 2, 4, 8, every multiple of 16, and `max_batch`."""
    small = [b for b in (1, 2, 4, 8) if b <= max_batch]
    return sorted(set(small + list(range(16, max_batch + 1, 16)) + [max_batch]))


def mixed_buckets(max_num_batched_tokens: int, max_num_seqs: int = 0) -> list[int]:
    """Token counts of the mixed graphs: powers of two from `SMALLEST_MIXED_BUCKET`, the token budget, and a
    full batch of decodes with a chunk of a quarter and of half its size (`max_num_seqs` x 5/4 and x 3/2,
    rounded up to 64). A saturated run's usual step is a full batch of decodes and one new prompt's chunk,
    which the powers of two alone pad by up to the batch's size (`scripts/dev/mixed_padding.py`). A step pads
    at most to twice its tokens; a full-budget step (the start of a run) pads nothing."""
    if max_num_batched_tokens < 2:
        return []  # no step can carry a chunk of two tokens
    buckets, size = {max_num_batched_tokens}, SMALLEST_MIXED_BUCKET
    while size < max_num_batched_tokens:
        buckets.add(size)
        size *= 2
    if max_num_seqs >= SMALLEST_MIXED_BUCKET:
        for chunk in (max_num_seqs // 4, max_num_seqs // 2):
            size = -(-(max_num_seqs + chunk) // 64) * 64
            if size < max_num_batched_tokens:
                buckets.add(size)
    return sorted(buckets)


# A decode bucket is dropped only when a larger one replays faster by more than this share: timing noise must
# not move small steps to large buckets for nothing.
BUCKET_GAIN = 0.02


def fastest_buckets(seconds: dict[int, float]) -> tuple[int, ...]:
    """The decode buckets worth padding to, given each one's replay time: a bucket is dropped when a larger one
    replays faster (by more than `BUCKET_GAIN`); its steps then pad up to the next bucket kept. A matmul can
    take longer at 448 rows than at 512, where its tiles and waves fill the GPU."""
    kept, best = [], float("inf")
    for bucket in sorted(seconds, reverse=True):
        if seconds[bucket] * (1 - BUCKET_GAIN) < best:
            kept.append(bucket)
        best = min(best, seconds[bucket])
    return tuple(sorted(kept))


# A decode step runs fewer of its rows only where that gives this share more tokens a second than running them all:
# replay timings are noisy, and a row that sits a step out waits. At 25% W8 ran 0.934x; with no row sitting out W2
# ran 1.01-1.03x and W4 1.000x (docs/benchmarks.md).
SIT_OUT_GAIN = 0.05


def decode_rows(seconds: dict[int, float]) -> tuple[int, ...]:
    """For each count of decodes a step could run, 0 up to the largest bucket: how many it runs. All of them, padded
    up to the first bucket that holds them, or the rows of a smaller bucket where those give `SIT_OUT_GAIN` more
    tokens a second by `seconds` (each kept bucket's replay time); the rest sit that step out. A matmul that takes
    its rows in blocks (FP8's of 128) runs 264 rows in the time of 384, and 256 in two thirds of it: 256 rows a
    step then do more for every row than 264."""
    buckets = sorted(seconds)
    rows = [0]
    for count in range(1, buckets[-1] + 1):
        up = next(b for b in buckets if b >= count)
        best, rate = count, count / seconds[up]
        for bucket in (b for b in buckets if b < count):
            if bucket / seconds[bucket] > (1 + SIT_OUT_GAIN) * rate:
                best, rate = bucket, bucket / seconds[bucket]
        rows.append(best)
    return tuple(rows)


@dataclass(frozen=True)
class GraphBuckets:
    """The graphs a runner captured: decode buckets and the sampler modes captured whole (`modes`) and as split
    halves for constrained rows (`masked_modes`), mixed token buckets with their sampler modes, whole and split
    (`mixed_masked_modes`), the sequence count every mixed graph pads to, and how many rows a decode step runs.
    The default captures nothing: every step runs eagerly."""

    decode: tuple[int, ...] = ()
    modes: frozenset[SamplerMode] = frozenset()
    masked_modes: frozenset[SamplerMode] = frozenset()
    mixed: tuple[int, ...] = ()
    mixed_modes: frozenset[SamplerMode] = frozenset()
    mixed_masked_modes: frozenset[SamplerMode] = frozenset()
    mixed_seqs: int = 0
    # `decode_rows` of the kept buckets' replay times: how many of a decode step's rows run (empty: all)
    decode_rows: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepLayout:
    """How a step runs: its padded shape, the graph bucket that replays it (None: eager) and whether that is a
    mixed graph, the sampler mode, its sampled rows and tokens, and the host-side bounds of an eager step's
    attention."""

    shape: StepShape
    bucket: int | None
    mode: SamplerMode
    rows: int
    tokens: int
    max_query_len: int
    max_seq_len: int
    mixed: bool = False


def has_constrained_rows(plan: StepPlan) -> bool:
    return bool(plan.constrained.any())


# The captured modes that can run a step needing each mode, cheapest first: a sampling graph draws a greedy
# row's argmax, and a filtering graph leaves a row without a filter unfiltered.
_COVERED_BY = {GREEDY: (GREEDY, SAMPLING, FILTERING), SAMPLING: (SAMPLING, FILTERING), FILTERING: (FILTERING,)}


def graph_mode_for(mode: SamplerMode, captured: frozenset[SamplerMode]) -> SamplerMode | None:
    """The cheapest of the `captured` modes that can run a step needing `mode`, if any (log-probabilities:
    none)."""
    if mode.logprobs is not None:
        return None
    needed = FILTERING if mode.filtering else SAMPLING if mode.sampling else GREEDY
    return next((m for m in _COVERED_BY[needed] if m in captured), None)


def sampler_mode(plan: StepPlan) -> SamplerMode:
    """The sampler a step's rows need, from their `Sequence.sampler_row`s: any row sampling, any sampled row
    filtered (`SamplingParams.filtered`), the most log-probabilities any row asks for."""
    top_k, temperature, top_p, min_p, logprobs = plan.sampler_rows.T
    sampling = temperature > 0
    filtering = sampling & ((top_k > 0) | (top_p < 1) | (min_p > 0))
    most = int(logprobs.max(initial=-1))
    logprobs = None if most < 0 else most
    return SamplerMode(sampling=bool(sampling.any()), filtering=bool(filtering.any()), logprobs=logprobs)


def _first_fitting(buckets: tuple[int, ...], size: int) -> int | None:
    return next((b for b in buckets if b >= size), None)


def layout_step(plan: StepPlan, graphs: GraphBuckets) -> StepLayout:
    """How `plan` runs with the graphs `graphs` describes: a decode step in the smallest decode bucket that
    holds it, any other step (or a decode too wide for every decode bucket) in the smallest mixed bucket that
    holds its tokens, else eagerly at its own size."""
    rows = int(plan.samples.sum())
    mode = sampler_mode(plan)
    n, t = len(plan.seqs), plan.num_tokens
    bounds = (int(plan.counts.max()), int((plan.starts + plan.counts).max()))
    constrained = has_constrained_rows(plan)
    graph_mode = graph_mode_for(mode, graphs.masked_modes if constrained else graphs.modes)
    if plan.is_decode and graph_mode is not None:
        bucket = _first_fitting(graphs.decode, n)
        if bucket:
            return StepLayout(StepShape(bucket, bucket, bucket), bucket, graph_mode, rows, t, *bounds)
    graph_mode = graph_mode_for(mode, graphs.mixed_masked_modes if constrained else graphs.mixed_modes)
    if graph_mode is not None and n <= graphs.mixed_seqs:
        bucket = _first_fitting(graphs.mixed, t)
        if bucket:
            shape = StepShape(bucket, graphs.mixed_seqs, graphs.mixed_seqs)
            return StepLayout(shape, bucket, graph_mode, rows, t, *bounds, mixed=True)
    return StepLayout(StepShape(t, n, rows), None, mode, rows, t, *bounds)
