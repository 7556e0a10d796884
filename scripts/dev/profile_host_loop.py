"""The native engine's host work a step, without a model or GPU: the real scheduler, block manager, step layout,
IO slot fill and output processing over `--seqs` sequences at `--context` tokens (one finishing and one admitted
every `--finish-every` steps). Prints each part's median milliseconds a step. `--against DIR` alternates fresh
processes of this version and the tree in DIR (a host's Python speed drifts between processes) and prints the
median of the pairs' ratios; `--constrained-every K` puts every K-th sequence under the benchmark's schema.

    python scripts/dev/profile_host_loop.py [--seqs 256] [--context 1300] [--steps 300] [--sampling]
        [--constrained-every K] [--processes N] [--against DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from batchjob.engine import Request, SamplingParams
from batchjob.engine.native.output import OutputProcessor
from batchjob.engine.native.runtime.io_slot import IOSlot, SlotLimits
from batchjob.engine.native.runtime.step_handle import StepHandle, StepResult
from batchjob.engine.native.runtime.step_layout import (
    GRAPH_MODES,
    GraphBuckets,
    decode_buckets,
    layout_step,
    mixed_buckets,
)
from batchjob.engine.native.scheduling.block_manager import KVBlockManager
from batchjob.engine.native.scheduling.scheduler import Scheduler, SchedulerConfig
from batchjob.engine.native.scheduling.sequence import RequestGroup, Sequence

BLOCK = 16
VOCAB = 128_256
REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().relative_to(REPO)  # the same script in another version's tree


def _sequence(seq_id: int, prompt_len: int, max_new: int, sampling: bool, schema: str | None = None) -> Sequence:
    if schema is not None:
        params = SamplingParams(max_new, json_schema=schema)
    else:
        params = SamplingParams(max_new, ignore_eos=True, temperature=0.8 if sampling else 0.0, top_p=0.95)
    prompt = tuple(int(t) for t in np.random.default_rng(seq_id).integers(3, VOCAB, prompt_len))
    request = Request(seq_id, prompt, params)
    return Sequence.create(seq_id, RequestGroup(request, prompt_len), 0, prompt_len + max_new, seq_id, BLOCK)


class _Runner:
    """What the mask worker needs of a model runner, without a GPU."""

    def bitmask_rows(self, step: StepHandle) -> torch.Tensor:
        return step.slot.host_bitmask[: step.masked_rows]

    def enqueue_masked_sampler(self, step: StepHandle) -> None:
        step.sampled = True

    def arm_gate(self, step: StepHandle) -> bool:
        return False  # no GPU: no gates, the sampler counts as enqueued once the masks are filled


def _grammars(cache: Path):
    """A grammar compiler over the benchmark's generated 128k BPE, and its EOS id."""
    from bench_lib.bpe import bpe_tokenizer

    from batchjob.engine.grammar import GrammarCompiler

    tokenizer = bpe_tokenizer(cache)
    return GrammarCompiler(tokenizer, VOCAB, (tokenizer.eos_token_id,)), tokenizer.eos_token_id


def _tokens(plan, slot: IOSlot, rows: int, rng: np.random.Generator) -> np.ndarray:
    """A token for each sampled row: random, or for a constrained row one its bitmask row allows."""
    tokens = rng.integers(3, VOCAB, rows)
    sampled = [seq for seq, keep in zip(plan.seqs, plan.samples, strict=True) if keep]
    masks = slot.host_bitmask.numpy()
    k = 0
    for row, seq in enumerate(sampled):
        if seq.matcher is not None:
            allowed = np.flatnonzero(np.unpackbits(masks[k].view(np.uint8), bitorder="little")[:VOCAB])
            tokens[row] = rng.choice(allowed)
            k += 1
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--context", type=int, default=1300, help="prompt tokens of every sequence")
    parser.add_argument("--steps", type=int, default=300, help="steady-state steps measured")
    parser.add_argument("--finish-every", type=int, default=3)
    parser.add_argument("--sampling", action="store_true", help="temperature 0.8, top-p 0.95 (default: greedy)")
    parser.add_argument("--constrained-every", type=int, default=0, help="every K-th sequence under a JSON schema")
    default_cache = Path(os.environ.get("BATCHJOB_CACHE", Path.home() / ".cache" / "batchjob")) / "bench"
    parser.add_argument("--cache", type=Path, default=default_cache, help="where the generated BPE is kept")
    parser.add_argument("--processes", type=int, default=1, help="fresh processes measured: each part's median, range")
    parser.add_argument("--against", type=Path, help="another version's source tree, alternating with this one")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one process's medians, for the parent
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "scripts"))  # bench_lib: the constrained rows' schema and vocabulary
    if args.against is not None:
        _compare(args)
    elif args.processes > 1:
        runs = [_child(REPO) for _ in range(args.processes)]
        ranges = {part: (min(r[part] for r in runs), max(r[part] for r in runs)) for part in runs[0]}
        _report(args, {part: statistics.median(r[part] for r in runs) for part in runs[0]}, ranges)
    elif args.json:
        print(json.dumps(_measure(args)))
    else:
        _report(args, _measure(args))


