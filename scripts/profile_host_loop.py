"""The native engine's host work per step in steady state, without a model: the real scheduler, block manager,
step layout, IO slot fill and output processing run over `--seqs` sequences decoding at `--context` tokens, and
each step's sampled tokens come back at once (no forward, no GPU). Prints the median milliseconds of each part
a step, the work the loop's thread must finish within one GPU step to keep the GPU busy.

    python scripts/profile_host_loop.py [--seqs 256] [--context 1300] [--steps 300] [--sampling]

Every `--finish-every` steps the oldest sequence finishes and a new one is admitted with a `--context`-token
prompt, so admission and prefill chunks are in the mix as in a long job.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import numpy as np
import torch

from batchjob.engine import Request, SamplingParams
from batchjob.engine.native.block_manager import KVBlockManager
from batchjob.engine.native.io_slot import IOSlot, SlotLimits
from batchjob.engine.native.model_runner import StepHandle, StepResult
from batchjob.engine.native.output import OutputProcessor
from batchjob.engine.native.scheduler import Scheduler, SchedulerConfig
from batchjob.engine.native.sequence import RequestGroup, Sequence
from batchjob.engine.native.step_layout import GRAPH_MODES, GraphBuckets, decode_buckets, layout_step, mixed_buckets

BLOCK = 16
VOCAB = 128_256


def _sequence(seq_id: int, prompt_len: int, max_new: int, sampling: bool) -> Sequence:
    params = SamplingParams(max_new, ignore_eos=True, temperature=0.8 if sampling else 0.0, top_p=0.95)
    prompt = tuple(int(t) for t in np.random.default_rng(seq_id).integers(3, VOCAB, prompt_len))
    request = Request(seq_id, prompt, params)
    return Sequence.create(seq_id, RequestGroup(request, prompt_len), 0, prompt_len + max_new, seq_id, BLOCK)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--context", type=int, default=1300, help="prompt tokens of every sequence")
    parser.add_argument("--steps", type=int, default=300, help="steady-state steps measured")
    parser.add_argument("--finish-every", type=int, default=3)
    parser.add_argument("--sampling", action="store_true", help="temperature 0.8, top-p 0.95 (default: greedy)")
    args = parser.parse_args()

    budget = 8192
    max_len = args.context + 4 * args.steps
    config = SchedulerConfig(max_num_seqs=args.seqs, max_num_batched_tokens=budget, token_buckets=())
    blocks_per_seq = -(-max_len // BLOCK)
    blocks = KVBlockManager(args.seqs * blocks_per_seq + 64, BLOCK, enable_prefix_caching=True)
    scheduler = Scheduler(config, blocks)
    limits = SlotLimits(budget, args.seqs, blocks_per_seq, 20, -(-VOCAB // 32))
    slots = [IOSlot(i, limits, torch.device("cpu")) for i in range(2)]
    buckets = GraphBuckets(
        decode=tuple(decode_buckets(args.seqs)),
        modes=frozenset(GRAPH_MODES),
        mixed=tuple(mixed_buckets(budget)),
        mixed_modes=frozenset(GRAPH_MODES),
        mixed_seqs=args.seqs,
    )
    output = OutputProcessor(None, (2,), detokenize=False, grammars=None)
    next_id = 0
    live: list[Sequence] = []
    for _ in range(args.seqs):
        seq = _sequence(next_id, args.context, max_len - args.context, args.sampling)
        scheduler.add(seq)
        live.append(seq)
        next_id += 1

    times: dict[str, list[float]] = defaultdict(list)
    step = 0
    warm = -(-args.seqs * args.context // budget) + 2  # the prompts' steps, then steady state
    rng = np.random.default_rng(0)
    while step < warm + args.steps:
        began = time.perf_counter()
        plan = scheduler.schedule()
        scheduled = time.perf_counter()
        layout = layout_step(plan, buckets)
        slot = slots[step % 2]
        slot.fill(plan, layout.shape, BLOCK)
        filled = time.perf_counter()
        rows = int(plan.samples.sum())
        handle = StepHandle(plan, slot, layout.shape, rows, layout.mode)
        result = StepResult(rng.integers(3, VOCAB, rows), None, None, None)
        list(output.process(handle, result, scheduler))
        if step >= warm and step % args.finish_every == 0:
            oldest = live.pop(0)
            scheduler.finish(oldest, "length")
            seq = _sequence(next_id, args.context, max_len - args.context, args.sampling)
            scheduler.add(seq)
            live.append(seq)
            next_id += 1
        processed = time.perf_counter()
        if step >= warm:
            times["scheduling"].append(scheduled - began)
            times["layout and slot fill"].append(filled - scheduled)
            times["processing the tokens"].append(processed - filled)
            times["sequences a step"].append(len(plan.seqs) / 1000)
        step += 1
    mode = "sampling" if args.sampling else "greedy"
    print(f"{args.seqs} sequences at {args.context} tokens of context, {mode}, {args.steps} steps (medians)")
    for part, values in times.items():
        value = 1000 * statistics.median(values)
        print(f"  {part:<24} {value:8.3f}" + ("" if part == "sequences a step" else " ms"))
    total = sum(1000 * statistics.median(v) for k, v in times.items() if k != "sequences a step")
    print(f"  {'host work a step':<24} {total:8.3f} ms")


if __name__ == "__main__":
    main()
