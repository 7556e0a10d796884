"""Paged decode attention by launch shape at a benchmark model's decode steps: the engine's launch (`default_config`,
`default_num_splits`, the longest context first) against each `DecodeConfig` asked for, per row count:

    python scripts/dev/decode_attention_shapes.py --architecture llama-3.2-1b --rows 256,512 --context 64-1536
    python scripts/dev/decode_attention_shapes.py --architecture llama-3.1-8b --rows 32,256 --block-n 32,64 --warps 4,8
    python scripts/dev/decode_attention_shapes.py --deterministic --block-m 16,32,64 --block-n 32,64 --stages 2,3,4
    python scripts/dev/decode_attention_shapes.py --deterministic --prefill 8192 --context 64-1024 --block-m 16,64
    python scripts/dev/decode_attention_shapes.py --deterministic --row-sum-dot --rows 256,512 --block-m 16,64
    python scripts/dev/decode_attention_shapes.py --deterministic --rows 256,512 --block-m 16 --longest-first 0,1

With `--deterministic` the launches are those of `engine.deterministic=true`, where a decode goes through the varlen
kernel with every key tile masked (`paged_prefill_attention(mask_every_tile=True)`) in each `PrefillConfig` asked for
(`--block-m` packed query rows a program, `--block-n`, `--warps`, `--stages`), against the deterministic engine's
own config; the default engine's decode launch is printed beside them. With `--prefill N` the step is a prefill
chunk instead: whole prompts of `--context` lengths, N tokens in all, every token a query (the default engine's
prefill launch beside). A launch marked = computed every output bit as the deterministic engine's launch did
(compared as float32 results): a launch that may serve some of the steps in that mode must, since there a token's
bits must not depend on the step that took it. With `--row-sum-dot` every launch, the engine's own included, adds
the softmax's row sums on the tensor cores (`PrefillConfig.row_sum_dot`) rather than across threads in an order
that follows the tile's layout. `--longest-first 1` tries a decode step's launch with the programs taking the
sequences longest context first (`paged_prefill_attention(order=...)`), as the default engine's decode launch does.

Contexts are drawn uniformly from the `--context` range (numpy's default_rng(1234)), as a mixed workload's decode
steps hold them, and each sequence's cache blocks are scattered over the pool as a running engine leaves them. A
time is a call's share of a CUDA graph of calls over as many layers' caches as outgrow the L2 cache, one after
another (`bench_lib.hardware.per_call_us`: median of 20 replays), so neither launch overhead nor a cache hit counts. The
floor reads every cached key and value once, and the queries and outputs, at the copy rate measured here first. A
launch whose output is not the engine launch's within bf16's tolerance is marked !.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent)]

from bench_lib.hardware import L2_BYTES, measure_copy_bandwidth, measure_matmul_rate, per_call_us  # noqa: E402
from bench_lib.workloads import ARCHITECTURES  # noqa: E402

BLOCK_SIZE = 16  # the engine's default `engine.block_size`


def decode_step(rows: int, context: tuple[int, int], heads: int, kv_heads: int, head_dim: int):
    """One decode step's inputs and `layers` caches: (q, caches, block_tables, seq_lens, cu_query_lens, order,
    KV bytes a layer reads)."""
    import numpy as np

    lengths = np.random.default_rng(1234).integers(context[0], context[1] + 1, size=rows)
    return _paged_step(lengths, np.ones_like(lengths), heads, kv_heads, head_dim)


def prefill_step(tokens: int, context: tuple[int, int], heads: int, kv_heads: int, head_dim: int):
    """A prefill chunk of whole prompts (lengths drawn from `context`, the last cut so the chunk holds `tokens`),
    every token a query, in `decode_step`'s form."""
    import numpy as np

    rng = np.random.default_rng(1234)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(min(int(rng.integers(context[0], context[1] + 1)), tokens - sum(lengths)))
    return _paged_step(np.array(lengths), np.array(lengths), heads, kv_heads, head_dim)


