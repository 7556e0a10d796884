"""Time llguidance's token masks with the engine's string slices, the library's default ones and none, and check
that all three give the same masks.

    python scripts/dev/profile_masks.py [--walks 6] [--steps 200] [--tokenizer bpe|cl100k|DIR]

The schema is the benchmark's `RECORDS_SCHEMA`; the vocabulary `bench_lib.bpe`'s generated 128k BPE (cached under
`--cache`), tiktoken's cl100k_base, or a tokenizer directory. Each walk takes up to `--steps` tokens, each the best
of seeded random scores among the allowed ones (every other walk a fresh draw), forced tokens at once. Prints each
setting's mean, p90 and maximum mask time and the slowest 5%'s share, the masks that differed (must be 0), and how
much of the vocabulary the masks allow.
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
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
