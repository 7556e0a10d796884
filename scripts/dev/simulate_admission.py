"""How many sequences run at once, and the tokens preemption recomputes, for a workload's lengths on a KV cache of
a given size: the engine's real scheduler and block manager stepped without a model or GPU, in seconds.

    python scripts/dev/simulate_admission.py [--workload W5] [--kv-blocks 53570] [--max-num-seqs 256,512]

`--kv-blocks` is what the engine logs at start-up ("KV cache: N blocks of 16 tokens"): 53,570 for Llama-3.1-8B
on a 141 GB card at the default memory share.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_lib.workloads import WORKLOADS, draw_requests  # noqa: E402

from batchjob.engine import Request, SamplingParams  # noqa: E402
from batchjob.engine.native.scheduling.block_manager import KVBlockManager  # noqa: E402
from batchjob.engine.native.scheduling.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from batchjob.engine.native.scheduling.sequence import RequestGroup, Sequence  # noqa: E402

BLOCK = 16


def replay(prompt_lens, new_tokens, kv_blocks: int, max_num_seqs: int, max_num_batched_tokens: int = 8192,
           token_buckets: tuple[int, ...] = ()):  # fmt: skip
    """Step the scheduler until every request has its tokens, yielding each step's plan (`token_buckets`: the
    mixed graphs' buckets, which the scheduler cuts chunks to fill) and the scheduler."""
    longest = int(np.max(np.asarray(prompt_lens) + np.asarray(new_tokens)))
    if -(-longest // BLOCK) > kv_blocks - 1:  # block 0 is the engine's scratch block
        raise ValueError(f"a request of {longest} tokens needs more than the cache's {kv_blocks - 1} usable blocks")
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, token_buckets=token_buckets
    )
    scheduler = Scheduler(config, KVBlockManager(kv_blocks, BLOCK, enable_prefix_caching=False))
    pending = list(zip(prompt_lens, new_tokens, strict=True))[::-1]
    while pending or scheduler.has_unfinished:
        while pending and scheduler.free_seq_slots > 0:
            seq_id = len(prompt_lens) - len(pending)
            prompt_len, new = pending.pop()
            request = Request(seq_id, tuple(range(3, 3 + prompt_len)), SamplingParams(int(new), ignore_eos=True))
            group = RequestGroup(request, prompt_len)
            scheduler.add(Sequence.create(seq_id, group, 0, prompt_len + new, seq_id, BLOCK))
        plan = scheduler.schedule()
        if plan is None:
            raise RuntimeError("the scheduler planned nothing with sequences left: the cache is too small")
        yield plan, scheduler
        step_done(scheduler, plan)


def step_done(scheduler: Scheduler, plan) -> None:
    """What the engine does when a step's tokens are back, without a model: each sampled sequence gets a token,
    and one at its max_len finishes."""
    for seq, sampled in zip(plan.seqs, plan.samples.tolist(), strict=True):
        seq.inflight -= 1
        if sampled:
            seq.resolve_oldest(7)
            if seq.num_tokens >= seq.max_len:
                scheduler.finish(seq, "length")


def simulate(prompt_lens, new_tokens, kv_blocks: int, max_num_seqs: int, max_num_batched_tokens: int = 8192) -> dict:
    """Step the scheduler until every request has its tokens; what it did, summed over the steps."""
    steps = fed = decode_rows = decode_steps = preemptions = 0
    for plan, scheduler in replay(prompt_lens, new_tokens, kv_blocks, max_num_seqs, max_num_batched_tokens):
        steps += 1
        fed += plan.num_tokens
        if plan.is_decode:
            decode_steps += 1
            decode_rows += len(plan.seqs)
        preemptions = scheduler.num_preemptions
    needed = int(np.sum(prompt_lens)) + int(np.sum(new_tokens)) - len(prompt_lens)  # the last token is never fed
    return {
        "steps": steps,
        "decode_steps": decode_steps,
        "rows_per_decode_step": decode_rows / max(decode_steps, 1),
        "preemptions": preemptions,
        "recomputed": fed - needed,
        "recomputed_share": (fed - needed) / needed,
    }


def padding(requests, buckets: tuple[int, ...], kv_blocks: int, max_num_seqs: int, max_tokens: int) -> dict:
    """Steps, mixed steps per token bucket and the tokens they pad to their buckets, over one replay of
    `requests` (a `BenchRequests`) with the mixed graphs' `buckets`."""
    steps, padded, used = 0, 0, Counter()
    for plan, _ in replay(
        requests.prompt_lengths, requests.output_lengths, kv_blocks, max_num_seqs, max_tokens, buckets
    ):
        steps += 1
        if not plan.is_decode:
            bucket = next(b for b in buckets if b >= plan.num_tokens)
            padded += bucket - plan.num_tokens
            used[bucket] += 1
    return {"steps": steps, "mixed": sum(used.values()), "padded": padded, "buckets": dict(sorted(used.items()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="W5", choices=sorted(WORKLOADS))
    parser.add_argument("--kv-blocks", type=int, default=53_570)
    parser.add_argument("--max-num-seqs", default="256,512,1024", help="comma-separated")
    args = parser.parse_args()
    spec = WORKLOADS[args.workload]
    requests = draw_requests(spec, 128_000)
    prompt_lens, new_tokens = requests.prompt_lengths, requests.output_lengths
    print(f"{spec.name}: {spec.requests} requests, {args.kv_blocks} KV blocks of {BLOCK} tokens")
    print(f"{'max_num_seqs':>12} {'steps':>7} {'decode':>7} {'rows/decode':>11} {'preempted':>9} {'recomputed':>16}")
    for max_num_seqs in (int(n) for n in args.max_num_seqs.split(",")):
        r = simulate(prompt_lens, new_tokens, args.kv_blocks, max_num_seqs)
        print(
            f"{max_num_seqs:>12} {r['steps']:>7} {r['decode_steps']:>7} {r['rows_per_decode_step']:>11.0f} "
            f"{r['preemptions']:>9} {r['recomputed']:>9} ({r['recomputed_share']:.1%})"
        )


if __name__ == "__main__":
    main()
