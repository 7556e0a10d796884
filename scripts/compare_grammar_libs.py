"""Compare grammar libraries for structured outputs on a 128k-token vocabulary: validity, compile time,
per-token mask time, memory.

    python scripts/compare_grammar_libs.py --samples 40 --out grammar-libs.json

The vocabulary is `bench_lib.bpe`'s 128,256-id byte-level BPE (trained on generated text in a minute or two on
first use, then cached). Each library runs in its own process, so its memory is its own: the resident set
size after the tokenizer is loaded is the baseline. For every library and schema: the time to build the
library's view of the vocabulary, the time to compile the schema, then `--samples` generations that pick a
token *uniformly* among the allowed ones (a random-weight model explores what a real one rarely does), timing
each mask. A generation is valid when Python's strict `json.loads` parses it and `jsonschema` validates it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib.bpe import bpe_tokenizer  # noqa: E402

LIBRARIES = ("llguidance", "xgrammar", "outlines_core")
DEFAULT_CACHE = Path(os.environ.get("BATCHJOB_CACHE", Path.home() / ".cache" / "batchjob")) / "bench"

# What an extraction or synthetic-data job asks for: nested objects, enums, bounded integers, arrays with
# maxItems, strings with maxLength and a pattern, an optional nullable number.
PRODUCT_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999999},
        "title": {"type": "string", "maxLength": 60},
        "category": {"enum": ["books", "electronics", "garden", "toys", "food"]},
        "price": {"type": "number", "minimum": 0},
        "in_stock": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 5},
        "seller": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
            },
            "required": ["name", "rating", "country"],
            "additionalProperties": False,
        },
        "reviews": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                    "text": {"type": "string", "maxLength": 80},
                },
                "required": ["stars", "text"],
                "additionalProperties": False,
            },
        },
        "discount": {"type": ["number", "null"]},
    },
    "required": ["id", "title", "category", "price", "in_stock", "tags", "seller", "reviews"],
    "additionalProperties": False,
}
# Every JSON string escape and Unicode: where a library's string rule differs from strict JSON, it shows.
FREE_TEXT_SCHEMA = {
    "type": "object",
    "properties": {"note": {"type": "string", "maxLength": 24}, "n": {"type": "integer", "minimum": -9, "maximum": 9}},
    "required": ["note", "n"],
    "additionalProperties": False,
}
SCHEMAS = {"product": PRODUCT_SCHEMA, "free_text": FREE_TEXT_SCHEMA}


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


# Each builder returns (matcher class, vocabulary set-up seconds, compile seconds). A matcher's `mask_into(row)`
# fills an int32 bitmask row, `consume(token)` advances it, `done()` says the grammar is complete.


def _llguidance(tokenizer, schema: dict):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer)
    vocab_s = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    t0 = time.perf_counter()
    proto = llguidance.LLMatcher(lltok, grammar)
    if proto.is_error():
        raise RuntimeError(proto.get_error())
    proto.compute_bitmask()  # the first mask finishes the lazy part of compilation
    compile_s = time.perf_counter() - t0

    class M:
        def __init__(self) -> None:
            # As batchjob does: each sample copies the compiled matcher (its lexer is built once, lazily).
            self.m = proto.deep_copy()

        def mask_into(self, row) -> None:
            self.m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

        def consume(self, token: int) -> bool:
            return self.m.consume_token(token)

        def done(self) -> bool:
            return self.m.is_stopped()

    return M, vocab_s, compile_s


def _xgrammar(tokenizer, schema: dict):
    import torch
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    vocab_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(",", ":"), strict_mode=True
    )
    compile_s = time.perf_counter() - t0

    class M:
        def __init__(self) -> None:
            self.m = xgr.GrammarMatcher(compiled)
            self.buf = xgr.allocate_token_bitmask(1, len(tokenizer))

        def mask_into(self, row) -> None:
            self.m.fill_next_token_bitmask(self.buf)
            row[:] = self.buf[0].numpy()

        def consume(self, token: int) -> bool:
            return self.m.accept_token(token)

        def done(self) -> bool:
            return self.m.is_terminated()

    del torch
    return M, vocab_s, compile_s


def _byte_vocabulary(tokenizer) -> dict[bytes, list[int]]:
    """Each non-special token's bytes (byte-level BPE stores bytes as printable characters)."""
    from tokenizers import pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # GPT-2's byte-to-character table: printable bytes map to themselves, the rest to 256 + k in order.
    table, extra = {}, 0
    for b in range(256):
        ch = chr(b)
        if ch in alphabet and (33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255):
            table[ch] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    out: dict[bytes, list[int]] = {}
    for token, i in tokenizer.get_vocab().items():
        if i not in special:
            out.setdefault(bytes(table[c] for c in token), []).append(i)
    return out