def _paged_step(lengths, query_lens, heads: int, kv_heads: int, head_dim: int):
    """Sequences of `lengths` tokens whose last `query_lens` are the step's queries, their cache blocks scattered
    over the pool, and as many layers' caches as outgrow the L2 cache."""
    import numpy as np
    import torch

    rows = len(lengths)
    blocks = -(-lengths // BLOCK_SIZE)
    pool = int(blocks.sum())
    scattered = torch.randperm(pool, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    tables = torch.zeros(rows, int(blocks.max()), dtype=torch.int32)
    start = 0
    for row, count in enumerate(blocks):
        tables[row, :count] = scattered[start : start + count]
        start += count
    kv_bytes = 2 * int(lengths.sum()) * kv_heads * head_dim * 2
    layers = max(2, -(-L2_BYTES // kv_bytes))
    generator = torch.Generator(device="cuda").manual_seed(0)

    def cache() -> torch.Tensor:
        shape = (pool, BLOCK_SIZE, kv_heads, head_dim)
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)

    caches = [(cache(), cache()) for _ in range(layers)]
    q = torch.randn(int(query_lens.sum()), heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    cu = np.concatenate([[0], np.cumsum(query_lens)])
    cu_query_lens = torch.tensor(cu, dtype=torch.int32, device="cuda")
    order = torch.tensor(np.argsort(-lengths, kind="stable"), dtype=torch.int32, device="cuda")
    return q, caches, tables.cuda(), seq_lens, cu_query_lens, order, kv_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--architecture", default="llama-3.2-1b", choices=sorted(ARCHITECTURES))
    parser.add_argument("--rows", default="256,512", help="comma-separated sequences a step")
    parser.add_argument("--context", default="64-1536", help="the range contexts are drawn from, LOW-HIGH tokens")
    parser.add_argument("--block-n", default="32,64,128", help="comma-separated tokens a tile to try")
    parser.add_argument("--warps", default="4,8", help="comma-separated num_warps to try")
    parser.add_argument("--stages", default="2,3,4", help="comma-separated num_stages to try")
    parser.add_argument(
        "--heads-first", default="0,1", help="comma-separated 0/1: the grid's first dimension the KV heads"
    )
    parser.add_argument("--splits", default="1", help="comma-separated splits a sequence to try")
    parser.add_argument(
        "--deterministic", action="store_true", help="time the deterministic mode's launches (the varlen kernel)"
    )
    parser.add_argument("--block-m", default="64", help="with --deterministic: comma-separated packed rows a program")
    parser.add_argument("--prefill", type=int, default=0, help="with --deterministic: a prefill chunk of N tokens")
    parser.add_argument(
        "--longest-first",
        default="0",
        help="with --deterministic at decode steps: comma-separated 0/1, programs taking sequences longest first",
    )
    parser.add_argument(
        "--row-sum-dot",
        action="store_true",
        help="with --deterministic: every launch adds the softmax's row sums on the tensor cores (PrefillConfig)",
    )
    args = parser.parse_args(argv)
    if (args.prefill or args.row_sum_dot or args.longest_first != "0") and not args.deterministic:
        parser.error(
            "--prefill, --row-sum-dot and --longest-first time the deterministic mode's launches: add --deterministic"
        )
    if args.prefill and args.longest_first != "0":
        parser.error("--longest-first orders a decode step's sequences: leave it out with --prefill")
    if args.deterministic:
        return _deterministic(args)

    import torch

    from batchjob.engine.native.kernels.decode_attention import (
        DecodeConfig,
        default_config,
        default_num_splits,
        paged_decode_attention,
    )

    shape, context, sms, copy = _describe(args)
    heads, kv_heads, head_dim = shape
    knobs = [args.block_n, args.warps, args.stages, args.heads_first, args.splits]
    print(f"{'rows':>5} {'KV MB':>7} {'floor':>8} {'engine':>8} {'best':>8}  best launch            of copy")
    for rows in (int(r) for r in args.rows.split(",")):
        q, caches, tables, seq_lens, cu_query_lens, order, kv_bytes = decode_step(rows, context, *shape)
        out = torch.empty_like(q)
        floor = (kv_bytes + 2 * q.numel() * q.element_size()) / copy * 1e6
        attend = functools.partial(
            paged_decode_attention, q, block_tables=tables, seq_lens=seq_lens, cu_query_lens=cu_query_lens,
            scale=head_dim**-0.5, out=out, order=order,
        )  # fmt: skip

        def launch(config: DecodeConfig, splits: int, attend=attend, out=out):
            """A layer's call (its `(k_cache, v_cache)`) with this launch shape."""
            return lambda cache, out=out: functools.partial(attend, *cache, num_splits=splits, config=config, out=out)

        def tried_launch(block_n, warps, stages, heads_first, splits, launch=launch):
            config = DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages, heads_first=bool(heads_first))
            return launch(config, splits)

        engine_launch = launch(default_config(rows, kv_heads, sms), default_num_splits(rows, kv_heads, sms))
        calls = max(4, len(caches))  # every layer's cache once at least; a big step's few calls are long enough
        engine, timed = _time_launches(engine_launch, tried_launch, knobs, caches, out, calls)
        best, text, listed = _summary(timed)
        print(
            f"{rows:>5} {kv_bytes / 1e6:7.1f} {floor:8.1f} {engine:8.1f} {best:8.1f}  {text:<22} "
            f"{floor / best:5.1%} (engine {floor / engine:5.1%})"
        )
        print(f"   every launch (block_n/warps/stages/heads_first/splits us): {listed}")
    return 0


def _deterministic(args: argparse.Namespace) -> int:
    """The deterministic mode's launches (the varlen kernel, every key tile masked) per `PrefillConfig`, at decode
    steps or (`--prefill`) a prefill chunk, beside the default engine's launch for that step."""
    import torch

    from batchjob.engine.native.kernels.decode_attention import (
        default_config,
        default_num_splits,
        paged_decode_attention,
    )
    from batchjob.engine.native.kernels.prefill_attention import (
        DEFAULT_PREFILL_CONFIG,
        PrefillConfig,
        paged_prefill_attention,
    )
    from batchjob.engine.native.layers.triton_attention import DETERMINISTIC_PREFILL_CONFIG

    shape, context, sms, copy = _describe(args)
    heads, kv_heads, head_dim = shape
    engine_config = dataclasses.replace(DETERMINISTIC_PREFILL_CONFIG, row_sum_dot=args.row_sum_dot)
    print(f"deterministic engine: {engine_config}")
    scale = head_dim**-0.5
    knobs = [args.block_m, args.block_n, args.warps, args.stages] + ([] if args.prefill else [args.longest_first])
    step, sizes = (prefill_step, [args.prefill]) if args.prefill else (decode_step, map(int, args.rows.split(",")))
    label = "tokens" if args.prefill else "rows"
    print(f"{label:>6} {'KV MB':>7} {'floor':>8} {'default':>8} {'engine':>8} {'best':>8}  best launch        of floor")
    for size in sizes:
        q, caches, tables, seq_lens, cu_query_lens, order, kv_bytes = step(size, context, *shape)
        out = torch.empty_like(q)
        floor = (kv_bytes + 2 * q.numel() * q.element_size()) / copy * 1e6
        if args.prefill:  # causal QK and PV over every query's keys, at the matmul rate
            lengths = seq_lens.double()
            flops = float((lengths * (lengths + 1) / 2).sum()) * heads * head_dim * 4
            floor = max(floor, flops / measure_matmul_rate() * 1e6)
        paged = {"block_tables": tables, "seq_lens": seq_lens, "cu_query_lens": cu_query_lens}

        def launch(config: PrefillConfig, paged=paged, q=q, out=out, masked=True, order=None):
            return lambda cache, out=out: functools.partial(
                paged_prefill_attention, q, *cache, **paged, scale=scale, out=out, config=config,
                mask_every_tile=masked, order=order,
            )  # fmt: skip

        def tried_launch(block_m, block_n, warps, stages, longest_first=0, launch=launch, order=order):
            shape = {"block_m": block_m, "block_n": block_n, "num_warps": warps, "num_stages": stages}
            return launch(dataclasses.replace(engine_config, **shape), order=order if longest_first else None)

        def decode_launch(cache, paged=paged, q=q, out=out, order=order, rows=size):
            return functools.partial(
                paged_decode_attention, q, *cache, **paged, scale=scale, out=out, order=order,
                num_splits=default_num_splits(rows, kv_heads, sms), config=default_config(rows, kv_heads, sms),
            )  # fmt: skip

        calls = max(4, len(caches))
        default_launch = launch(DEFAULT_PREFILL_CONFIG, masked=False) if args.prefill else decode_launch
        default = per_call_us(default_launch, caches, calls)
        engine, timed = _time_launches(launch(engine_config), tried_launch, knobs, caches, out, calls)
        best, text, listed = _summary(timed)
        print(
            f"{size:>6} {kv_bytes / 1e6:7.1f} {floor:8.1f} {default:8.1f} {engine:8.1f} {best:8.1f}  {text:<18} "
            f"{floor / best:5.1%} (engine {floor / engine:5.1%}, default {floor / default:5.1%})"
        )
        knob_names = "block_m/block_n/warps/stages" + ("" if args.prefill else "/longest_first")
        print(f"   every launch ({knob_names} us; = every bit the engine's): {listed}")
    return 0


def _describe(args: argparse.Namespace):
    """The model's (query heads, KV heads, head_dim), the context range, the GPU's multiprocessors and copy rate,
    printed as the run's header."""
    import torch

    cfg = ARCHITECTURES[args.architecture]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    low, high = (int(v) for v in args.context.split("-"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy = measure_copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {copy / 1e12:.2f} TB/s, {sms} multiprocessors")
    print(f"{args.architecture}: {heads} query heads, {kv_heads} KV heads of {head_dim}; contexts U({low}, {high})")
    return (heads, kv_heads, head_dim), (low, high), sms, copy


def _time_launches(engine_launch, tried_launch, knobs: list[str], caches, out, calls: int):
    """The engine's launch timed, then every combination of `knobs` (comma-separated values) through
    `tried_launch(*values)`: {values: (us, mark)}, the mark "=" where its output is the engine launch's bit for bit,
    "" where within bf16's tolerance, "!" where not.

    Outputs are compared as the kernels' float32 results (each launch run once more into a float32 `out`): a sum
    one unit off in its last place shows there on every output it touches, where it changes the bf16 rounding of
    about one in 65,000."""
    import torch

    wide = torch.empty(out.shape, dtype=torch.float32, device=out.device)
    engine_launch(caches[0], wide)()
    reference = wide.clone()
    engine = per_call_us(engine_launch, caches, calls)
    timed = {}
    for values in itertools.product(*(map(int, v.split(",")) for v in knobs)):
        call = tried_launch(*values)
        try:
            call(caches[0], wide)()
        except Exception as exc:  # a launch that does not fit (shared memory): not a candidate
            print(f"  {'/'.join(map(str, values))}: {type(exc).__name__}")
            continue
        good = ((wide - reference).norm() / reference.norm()).item() < 1e-2
        mark = "=" if torch.equal(wide, reference) else "" if good else "!"
        timed[values] = (per_call_us(call, caches, calls), mark)
    return engine, timed


def _summary(timed) -> tuple[float, str, str]:
    """The fastest launch's time and name, and every launch's time, each with its mark (`_time_launches`)."""
    best_launch, (best, mark) = min(timed.items(), key=lambda item: item[1][0])
    text = "/".join(map(str, best_launch)) + mark
    listed = ", ".join(f"{'/'.join(map(str, t))} {us:.1f}{m}" for t, (us, m) in timed.items())
    return best, text, listed


if __name__ == "__main__":
    sys.exit(main())
