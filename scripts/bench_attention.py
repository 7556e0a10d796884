"""GPU microbenchmark of the Triton paged-attention kernels against SDPA on dense K/V.

    python scripts/bench_attention.py results/attention.json [--sweep] [--iters 100] [--decode 32x640,64x1024]
        [--decode-only | --cases prefill,mixed] [--layers 32]

Decode: time per call (eager and replayed from a CUDA graph, its programs taking the sequences in batch order and
longest context first) and effective bandwidth = KV bytes read / time, next to SDPA on the same K/V laid out
densely (cases of one context length), and to a device-to-device copy measured in the same run.
Prefill: time and TFLOP/s of the varlen kernel vs dense causal SDPA. Mixed step (decodes beside fresh prompts):
the varlen kernel over the whole step and over each part, the decode kernel over the decodes, and both kernels
as the engine runs them, with a sweep of the varlen launch configs on each part. Store: Triton kernel vs
index_copy_.
`--sweep` also times every launch config and split count (and prints the best of each split count), to pick the
defaults in decode_attention.py and prefill_attention.py. `--decode` names the decode cases (sequences x context, or x
LO-HI for contexts drawn uniformly from that range), `--decode-only` skips the others (`--cases` names the kinds to
run), and `--layers N` times each decode call over N distinct caches in turn (a step's layers: one cache of a few
tens of MB stays partly in L2 between calls). Prints a table and writes everything as JSON to the path given.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from batchjob.engine.native.kernels.decode_attention import DecodeConfig, paged_decode_attention
from batchjob.engine.native.kernels.prefill_attention import (
    DEFAULT_PREFILL_CONFIG,
    PrefillConfig,
    paged_prefill_attention,
)
from batchjob.engine.native.layers.attention import AttentionMetadata, longest_first
from batchjob.engine.native.layers.triton_attention import TritonPagedAttention, store_kv

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16  # Llama-3.1-8B attention
DEVICE = torch.device("cuda")


def time_call(fn: Callable[[], object], iters: int) -> float:
    """Seconds per call, averaged over `iters` back-to-back calls after a warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def time_graph(fn: Callable[[], object], iters: int) -> float:
    """Seconds per call replayed from a CUDA graph of `iters` calls: no launch overhead, as in the engine."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    return time_call(graph.replay, 3) / iters


def sweep_point(timer: Callable[[Callable[[], object], int], float], fn, iters: int, work: float) -> dict:
    """One sweep measurement; a config needing more shared memory than the GPU has is recorded, not fatal."""
    try:
        seconds = timer(fn, iters)
    except OutOfResources as error:
        return {"seconds": None, "rate": None, "error": str(error)}
    return {"seconds": seconds, "rate": work / seconds}


def copy_bandwidth(iters: int) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * src.numel() / time_call(lambda: dst.copy_(src), iters)


def paged_step(query_lens: list[int], seq_lens: list[int]):
    """A paged cache with each sequence's blocks scattered at random, and the step's q/k/v and metadata (the
    decode kernel's order longest context first, as the engine's IO slot writes it)."""
    blocks_per_seq = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    order = torch.randperm(num_blocks - 1) + 1
    width = max(blocks_per_seq)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    start = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = order[start : start + n]
        start += n
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    slots = []
    for b, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        pos = torch.arange(seq_len - q_len, seq_len)
        slots.append(tables[b, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
    cu = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    meta = AttentionMetadata(
        cu_query_lens=cu.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE),
        slot_mapping=torch.cat(slots).to(DEVICE),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        decode_order=torch.from_numpy(longest_first(seq_lens)).to(DEVICE, torch.int32),
    )
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    k = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    v = torch.randn_like(k)
    return q, k, v, k_cache, v_cache, meta


def decode_contexts(num_seqs: int, context: str) -> list[int]:
    """A case's context lengths: `context` tokens each, or for `LO-HI` drawn uniformly from that range (seeded),
    as a long run's batch holds sequences at every length."""
    if "-" not in context:
        return [int(context)] * num_seqs
    low, high = (int(n) for n in context.split("-"))
    return torch.randint(low, high + 1, (num_seqs,), generator=torch.Generator().manual_seed(0)).tolist()


