"""Time llguidance's token masks with the engine's string slices against the library's default slices and
against none, on one schema and vocabulary, and check that all three give the same masks.

    python scripts/dev/profile_masks.py [--walks 6] [--tokenizer bpe|cl100k|DIR] [--fill-rows 256]

The vocabulary is `bench_lib.bpe`'s 128,256-id byte-level BPE (trained on first use, then cached under
`--cache`), tiktoken's cl100k_base (`--tokenizer cl100k`, a real vocabulary), or the tokenizer in
`--tokenizer DIR`; the schema is the benchmark's `RECORDS_SCHEMA`. Each walk starts a
fresh matcher per setting and takes up to `--steps` tokens, each the highest of seeded random scores among the
allowed ones (as a random-weight model does greedily), or on every other walk a fresh random draw; forced tokens
are taken at once (jump-forward). Every mask is timed on one thread. Prints the mean, 90th percentile, maximum and
the slowest 5%'s share of the time per setting, the number of masks that differed (must be 0), and how much of
the vocabulary the masks allow. With `--fill-rows`, a batch of that many rows is also timed as a step fills it,
in one parallel call: with the engine's matchers, and with matchers that all share one lexer (llguidance's copies
of one matcher do), against the rows' masks one by one on one thread and the slowest row's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_lib.models import DEFAULT_CACHE  # noqa: E402
from bench_lib.workloads import RECORDS_SCHEMA  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--walks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=200, help="tokens per walk at most")
    parser.add_argument("--tokenizer", default="bpe", help="bpe (generated, 128k), cl100k, or a tokenizer directory")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the 128k BPE is kept")
    parser.add_argument(
        "--fill-rows", type=int, default=0, help="also time parallel fills of this many rows at once (a step's masks)"
    )
    parser.add_argument("--fill-steps", type=int, default=10, help="steps timed for each way of filling")
    args = parser.parse_args(argv)

    import llguidance
    import llguidance.hf
    import torch
    from bench_lib.bpe import named_tokenizer

    from batchjob.engine.api import Constraint
    from batchjob.engine.grammar import bitmask_words, grammar_text
    from batchjob.engine.grammar_vocab import string_slices

    tokenizer = named_tokenizer(args.tokenizer, args.cache)
    vocab = len(tokenizer)
    eos = [tokenizer.eos_token_id or 0]
    settings = {
        "none": [],
        "library default": llguidance.LLTokenizer.general_slices(),
        "engine": string_slices(llguidance.LLTokenizer.general_slices()),
    }
    built = {
        name: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos, slices=s)
        for name, s in settings.items()
    }
    grammar = grammar_text(Constraint("json_schema", json.dumps(RECORDS_SCHEMA)))
    words = bitmask_words(vocab)
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((64, vocab)).astype(np.float32)
    times: dict[str, list[float]] = {name: [] for name in settings}
    differing = 0
    widths: list[float] = []  # the share of the vocabulary each mask allows
    for walk in range(args.walks):
        matchers = {name: llguidance.LLMatcher(t, grammar, log_level=0) for name, t in built.items()}
        for step in range(args.steps):
            masks = {}
            for name, matcher in matchers.items():
                mask = torch.zeros(words, dtype=torch.int32)
                began = time.perf_counter()
                matcher.unsafe_compute_mask_ptr(mask.data_ptr(), words * 4)
                times[name].append(time.perf_counter() - began)
                masks[name] = mask
            differing += not all(torch.equal(masks["none"], m) for m in masks.values())
            allowed = np.unpackbits(masks["none"].numpy().view(np.uint8), bitorder="little")[:vocab].astype(bool)
            widths.append(allowed.mean())
            row = rng.standard_normal(vocab) if walk % 2 else scores[(7 * step + walk) % len(scores)].copy()
            row[~allowed] = -np.inf
            token = int(np.argmax(row))
            for matcher in matchers.values():
                assert matcher.consume_token(token), matcher.get_error()
                forced = matcher.compute_ff_tokens()
                if forced:
                    matcher.consume_tokens(forced)
            if matchers["none"].is_stopped():
                break
    masks_timed = len(times["none"])
    print(f"{masks_timed} masks over {args.walks} walks, vocabulary {vocab:,}; masks that differed: {differing}")
    for name, seconds in times.items():
        us = np.array(seconds) * 1e6
        slowest = np.sort(us)[-max(1, len(us) // 20) :]  # the slowest 5%: a step waits for its slowest mask
        print(
            f"  slices {name:<16} mean {us.mean():7.0f} us   p90 {np.percentile(us, 90):7.0f} us"
            f"   max {us.max():7.0f} us   slowest 5%: {slowest.sum() / us.sum():.0%} of the time"
        )
    # Sampling first and checking the token after (a mask only for a rejected token) pays where masks are wide:
    # a token drawn uniformly without the mask is accepted with the allowed share's probability.
    share = np.array(widths)
    print(
        f"  allowed share of the vocabulary: mean {share.mean():.3f}; masks allowing >= half of it"
        f" {(share >= 0.5).mean():.1%}, >= 90% {(share >= 0.9).mean():.1%}"
    )
    if args.fill_rows:
        time_parallel_fills(tokenizer, built["engine"], vocab, eos, args.fill_rows, args.fill_steps)
    return 1 if differing else 0


def time_parallel_fills(tokenizer, index, vocab: int, eos: list[int], rows: int, steps: int) -> None:
    """A batch of rows advances together, each drawing uniformly among its allowed tokens (a fresh matcher once
    one stops), as a batch of a random-weight model does. It is kept twice, advanced by the same tokens: with
    the engine's matchers (`GrammarCompiler.matcher`: several copies of the constraint, each with its lexer)
    and with copies of one matcher, whose lexer they all share. Each step times one way of filling the batch's
    masks, in turn: one llguidance call on either, or every row alone on this thread; only the first fill of
    a state is timed (a matcher keeps its last mask), and both batches' masks are then filled untimed, so
    their lexers stay as warm as a run's. `index`: llguidance's index of the vocabulary with the engine's slices,
    for timing a compile of the constraint."""
    import llguidance
    import torch

    from batchjob.engine.api import Constraint
    from batchjob.engine.grammar import GrammarCompiler, Matcher, grammar_text

    compiler = GrammarCompiler(tokenizer, vocab, eos)
    constraint = Constraint("json_schema", json.dumps(RECORDS_SCHEMA))
    one = compiler.matcher(constraint)

    def copy(matcher: Matcher) -> Matcher:  # shares the original's lexer
        return Matcher(matcher.inner.deep_copy())

    batches = {"engine": [compiler.matcher(constraint) for _ in range(rows)], "one": [copy(one) for _ in range(rows)]}
    began = time.perf_counter()
    for _ in range(5):  # what each of the constraint's copies cost to compile
        llguidance.LLMatcher(index, grammar_text(constraint), log_level=0)
    compile_ms = 1e3 * (time.perf_counter() - began) / 5
    bitmask = torch.zeros(rows, compiler.words, dtype=torch.int32)
    single = torch.zeros(1, compiler.words, dtype=torch.int32)
    rng = np.random.default_rng(1)
    ways = ("alone", "one", "engine")
    fills: dict[str, list[float]] = {way: [] for way in ways}
    slowest: list[float] = []

    def fill(matchers: list[Matcher]) -> float:
        began = time.perf_counter()
        compiler.fill_bitmasks([(m, i) for i, m in enumerate(matchers)], bitmask)
        return time.perf_counter() - began

    warmup = 10  # steps that spread the rows over the schema first
    for step in range(warmup + steps * len(ways)):
        way = ways[step % len(ways)]
        if step >= warmup and way == "alone":
            each = []
            for matcher in [copy(m) for m in batches["engine"]]:
                began = time.perf_counter()
                compiler.fill_bitmasks([(matcher, 0)], single)  # one row: the library's call on this thread
                each.append(time.perf_counter() - began)
            fills[way].append(sum(each))
            slowest.append(max(each))
        elif step >= warmup:
            fills[way].append(fill([copy(m) for m in batches[way]]))
        fill(batches["one"])
        fill(batches["engine"])
        allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        for i, matcher in enumerate(batches["engine"]):
            if matcher.is_stopped:
                batches["engine"][i] = compiler.matcher(constraint)
                batches["one"][i] = copy(one)
                continue
            token = int(rng.choice(np.flatnonzero(allowed[i])))
            for batch in batches.values():
                assert batch[i].consume(token), batch[i].error
                forced = batch[i].forced_tokens()
                if forced:
                    batch[i].consume_forced(forced)
    print(
        f"{rows} rows' masks a step, {steps} steps a way (medians); llguidance threads {compiler.threads}, "
        f"lexers a constraint {compiler.lexers}:"
    )
    print(
        f"  row by row on one thread: {1e3 * np.median(fills['alone']):.2f} ms,"
        f" its slowest row {1e3 * np.median(slowest):.2f} ms"
    )
    print(f"  one call, every row sharing one lexer: {1e3 * np.median(fills['one']):.2f} ms")
    print(f"  one call, the engine's matchers: {1e3 * np.median(fills['engine']):.2f} ms")
    print(f"  compiling a copy of the constraint: {compile_ms:.2f} ms")


if __name__ == "__main__":
    sys.exit(main())
