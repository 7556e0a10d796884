"""Where the host's time goes in steps with constrained rows, on the CPU: a model with tiny layers and a full-size
vocabulary runs requests under the benchmark's records schema through the native engine's asynchronous loop,
under cProfile, and the loop thread's host work per constrained step is printed by part (processing a step's
tokens, scheduling, laying steps out), beside the engine's own mask figures (the masks fill in other threads,
which cProfile does not see) and the loop thread's biggest single functions.

    python scripts/dev/profile_host_steps.py [--tokenizer bpe|cl100k|DIR] [--requests 256] [--constrain-every K]
        [--engine-option KEY=VALUE]

`--constrain-every 2` puts every other request under the schema (the rest unconstrained, as the benchmark's
half-constrained batches), 0 none; parts are then per step.

The layers are tiny (`batchjob.job.tiny_model`), so the forward is cheap next to the vocabulary-wide work: the
output head, the sampler and the grammar's masks. On a CPU the forward and sampler run in the loop's thread, so
wall time says little about a GPU run; the per-part host times are what this measures. `--tokenizer cl100k` needs
tiktoken and its cached encoding (bench_lib/bpe.py).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_lib.models import DEFAULT_CACHE  # noqa: E402
from bench_lib.options import engine_options  # noqa: E402
from bench_lib.workloads import RECORDS_SCHEMA  # noqa: E402

# (label, file suffix, function): the loop's parts, by cumulative time
PARTS = (
    ("processing a step's tokens", "native/output.py", "process"),
    ("  jump-forward", "native/output.py", "_jump_forward"),
    ("  advancing matchers", "engine/grammar.py", "advance"),
    ("scheduling", "scheduling/scheduler.py", "schedule"),
    ("laying steps out", "runtime/model_runner.py", "prepare"),
)


def tiny_model(cache: Path, tokenizer_name: str) -> Path:
    """The project's tiny Llama (two layers, hidden size 64, random weights) with the tokenizer's whole vocabulary,
    in `cache`."""
    from bench_lib.bpe import named_tokenizer

    from batchjob.job.tiny_model import make_tiny_model

    generated = tokenizer_name in ("bpe", "cl100k")  # a tokenizer directory's model is made again each time
    out = cache / f"host-steps-{tokenizer_name if generated else Path(tokenizer_name).resolve().name}"
    if generated and (out / "config.json").exists():
        return out
    return make_tiny_model(out, tokenizer=named_tokenizer(tokenizer_name, cache))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default="bpe", help="bpe (generated, 128k), cl100k, or a tokenizer directory")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=120)
    parser.add_argument("--constrain-every", type=int, default=1, help="every K-th request constrained (0: none)")
    parser.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the model and tokenizers are kept")
    args = parser.parse_args(argv)
    if args.constrain_every < 0:
        parser.error(f"--constrain-every must be 0 or more, got {args.constrain_every}")

    from batchjob.engine import Request, SamplingParams, create_engine

    model = tiny_model(args.cache, args.tokenizer)
    options = {"dtype": "float32", "max_num_seqs": args.requests, "max_num_batched_tokens": 4096}
    options.update(engine_options(args.engine_option))
    engine = create_engine("native", str(model), options)
    rng = np.random.default_rng(0)
    schema = json.dumps(RECORDS_SCHEMA)

    def constrained(i: int) -> bool:
        return args.constrain_every > 0 and i % args.constrain_every == 0

    vocabulary = len(engine.tokenizer)
    special = len(engine.tokenizer.all_special_ids)
    # Prompts of ordinary tokens: the generated tokenizers put their 256 special ids last, the others' count low.
    text_ids = vocabulary - (256 if args.tokenizer in ("bpe", "cl100k") else special)
    requests = [
        Request(
            i,
            tuple(int(t) for t in rng.integers(3, text_ids, 32)),
            SamplingParams(args.max_new_tokens, json_schema=schema if constrained(i) else None, ignore_eos=True),
        )
        for i in range(args.requests)
    ]
    try:
        if args.constrain_every:
            engine.grammars.matcher(requests[0].sampling.constraint)  # builds the vocabulary index, compiles the schema
        profile = cProfile.Profile()
        began = time.perf_counter()
        profile.enable()
        list(engine.generate(requests))
        profile.disable()
        wall = time.perf_counter() - began
        stats = engine.stats()
    finally:
        engine.close()
    steps = max(int(stats.get("constrained_steps", 0)) if args.constrain_every else int(stats["steps"]), 1)
    table = pstats.Stats(profile).stats  # (file, line, function) -> (calls, primitive calls, own s, cumulative s, _)
    print(f"{args.requests} requests, vocabulary {vocabulary:,}, {wall:.1f} s, {stats['steps']} steps")
    for label, suffix, name in PARTS:
        seconds = sum(v[3] for (file, _, function), v in table.items() if file.endswith(suffix) and function == name)
        print(f"  {label:<30} {1000 * seconds / steps:7.2f} ms a step")
    print(
        f"  engine: masks {stats.get('mask_ms_per_constrained_step', 0):.2f} ms, waited "
        f"{stats.get('mask_wait_ms_per_constrained_step', 0):.2f} ms a constrained step"
    )
    # The host side only: the engine's own functions and the grammar library's calls (a CPU run's tensor work aside).
    pstats.Stats(profile).sort_stats("tottime").print_stats(r"batchjob/engine|LLMatcher|LLExecutor", 16)
    return 0


if __name__ == "__main__":
    sys.exit(main())
