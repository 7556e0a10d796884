"""How many padding tokens a workload's mixed steps carry, for a set of token buckets and cut rules:

    python scripts/dev/mixed_padding.py --workload W5 [--kv-blocks 54697] [--max-num-seqs 512] \
        [--buckets engine,powers,256:512:768:1024:2048:4096:8192] [--cut-share 0.5,0.25]

Replays the workload's schedule without a model (the engine's scheduler, `simulate_admission.replay`) with each
bucket set and each `scheduler.CUT_SHARE`, and prints the steps, the mixed steps, the padding tokens and what
they cost at the matmul rate (`--tflops`; a padded token costs a real one's matmuls). `engine` is the engine's
own buckets for these limits (`step_layout.mixed_buckets`), `powers` the powers of two and the token budget
alone. The KV cache size defaults to the 8B's on a 141 GB card (W5's runs).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent)]

from bench_lib.roofline import model_shape  # noqa: E402
from bench_lib.workloads import ARCHITECTURES, WORKLOADS, draw_requests  # noqa: E402
from simulate_admission import replay  # noqa: E402

from batchjob.engine.native.runtime.step_layout import mixed_buckets  # noqa: E402
from batchjob.engine.native.scheduling import scheduler  # noqa: E402


def padding(requests, buckets: tuple[int, ...], kv_blocks: int, max_num_seqs: int, max_tokens: int) -> dict:
    """Steps, mixed steps per bucket and padding tokens of one replay."""
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
    parser.add_argument("--workload", default="W5")
    parser.add_argument("--kv-blocks", type=int, default=54_697)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--buckets", default="engine,powers", help="comma-separated: engine, powers or A:B:C")
    parser.add_argument("--cut-share", default="0.5,0.25", help="comma-separated")
    parser.add_argument("--tflops", type=float, default=763.0, help="bf16 matmul rate the padding is priced at")
    args = parser.parse_args()
    spec = WORKLOADS[args.workload]
    shape = model_shape(ARCHITECTURES[spec.architecture])
    requests = draw_requests(spec, shape.vocab)
    token_seconds = 2.0 * shape.matmul_parameters_per_token / (args.tflops * 1e12)
    named = {
        "engine": mixed_buckets(args.max_tokens, args.max_num_seqs),
        "powers": mixed_buckets(args.max_tokens),
    }
    for name in args.buckets.split(","):
        buckets = tuple(named[name] if name in named else sorted(int(b) for b in name.split(":")))
        for share in (float(s) for s in args.cut_share.split(",")):
            scheduler.CUT_SHARE = share
            got = padding(requests, buckets, args.kv_blocks, args.max_num_seqs, args.max_tokens)
            print(
                f"{args.workload} buckets {':'.join(map(str, buckets))} cut share {share}: {got['steps']} steps, "
                f"{got['mixed']} mixed, {got['padded']:,} padding tokens ({got['padded'] * token_seconds:.2f} s "
                f"of matmuls), steps per bucket {got['buckets']}"
            )


if __name__ == "__main__":
    main()