def decode_bench(num_seqs: int, context: str, sweep: bool, iters: int, layers: int = 1) -> dict:
    """Decode of `num_seqs` sequences at `context` tokens (`decode_contexts`). With `layers` > 1 every timed call
    runs the kernel over that many distinct caches one after another, as a decode step's layers do, and reports
    the time per layer: a single cache of a few tens of MB stays partly in L2 from one call to the next, a
    step's do not. The programs take the sequences in batch order and, as the engine launches them, longest
    context first."""
    contexts = decode_contexts(num_seqs, context)
    steps = [paged_step([1] * num_seqs, contexts) for _ in range(layers)]
    q, k, v, k_cache, v_cache, meta = steps[0]
    by_length = meta.decode_order
    kv_bytes = 2 * sum(contexts) * KV_HEADS * HEAD_DIM * k_cache.element_size()
    scale = HEAD_DIM**-0.5
    backend = TritonPagedAttention()
    splits = backend.decode_splits(num_seqs, KV_HEADS, DEVICE)
    default = backend.decode_launch_config(num_seqs, KV_HEADS, DEVICE)
    out = torch.empty_like(q)
    calls = max(1, iters // layers)

    def attend(num_splits: int = splits, config: DecodeConfig = default, order: torch.Tensor | None = None):
        def run():
            for q, _, _, k_cache, v_cache, meta in steps:
                paged_decode_attention(
                    q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_query_lens, scale, num_splits, out,
                    config, order=order,
                )  # fmt: skip

        return run

    def per_layer(timer):
        return lambda fn, n: timer(fn, n) / layers

    rows = {
        f"triton decode, {splits} splits (eager)": per_layer(time_call)(attend(), calls),
        f"triton decode, {splits} splits (graph)": per_layer(time_graph)(attend(), calls),
        f"triton decode, {splits} splits, longest first (graph)": per_layer(time_graph)(attend(order=by_length), calls),
        "triton store + decode (graph)": time_graph(
            lambda: backend.forward(q, k, v, k_cache, v_cache, meta, scale), iters
        ),
    }
    if len(set(contexts)) == 1:  # dense K/V of one length: the same bytes as the paged case
        dense_q = q.view(num_seqs, 1, HEADS, HEAD_DIM).transpose(1, 2)
        dense_k = torch.randn(num_seqs, KV_HEADS, contexts[0], HEAD_DIM, dtype=DTYPE, device=DEVICE)
        dense_v = torch.randn_like(dense_k)
        sdpa = lambda: F.scaled_dot_product_attention(dense_q, dense_k, dense_v, scale=scale, enable_gqa=True)
        rows["sdpa dense, gqa (eager)"] = time_call(sdpa, iters)
    result = {
        "num_seqs": num_seqs,
        "context": context,
        "contexts": contexts,
        "kv_bytes": kv_bytes,
        "default_splits": splits,
        "layers": layers,
    }
    result["rows"] = {name: {"seconds": t, "bytes_per_s": kv_bytes / t} for name, t in rows.items()}
    if sweep:
        configs = [DecodeConfig(n, w, s) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]
        points = [(ns, c) for c in configs for ns in sorted({1, 2, 3, 4, 8, 16, splits})]
        # Reading the block table a tile ahead is a one-split launch's option.
        points += [(1, dataclasses.replace(c, prefetch_table=True)) for c in configs]
        result["sweep"] = [
            {"splits": ns, **asdict(c), **sweep_point(per_layer(time_graph), attend(ns, c), calls, kv_bytes)}
            for ns, c in points
        ]
    return result


def prefill_bench(query_lens: list[int], seq_lens: list[int], sweep: bool, iters: int) -> dict:
    q, k, v, k_cache, v_cache, meta = paged_step(query_lens, seq_lens)
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(q)
    # Each query token attends to (its position + 1) keys: two matmuls of 2 * D flops per pair.
    pairs = sum(sum(range(s - ql + 1, s + 1)) for ql, s in zip(query_lens, seq_lens, strict=True))
    flops = 4 * pairs * HEADS * HEAD_DIM

    def attend(config: PrefillConfig = DEFAULT_PREFILL_CONFIG):
        return lambda: paged_prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_query_lens, scale, out, config
        )

    rows = {"triton varlen prefill": time_call(attend(), iters)}
    if all(ql == s for ql, s in zip(query_lens, seq_lens, strict=True)) and len(set(seq_lens)) == 1:
        dense_q = torch.randn(len(seq_lens), HEADS, seq_lens[0], HEAD_DIM, dtype=DTYPE, device=DEVICE)
        dense_kv = torch.randn(len(seq_lens), KV_HEADS, seq_lens[0], HEAD_DIM, dtype=DTYPE, device=DEVICE)
        rows["sdpa dense causal, gqa"] = time_call(
            lambda: F.scaled_dot_product_attention(dense_q, dense_kv, dense_kv, is_causal=True, enable_gqa=True), iters
        )
    result = {"query_lens": query_lens, "seq_lens": seq_lens, "flops": flops}
    result["rows"] = {name: {"seconds": t, "flops_per_s": flops / t} for name, t in rows.items()}
    if sweep:
        configs = [PrefillConfig(m, n, w, s) for m in (64, 128) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3)]
        result["sweep"] = [{**asdict(c), **sweep_point(time_call, attend(c), iters, flops)} for c in configs]
    return result


