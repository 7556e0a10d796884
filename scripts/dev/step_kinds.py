"""Where a bench run's GPU time went by kind of step, against each kind's floor:

    python scripts/dev/step_kinds.py OUT/runs.jsonl --bench OUT/bench.json --workload W2
    python scripts/dev/step_kinds.py docs/bench/deterministic-h100-w1-w2.jsonl --workload W2 \
        --copy-tb-s 3.00 --matmul-tflops 771 --bands-ms 3,5,8,12,20,40

The run's steps are not labelled, so the kinds come from two sides. The floor side replays the workload's
schedule without a model (the engine's scheduler, with the mixed graphs' token buckets and the run's KV cache
size, `simulate_admission.replay`) and prices every step as the roofline does (bench_lib/roofline.py: a decode
step reads its weights and its sequences' KV, a step's prefill tokens add their FLOPs), at the copy and matmul
rates of the bench's `hardware`. The measured side groups the run's GPU spans (`busy_timeline`) by duration:
decode steps are the short ones, mixed steps longer as their bucket grows. The two sides' step counts per group
show how well the groups match (the replay is not the run: a few steps differ). Last, the roofline's floor of the
whole workload beside the same floor with each decode step's attention and matmuls one after another
(`roofline(serial=True)`): what a step's kernels in turn could reach at best.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent)]

from bench_lib.roofline import model_shape, roofline  # noqa: E402
from bench_lib.workloads import ARCHITECTURES, WORKLOADS, draw_requests  # noqa: E402
from simulate_admission import replay  # noqa: E402

from batchjob.engine.native.runtime.step_layout import mixed_buckets  # noqa: E402


def step_floors(
    shape, requests, kv_blocks: int, max_num_seqs: int, max_tokens: int, copy: float, flops: float, fp8: float | None
):
    """(kind, floor seconds) of each replayed step of `requests` on a model of `shape`: "decode", or "mixed N" for
    the token bucket N it fills; FP8 projections at the `fp8` rate."""
    buckets = tuple(mixed_buckets(max_tokens, max_num_seqs))
    for plan, _ in replay(
        requests.prompt_lengths, requests.output_lengths, kv_blocks, max_num_seqs, max_tokens, buckets
    ):
        decode = plan.counts == 1
        kv_tokens = float((plan.starts[decode] + 1).sum())
        counts, ends = plan.counts[~decode], (plan.starts + plan.counts)[~decode]
        pairs = float((ends * counts - counts * (counts - 1) / 2).sum())
        rows = int(decode.sum())
        read = (shape.step_weight_bytes(max(rows, 1)) + kv_tokens * shape.kv_bytes_per_token) / copy
        decode_s = max(read, shape.matmul_seconds(rows, rows, kv_tokens, flops, fp8)) if rows else 0.0
        prefill_s = shape.matmul_seconds(float(counts.sum()), float(counts.sum()), pairs, flops, fp8)
        kind = "decode" if plan.is_decode else f"mixed {next(b for b in buckets if b >= plan.num_tokens)}"
        yield kind, decode_s + prefill_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, help="a bench command's runs.jsonl (rows of other workloads are skipped)")
    parser.add_argument("--bench", type=Path, help="the same command's bench.json, for its measured rates")
    parser.add_argument("--copy-tb-s", type=float, help="else the copy rate it measured (TB/s)")
    parser.add_argument("--matmul-tflops", type=float, help="and its bf16 matmul rate (TFLOP/s)")
    parser.add_argument("--fp8-tflops", type=float, help="and its FP8 matmul rate, for a model with FP8 projections")
    parser.add_argument("--workload", default="W5")
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--bands-ms", default="40,60,100,150", help="span durations that separate the groups")
    args = parser.parse_args()
    if args.bench is not None:
        hardware = json.loads(args.bench.read_text())["hardware"]
    elif args.copy_tb_s and args.matmul_tflops:
        hardware = {"copy_bytes_per_s": args.copy_tb_s * 1e12, "matmul_flops_per_s": args.matmul_tflops * 1e12}
        if args.fp8_tflops:
            hardware["fp8_matmul_flops_per_s"] = args.fp8_tflops * 1e12
    else:
        parser.error("give --bench, or --copy-tb-s and --matmul-tflops")
    rows = (json.loads(line) for line in args.runs.read_text().splitlines() if line.strip())
    runs = [run for run in rows if run.get("workload") == args.workload and run.get("busy_timeline")]
    if not runs:
        parser.error(f"{args.runs} has no {args.workload} run with a GPU timeline")
    stats = runs[0]["engine_stats"]
    stats = stats if isinstance(stats, dict) else ast.literal_eval(stats)  # older rows hold a repr
    spec = WORKLOADS[args.workload]
    shape = model_shape(ARCHITECTURES[spec.architecture])
    requests = draw_requests(spec, shape.vocab)
    fp8 = hardware.get("fp8_matmul_flops_per_s") if shape.fp8_parameters else None
    if shape.fp8_parameters and not fp8:
        parser.error(f"{args.workload}'s model has FP8 projections: give --bench, or --fp8-tflops")
    floors = defaultdict(lambda: [0, 0.0])
    for kind, seconds in step_floors(
        shape, requests, int(stats["kv_blocks"]), args.max_num_seqs, args.max_num_batched_tokens,
        hardware["copy_bytes_per_s"], hardware["matmul_flops_per_s"], fp8,
    ):  # fmt: skip
        floors[kind][0] += 1
        floors[kind][1] += seconds
    print("replayed schedule: steps and floor by kind")
    for kind in sorted(floors, key=lambda k: (k != "decode", int(k.split()[-1]) if k != "decode" else 0)):
        n, seconds = floors[kind]
        print(f"  {kind:<12} {n:>6} steps {seconds:8.2f} s  ({seconds / n * 1e3:.1f} ms a step)")
    print(f"  {'total':<12} {sum(n for n, _ in floors.values()):>6} steps {sum(s for _, s in floors.values()):8.2f} s")
    kv_bytes = int(stats["kv_blocks"]) * int(stats.get("block_size", 16)) * shape.kv_bytes_per_token
    rates = (hardware["copy_bytes_per_s"], hardware["matmul_flops_per_s"], kv_bytes, fp8)
    overlapped, serial = (roofline(shape, requests, *rates, serial=serial).total_s for serial in (False, True))
    print(f"workload floor {overlapped:.2f} s; its decode steps' kernels one after another {serial:.2f} s")
    edges = [0.0, *(float(b) / 1e3 for b in args.bands_ms.split(",")), float("inf")]
    for run in runs:
        timeline = run["busy_timeline"]
        spans = np.array([b - a for a, b in (json.loads(timeline) if isinstance(timeline, str) else timeline)])
        label = f"{run['system']} {run.get('run', '')}, {run['output_tokens'] / run['wall_s']:,.0f} tok/s"
        print(f"{label}: GPU spans by duration ({len(spans)} steps, {spans.sum():.2f} s)")
        for lo, hi in zip(edges, edges[1:], strict=False):
            band = spans[(spans >= lo) & (spans < hi)]
            print(f"  {lo * 1e3:>5.0f}-{hi * 1e3:<5.0f} ms {len(band):>6} steps {band.sum():8.2f} s")


if __name__ == "__main__":
    main()