def _child(root: Path) -> dict[str, float]:
    """One measurement in a fresh process of the version in `root`: the same arguments, its medians as JSON."""
    argv = _without(_without(sys.argv[1:], "--processes"), "--against")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(root / SCRIPT), *argv, "--json"]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"the measurement in {root} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _without(argv: list[str], option: str) -> list[str]:
    """`argv` less `option` and its value, written as one word or two."""
    argv = [a for a in argv if not a.startswith(option + "=")]
    if option in argv:
        i = argv.index(option)
        argv = argv[:i] + argv[i + 2 :]
    return argv


def _compare(args: argparse.Namespace) -> None:
    against = args.against.resolve()
    if not (against / "batchjob").is_dir() or not (against / SCRIPT).is_file():
        raise SystemExit(f"--against {args.against}: no batchjob/ and {SCRIPT} there")
    pairs = [(_child(REPO), _child(against)) for _ in range(max(args.processes, 1))]
    parts = [p for p in pairs[0][0] if p in pairs[0][1]]
    loop = [p for p in parts if not p.endswith("a step") and not p.startswith("(")]
    print(f"{len(pairs)} pairs of processes, this version ({REPO}) against {against}: medians, and the median of")
    print("the pairs' ratios (this / that)")
    rows = [(p, [a[p] for a, _ in pairs], [b[p] for _, b in pairs]) for p in parts]
    totals = [sum(a[p] for p in loop) for a, _ in pairs], [sum(b[p] for p in loop) for _, b in pairs]
    for part, mine, theirs in [*rows, ("host work a step", *totals)]:
        ratio = statistics.median(x / y for x, y in zip(mine, theirs, strict=True) if y > 0) if any(theirs) else 0
        print(f"  {part:<24} {statistics.median(mine):8.3f} {statistics.median(theirs):8.3f}  {ratio:5.2f}x")


def _report(args: argparse.Namespace, medians: dict[str, float], ranges: dict | None = None) -> None:
    mode = "sampling" if args.sampling else "greedy"
    under = f", every {args.constrained_every} under a JSON schema" if args.constrained_every else ""
    over = f" of {args.processes} processes' medians, [their range]" if ranges else ""
    shape = f"{args.seqs} sequences at {args.context} tokens of context"
    print(f"{shape}, {mode}{under}, {args.steps} steps (medians{over})")
    for part, value in medians.items():
        spread = f"  [{ranges[part][0]:.3f}-{ranges[part][1]:.3f}]" if ranges else ""
        print(f"  {part:<24} {value:8.3f}" + ("" if part.endswith("a step") else " ms") + spread)
    loop = [k for k in medians if not k.endswith("a step") and not k.startswith("(")]
    total = sum(medians[k] for k in loop)
    print(f"  {'host work a step':<24} {total:8.3f} ms  (the loop's; not the worker's masks)")


def _measure(args: argparse.Namespace) -> dict[str, float]:
    """One process's medians: milliseconds a step of each part (counts for the parts "... a step")."""
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
        mixed=tuple(mixed_buckets(budget, args.seqs)),
        mixed_modes=frozenset(GRAPH_MODES),
        mixed_seqs=args.seqs,
    )
    grammars, eos, masks, schema = None, 2, None, None
    if args.constrained_every:
        from bench_lib.workloads import RECORDS_SCHEMA

        from batchjob.engine.native.step_masks import StepMasks

        grammars, eos = _grammars(args.cache)
        masks = StepMasks(_Runner(), grammars)
        schema = json.dumps(RECORDS_SCHEMA)
    output = OutputProcessor(None, (eos,), detokenize=False, grammars=grammars)
    next_id = 0
    live: dict[int, Sequence] = {}

    def admit() -> None:
        nonlocal next_id
        constrained = args.constrained_every and next_id % args.constrained_every == 0
        seq = _sequence(next_id, args.context, max_len - args.context, args.sampling, schema if constrained else None)
        if constrained:
            seq.matcher = grammars.matcher(seq.sampling.constraint)
        scheduler.add(seq)
        live[seq.seq_id] = seq
        next_id += 1

    for _ in range(args.seqs):
        admit()
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
        masked = slot.fill(plan, layout.shape, BLOCK)
        filled = time.perf_counter()
        rows = int(plan.samples.sum())
        handle = StepHandle(plan, slot, layout.shape, rows, layout.mode, masked_rows=masked)
        handed = masks_done = filled
        if masked:
            handle.sampled = False
            masks.start(handle)
            handed = time.perf_counter()
            masks.finish()
            masks_done = time.perf_counter()
        result = StepResult(_tokens(plan, slot, rows, rng), None, None, None)
        chosen = time.perf_counter()
        finished = [c.id for c in output.process(handle, result, scheduler)]
        if step >= warm and step % args.finish_every == 0:
            oldest = live[min(live)]
            scheduler.finish(oldest, "length")
            finished.append(oldest.seq_id)
        for seq_id in finished:
            del live[seq_id]
            admit()
        processed = time.perf_counter()
        if step >= warm:
            times["scheduling"].append(scheduled - began)
            times["layout and slot fill"].append(filled - scheduled)
            if masks is not None:
                times["handing masks over"].append(handed - filled)
            times["processing the tokens"].append(processed - chosen)
            if masks is not None:
                times["(masks, the worker's)"].append(masks_done - handed)
            times["sequences a step"].append(len(plan.seqs) / 1000)
            times["tokens a step"].append(plan.num_tokens / 1000)
        step += 1
    if masks is not None:
        masks.abandon()
        masks.close()
    return {part: 1000 * statistics.median(values) for part, values in times.items()}


if __name__ == "__main__":
    main()