def mixed_bench(decodes: int, context: int, prompts: int, prompt_len: int, iters: int) -> dict:
    """A mixed step as the engine runs them when finished sequences are replaced: `decodes` one-token rows at
    `context` and `prompts` fresh prompts of `prompt_len` tokens. Times the varlen kernel over the whole step
    and over each part alone, and the decode kernel over the decode rows, so the cost of carrying decodes
    through the varlen kernel can be read off."""
    query_lens = [1] * decodes + [prompt_len] * prompts
    seq_lens = [context] * decodes + [prompt_len] * prompts
    q, k, v, k_cache, v_cache, meta = paged_step(query_lens, seq_lens)
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(q)
    kv_bytes = 2 * decodes * context * KV_HEADS * HEAD_DIM * k_cache.element_size()
    pairs = prompts * prompt_len * (prompt_len + 1) // 2
    flops = 4 * pairs * HEADS * HEAD_DIM

    def part(first: int, last: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Block tables, lengths and query offsets of sequences [first, last) as a step of their own."""
        cu = meta.cu_query_lens[first : last + 1]
        return meta.block_tables[first:last], meta.seq_lens[first:last], cu - cu[0]

    decode_part, prefill_part = part(0, decodes), part(decodes, decodes + prompts)
    q_decode, q_prefill = q[:decodes], q[decodes:]
    out_decode, out_prefill = out[:decodes], out[decodes:]
    splits = TritonPagedAttention().decode_splits(decodes, KV_HEADS, DEVICE)

    def varlen(query, parts, into, config=DEFAULT_PREFILL_CONFIG):
        return lambda: paged_prefill_attention(query, k_cache, v_cache, *parts, scale, into, config)

    def decode():
        return paged_decode_attention(q_decode, k_cache, v_cache, *decode_part, scale, splits, out_decode)

    whole = (meta.block_tables, meta.seq_lens, meta.cu_query_lens)
    whole_splits = TritonPagedAttention().decode_splits(decodes + prompts, KV_HEADS, DEVICE)

    def split_by_kernel():
        """What the engine runs: the decode kernel over the step (it skips the chunks), then the varlen kernel
        skipping the one-token rows."""
        paged_decode_attention(q, k_cache, v_cache, *whole, scale, whole_splits, out)
        paged_prefill_attention(q, k_cache, v_cache, *whole, scale, out, skip_single=True)

    rows = {
        "varlen kernel, whole step": time_graph(varlen(q, whole, out), iters),
        "decode kernel + varlen kernel, whole step": time_graph(split_by_kernel, iters),
        "varlen kernel, decode rows only": time_graph(varlen(q_decode, decode_part, out_decode), iters),
        f"decode kernel ({splits} split), decode rows only": time_graph(decode, iters),
        "varlen kernel, prompts only": time_graph(varlen(q_prefill, prefill_part, out_prefill), iters),
    }
    sweep = []
    for config in [PrefillConfig(m, n, w, s) for m in (64, 128) for n in (32, 64) for w in (4, 8) for s in (2, 3)]:
        for name, query, parts, into in (
            ("decode rows", q_decode, decode_part, out_decode),
            ("prompts", q_prefill, prefill_part, out_prefill),
        ):
            work = kv_bytes if name == "decode rows" else flops
            sweep.append(
                {
                    "part": name,
                    **asdict(config),
                    **sweep_point(time_graph, varlen(query, parts, into, config), iters, work),
                }
            )
    shape = {"decodes": decodes, "context": context, "prompts": prompts, "prompt_len": prompt_len}
    timed = {name: {"seconds": t} for name, t in rows.items()}
    return {**shape, "kv_bytes": kv_bytes, "flops": flops, "rows": timed, "sweep": sweep}


def store_bench(num_tokens: int, iters: int) -> dict:
    q, k, v, k_cache, v_cache, meta = paged_step([num_tokens], [num_tokens])
    flat_k, flat_v = k_cache.view(-1, KV_HEADS, HEAD_DIM), v_cache.view(-1, KV_HEADS, HEAD_DIM)

    def index_copy() -> None:
        flat_k.index_copy_(0, meta.slot_mapping, k)
        flat_v.index_copy_(0, meta.slot_mapping, v)

    rows = {
        "triton store_kv": time_graph(lambda: store_kv(k, v, k_cache, v_cache, meta.slot_mapping), iters),
        "torch index_copy_": time_graph(index_copy, iters),
    }
    written = 2 * k.numel() * k.element_size()
    return {"num_tokens": num_tokens, "rows": {n: {"seconds": t, "bytes_per_s": written / t} for n, t in rows.items()}}


def print_table(title: str, rows: dict, rate_key: str, unit: str, divisor: float) -> None:
    print(f"\n{title}")
    for name, row in rows.items():
        print(f"  {name:<50} {row['seconds'] * 1e6:10.1f} us  {row[rate_key] / divisor:8.2f} {unit}")


def best_of(sweep: list[dict]) -> dict:
    return max((r for r in sweep if r["rate"] is not None), key=lambda r: r["rate"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="where to write the JSON results")
    parser.add_argument("--sweep", action="store_true", help="also time every launch config and split count")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument(
        "--decode",
        default="64x1024,32x1152,32x640",
        help="decode cases, SEQSxCONTEXT separated by commas (CONTEXT LO-HI: lengths drawn uniformly from that range)",
    )
    parser.add_argument("--decode-only", action="store_true", help="skip the prefill, mixed-step and store cases")
    parser.add_argument("--cases", default="decode,prefill,mixed,store", help="kinds of case to run")
    parser.add_argument(
        "--layers", type=int, default=1, help="decode: time each call over this many distinct caches (a step's layers)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py needs a CUDA GPU; run it on a machine with one")
    torch.manual_seed(1234)

    results = {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": copy_bandwidth(20)}
    print(f"{results['device']}: device-to-device copy {results['copy_bytes_per_s'] / 1e12:.2f} TB/s")
    kinds = {"decode"} if args.decode_only else set(args.cases.split(","))
    cases = [case.split("x") for case in args.decode.split(",")] if "decode" in kinds else []
    results["decode"] = [decode_bench(int(b), s, args.sweep, args.iters, args.layers) for b, s in cases]
    for case in results["decode"]:
        title = f"decode {case['num_seqs']} seqs x {case['context']} ctx, KV {case['kv_bytes'] / 1e6:.0f} MB a layer"
        print_table(title, case["rows"], "bytes_per_s", "TB/s", 1e12)
        if "sweep" in case:
            print(f"  best of sweep (rate in B/s): {best_of(case['sweep'])}")
            for splits in sorted({r["splits"] for r in case["sweep"]}):
                best = best_of([r for r in case["sweep"] if r["splits"] == splits])
                rate = best["rate"] / 1e12
                print(f"  best with {splits} splits: {best['seconds'] * 1e6:.1f} us, {rate:.2f} TB/s: {best}")
    prefill_cases = (
        ([1024] * 8, [1024] * 8),
        ([512] * 4, [2048] * 4),
        ([1432], [1832]),  # a prompt's chunk after 400 cached tokens, as finished sequences are replaced
        ([1, 1, 1, 1, 900, 300], [700, 300, 2000, 64, 900, 1500]),
    )
    prefill_cases = prefill_cases if "prefill" in kinds else ()
    results["prefill"] = [prefill_bench(list(ql), list(sl), args.sweep, args.iters // 4) for ql, sl in prefill_cases]
    for case in results["prefill"]:
        print_table(
            f"prefill q_lens {case['query_lens']} seq_lens {case['seq_lens']}",
            case["rows"],
            "flops_per_s",
            "TFLOP/s",
            1e12,
        )
        if "sweep" in case:
            ranked = sorted((r for r in case["sweep"] if r["rate"]), key=lambda r: -r["rate"])
            for r in ranked[:4]:
                config = f"m {r['block_m']}, n {r['block_n']}, {r['num_warps']} warps, {r['num_stages']} stages"
                print(f"  sweep: {config:<44} {r['seconds'] * 1e6:8.1f} us {r['rate'] / 1e12:8.1f} TFLOP/s")
    mixed_cases = ((256, 1300, 4, 1024), (64, 600, 2, 1024)) if "mixed" in kinds else ()
    results["mixed"] = [mixed_bench(d, c, p, n, args.iters // 4) for d, c, p, n in mixed_cases]
    for case in results["mixed"]:
        print(
            f"\nmixed step: {case['decodes']} decodes at {case['context']}"
            f" + {case['prompts']} x {case['prompt_len']} prompt"
        )
        for name, row in case["rows"].items():
            print(f"  {name:<42} {row['seconds'] * 1e6:10.1f} us")
        for part in ("decode rows", "prompts"):
            best = max((r for r in case["sweep"] if r["part"] == part and r["rate"]), key=lambda r: r["rate"])
            print(f"  best varlen config for the {part}: {best}")
    results["store"] = [store_bench(n, args.iters) for n in ((64, 8192) if "store" in kinds else ())]
    for case in results["store"]:
        print_table(f"store {case['num_tokens']} tokens", case["rows"], "bytes_per_s", "TB/s", 1e12)

    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
