"""Warm-up: the engine's last start-up step, so that nothing compiles and nothing is allocated mid-run.

Before the engine says it is ready, it launches real steps (slot fill, host-to-device copies, forward, sampler,
device-to-host copy, both IO slots) of every kind the run can launch: eager decode steps of several batch
sizes, prefill and mixed prefill+decode steps, for each sampler mode (greedy, temperature, top-k/top-p/min-p
filters, log-probabilities), split steps with constrained rows (structured outputs: the forward, then the masked
sampler, with an allow-all bitmask), a sweep of step sizes up to the token budget, and the largest step the
budget allows with the heaviest sampler. A step that a captured graph can replay runs its kernels only as they
were compiled for the capture, so the steps meant to compile eager variants ask for log-probabilities, which
keeps them eager (no graph returns them). Two reasons:

- Triton compiles a kernel the first time it meets a new variant (dtype, constexprs, and the specialisation
  of integer arguments on 1 and on divisibility by 16). A compile in the middle of the run blocks the CPU
  for a second or more while the GPU drains. Batch sizes 1, 3 and 16 (and the limits) cover the three
  integer classes of token, sequence and row counts; the doubling sweeps of token and sequence counts meet
  every launch configuration chosen by a step's size (the fused MoE kernel's picks by tokens per expert, a
  range at least 4x wide, so a doubling sweep lands in each; a power of two above the sequence count).
- CUDA graph capture may leave the allocator without the blocks eager steps need; the largest step, run last,
  leaves them cached (the KV-sizing profile measured that step's peak, so it fits), so steady-state steps
  reuse cached blocks instead of calling cudaMalloc next to a nearly full card, which blocks the CPU until
  the step in flight ends.

Eager steps run one layer of each kind (`CausalLM.kernel_layers`): the other layers launch the same kernels.
Every warm-up token writes its K/V into the scratch block 0 (all block tables point there), no block manager
or scheduler state is touched, and the runner's counters are reset afterwards: the run starts as if nothing
had happened, with every kernel compiled and every buffer cached.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from batchjob.engine.api import Request, SamplingParams
from batchjob.engine.native.runtime.model_runner import ModelRunner
from batchjob.engine.native.scheduling.plan import StepPlan
from batchjob.engine.native.scheduling.sequence import RequestGroup, Sequence

log = logging.getLogger("batchjob.engine.native")

# What the rows of each sampler mode ask for (greedy, temperature only, filtered); the filtered rows use
# every filter at once.
_MODE_PARAMS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=1.0),
    "filters": dict(temperature=1.0, top_k=20, top_p=0.9, min_p=0.01),
}
# Greedy, with the sampled token's log-probability: a step no graph can replay.
_EAGER_GREEDY = SamplingParams(max_new_tokens=1, logprobs=0)
# One of each integer class Triton specialises on: 1, not a multiple of 16, a multiple of 16.
_SMALL_BATCHES = (1, 3, 16)
# The matcher of a warm-up step's constrained rows: the runner only asks whether a row has one, and the warm-up
# fills their bitmask rows itself (allow every token), so no grammar is compiled.
_WARMUP_CONSTRAINT = "warm-up: any token"


@dataclass(frozen=True)
class WarmupStep:
    """One step to launch: the new-token count of each sequence's chunk (1 = a decode), whether the last chunk
    stops short of its prompt's end (a chunked prefill: no token sampled), what the sampled rows ask for, and
    whether every other sampled row is constrained (a split step)."""

    counts: tuple[int, ...]
    sampling: SamplingParams
    last_unsampled: bool = False
    constrained: bool = False

    @property
    def tokens(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True)
class WarmupLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_top_logprobs: int


def _split(tokens: int, seqs: int) -> tuple[int, ...]:
    """`tokens` as `seqs` chunks whose sizes differ by at most one."""
    base, extra = divmod(tokens, seqs)
    return tuple(base + 1 if i < extra else base for i in range(seqs))


def _prefill_counts(tokens: int, limits: WarmupLimits, seqs: int) -> tuple[int, ...] | None:
    """`tokens` over about `seqs` sequences (more if a chunk would not fit the context), or None when the
    sequence limit cannot hold them."""
    longest = limits.max_model_len - 1
    seqs = min(limits.max_num_seqs, tokens, max(seqs, -(-tokens // longest)))
    return _split(tokens, seqs) if seqs * longest >= tokens else None


def warmup_steps(limits: WarmupLimits) -> list[WarmupStep]:
    """The steps, in launch order; each is launched twice in a row, so both IO slots run it."""
    steps = mode_steps(limits) + constrained_steps(limits) + size_sweep(limits) + batch_sweep(limits)
    return steps + [largest_step(limits)]


def _batches_and_mixed(limits: WarmupLimits) -> tuple[list[int], list[tuple[int, ...]]]:
    budget, max_seqs = limits.max_num_batched_tokens, limits.max_num_seqs
    batches = sorted({b for b in (*_SMALL_BATCHES, max_seqs) if b <= min(max_seqs, budget)})
    mixed = [
        counts
        for counts in [(5,), (1, 1, 1, 7, 9), (1,) * 15 + (17,)]
        if sum(counts) <= budget and len(counts) <= max_seqs and max(counts) < limits.max_model_len
    ]
    return batches, mixed


def mode_steps(limits: WarmupLimits) -> list[WarmupStep]:
    """Eager decodes of 1, 3, 16 and the most sequences, and small prefill and mixed steps (with and without
    log-probabilities), in every sampler mode."""
    batches, mixed = _batches_and_mixed(limits)
    steps = []
    for params in _MODE_PARAMS.values():
        plain = SamplingParams(max_new_tokens=1, **params)
        # Log-probabilities make a decode step run eagerly (no graph has them): the eager decode kernels.
        eager = dataclasses.replace(plain, logprobs=0)
        steps += [WarmupStep((1,) * b, eager) for b in batches]
        for sampling in (plain, eager):  # replayed by a mixed graph where one was captured; eager
            steps += [WarmupStep(counts, sampling, last_unsampled=len(counts) == 5) for counts in mixed]
    return steps


def constrained_steps(limits: WarmupLimits) -> list[WarmupStep]:
    """Split steps (structured outputs): eager decodes of the same batch sizes, greedy (the masked argmax) and
    sampled (the mask kernel, then the race), and greedy mixed steps. The captured split graphs ran their work
    once while being captured; these cover the eager masked samplers."""
    batches, mixed = _batches_and_mixed(limits)
    plain = SamplingParams(max_new_tokens=1)
    steps = [
        WarmupStep((1,) * b, dataclasses.replace(plain, logprobs=0, **params), constrained=True)
        for params in (_MODE_PARAMS["greedy"], _MODE_PARAMS["temperature"])
        for b in batches
    ]
    return steps + [WarmupStep(counts, plain, last_unsampled=len(counts) == 5, constrained=True) for counts in mixed]


def size_sweep(limits: WarmupLimits) -> list[WarmupStep]:
    """Greedy prefill steps of 32, 64, 128, ... tokens below the budget, eager."""
    steps, tokens = [], 32
    while tokens < limits.max_num_batched_tokens:
        counts = _prefill_counts(tokens, limits, max(1, tokens // 32))
        if counts is not None:
            steps.append(WarmupStep(counts, _EAGER_GREEDY))
        tokens *= 2
    return steps


def batch_sweep(limits: WarmupLimits) -> list[WarmupStep]:
    """Greedy mixed steps of 2, 4, 8, ... sequences up to the limit (decodes and one 2-token chunk), eager: a
    launch configuration chosen by the sequence count (a power of two above it, say) meets each of its values."""
    steps, seqs = [], 2
    while seqs < 2 * limits.max_num_seqs:
        seqs = min(seqs, limits.max_num_seqs)
        if seqs + 1 <= limits.max_num_batched_tokens and limits.max_model_len > 2:
            steps.append(WarmupStep((1,) * (seqs - 1) + (2,), _EAGER_GREEDY))
        seqs *= 2
    return steps


def largest_step(limits: WarmupLimits) -> WarmupStep:
    """As many tokens and sampled rows as one step can have (the peak the KV sizing measured), with the
    heaviest sampler: every filter and the most log-probabilities."""
    tokens = min(limits.max_num_batched_tokens, limits.max_num_seqs * (limits.max_model_len - 1))
    heaviest = SamplingParams(max_new_tokens=1, logprobs=limits.max_top_logprobs, **_MODE_PARAMS["filters"])
    return WarmupStep(_prefill_counts(tokens, limits, limits.max_num_seqs), heaviest)


def _plan(step: WarmupStep, block_size: int, max_model_len: int) -> StepPlan:
    """A plan of fresh sequences whose every block is the scratch block 0."""
    n = len(step.counts)
    # A decode attends to a short context before its one new token; a prefill chunk starts at position 0.
    starts = np.array([min(3, max_model_len - 1) if c == 1 else 0 for c in step.counts], dtype=np.int64)
    samples = np.ones(n, dtype=bool)
    samples[-1] = not step.last_unsampled
    seqs, row = [], 0
    for index, (start, count) in enumerate(zip(starts.tolist(), step.counts, strict=True)):
        prompt_len = start + count + (0 if samples[index] else 1)
        request = Request(id=("warm-up", index), prompt_ids=(0,) * prompt_len, sampling=step.sampling)
        seq = Sequence.create(-1 - index, RequestGroup(request, prompt_len), 0, prompt_len + 1, index, block_size)
        seq.block_table = [0] * (-(-(prompt_len + 1) // block_size))
        if samples[index]:
            seq.append_pending(row)
            if step.constrained and row % 2 == 0:
                seq.matcher = _WARMUP_CONSTRAINT
            row += 1
        seqs.append(seq)
    return StepPlan(
        seqs=seqs,
        starts=starts,
        counts=np.array(step.counts, dtype=np.int64),
        samples=samples,
        carry_rows=np.full(n, -1, dtype=np.int64),
    )


def _allow_every_token(bitmask: torch.Tensor) -> None:
    bitmask.fill_(-1)


def launch_steps(runner: ModelRunner, steps: list[WarmupStep], block_size: int) -> None:
    """Launch each step in both IO slots and wait for it."""
    with runner.model.kernel_layers():
        for step in steps:
            plan = _plan(step, block_size, runner.max_model_len)
            for _ in runner.slots:
                handle = runner.launch(plan)
                if not handle.sampled:
                    runner.sample_masked(handle, _allow_every_token)
                runner.collect(handle)
    runner.finish()


def warm_up(runner: ModelRunner, steps: list[WarmupStep], block_size: int) -> float:
    """Launch each step in both IO slots and wait for it; returns the seconds it took. The runner's step
    counters and GPU-busy clock start from zero afterwards."""
    started = time.perf_counter()
    launch_steps(runner, steps, block_size)
    runner.reset_counters()
    seconds = time.perf_counter() - started
    log.info("warm-up: %d kinds of step, each in both IO slots, in %.1f s", len(steps), seconds)
    return seconds