def _outlines_core(tokenizer, schema: dict):
    import outlines_core as oc

    t0 = time.perf_counter()
    vocabulary = oc.Vocabulary(tokenizer.eos_token_id, _byte_vocabulary(tokenizer))
    vocab_s = time.perf_counter() - t0
    regex = oc.json_schema.build_regex_from_schema(json.dumps(schema))
    t0 = time.perf_counter()
    index = oc.Index(regex, vocabulary)
    compile_s = time.perf_counter() - t0

    class M:
        def __init__(self) -> None:
            self.m = oc.Guide(index)
            self.finished = False

        def mask_into(self, row) -> None:
            self.m.write_mask_into(row.ctypes.data, row.size, row.itemsize)

        def consume(self, token: int) -> bool:
            if token == tokenizer.eos_token_id:
                self.finished = self.m.is_finished()
                return self.finished
            self.m.advance(token)
            return True

        def done(self) -> bool:
            return self.finished

    return M, vocab_s, compile_s


BUILDERS = {"llguidance": _llguidance, "xgrammar": _xgrammar, "outlines_core": _outlines_core}


def measure(library: str, schema_name: str, samples: int, max_tokens: int, cache: Path) -> dict:
    import jsonschema

    tokenizer = bpe_tokenizer(cache)
    vocab = len(tokenizer)
    schema = SCHEMAS[schema_name]
    validator = jsonschema.Draft202012Validator(schema)
    base_rss = rss_bytes()
    matcher_cls, vocab_s, compile_s = BUILDERS[library](tokenizer, schema)
    compiled_rss = rss_bytes()
    rng = np.random.default_rng(0)
    words = (vocab + 31) // 32
    row = np.zeros(words, dtype=np.int32)
    mask_s, masks, finished, valid, control_chars, allowed_counts = 0.0, 0, 0, 0, 0, []
    failures: list[str] = []
    for _ in range(samples):
        m = matcher_cls()
        ids: list[int] = []
        ended = False
        for _ in range(max_tokens):
            t0 = time.perf_counter()
            m.mask_into(row)
            mask_s += time.perf_counter() - t0
            masks += 1
            allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])
            allowed_counts.append(len(allowed))
            if len(allowed) == 0:
                break
            token = int(rng.choice(allowed))
            if not m.consume(token):
                break
            if token != tokenizer.eos_token_id:
                ids.append(token)
            if token == tokenizer.eos_token_id or m.done():
                ended = True
                break
        if not ended:
            continue
        finished += 1
        text = tokenizer.decode(ids)
        control_chars += any(ord(c) < 0x20 for c in text)
        try:
            validator.validate(json.loads(text))
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError) as error:
            if len(failures) < 3:
                failures.append(f"{type(error).__name__}: {str(error).splitlines()[0][:120]} in {text[:200]!r}")
    return {
        "library": library,
        "schema": schema_name,
        "vocab": vocab,
        "vocab_setup_s": vocab_s,
        "compile_s": compile_s,
        "rss_after_compile_mib": (compiled_rss - base_rss) / 2**20,
        "rss_after_sampling_mib": (rss_bytes() - base_rss) / 2**20,
        "samples": samples,
        "finished": finished,
        "valid": valid,
        "with_control_chars": control_chars,
        "mask_us_mean": 1e6 * mask_s / max(masks, 1),
        "masks": masks,
        "allowed_median": float(np.median(allowed_counts)) if allowed_counts else 0.0,
        "failures": failures,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument("--schemas", default=",".join(SCHEMAS))
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=1500)
    parser.add_argument("--timeout-s", type=float, default=900, help="per library and schema")
    parser.add_argument("--model-cache", type=Path, default=DEFAULT_CACHE, help="where the tokenizer is cached")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--worker", nargs=2, metavar=("LIBRARY", "SCHEMA"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(*args.worker, args.samples, args.max_tokens, args.model_cache)))
        return 0
    bpe_tokenizer(args.model_cache)  # train once, before the timed workers
    results = []
    for schema in args.schemas.split(","):
        for library in args.libraries.split(","):
            command = [sys.executable, __file__, "--worker", library, schema, "--samples", str(args.samples)]
            command += ["--max-tokens", str(args.max_tokens), "--model-cache", str(args.model_cache)]
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s)
                if done.returncode != 0:
                    tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
                    result = {"library": library, "schema": schema, "error": tail[0][:300]}
                else:
                    result = json.loads(done.stdout.strip().splitlines()[-1])
            except subprocess.TimeoutExpired:
                result = {"library": library, "schema": schema, "error": f"timed out after {args.timeout_s:.0f} s"}
            results.append(result)
            print(json.dumps(result), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\n{'schema':10} {'library':14} {'valid/finished/samples':>22} {'compile s':>10} {'mask us':>9} {'MiB':>7}")
    for r in results:
        if "error" in r:
            print(f"{r['schema']:10} {r['library']:14} error: {r['error']}")
            continue
        counts = f"{r['valid']}/{r['finished']}/{r['samples']}"
        print(
            f"{r['schema']:10} {r['library']:14} {counts:>22} {r['compile_s']:>10.3f} {r['mask_us_mean']:>9.0f} "
            f"{r['rss_after_sampling_mib']:>7.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
