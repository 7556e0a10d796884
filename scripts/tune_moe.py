"""Tune the fused MoE kernel's launch configs for one expert shape on this GPU; write the winners into the table
the kernel reads (batchjob/engine/native/kernels/moe_configs.json) and a JSON report.

    python scripts/tune_moe.py [--out DIR] [--tokens 1,16,...] [--experts 128 --inter 768 --hidden 2048 --top-k 8]

Defaults are Qwen3-30B-A3B's experts in bf16. For each token count and row-block size, every candidate tile of
each projection is checked against a float reference and timed from a CUDA graph under random top-k routing; the
best pair sharing a block size wins, then the whole layer is timed with it and with the untuned default. `--tiny`
runs a toy shape (on CPU through the Triton interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch
from bench_lib.moe_timing import ExpertShape, close, make_problem, precompile, time_launches, torch_alignment

from batchjob.engine.native.kernels.moe_configs import GemmTile, MoEConfig

T = GemmTile
# Candidates by regime (rows per expert, T*K/E). Decode streams each touched expert's weights once: the tiles
# differ in bytes in flight per SM (columns x depth x stages) and in how many programs a small step has.
# Prefill is compute-bound: wide tiles, the shapes vLLM's H100/H200 tables settle on for these experts.
CANDIDATE_BLOCK_M = {"decode": (16,), "medium": (16, 32, 64), "prefill": (64, 128)}
GATE_UP_TILES = {
    "decode": (T(32, 128, 4, 4), T(32, 256, 4, 3), T(64, 64, 4, 5), T(64, 128, 4, 3), T(64, 128, 4, 4),
               T(64, 256, 4, 2), T(128, 64, 4, 4), T(128, 128, 4, 3)),
    "medium": (T(32, 256, 4, 3), T(64, 64, 4, 5), T(64, 128, 4, 3), T(64, 128, 4, 4), T(64, 256, 4, 2),
               T(128, 64, 4, 4), T(128, 128, 4, 2), T(128, 128, 8, 3)),
    "prefill": (T(64, 64, 4, 4), T(64, 64, 8, 4), T(128, 64, 8, 3), T(128, 64, 8, 4), T(128, 32, 8, 5)),
}  # fmt: skip
DOWN_TILES = {
    "decode": (T(32, 256, 4, 3), T(64, 64, 4, 5), T(64, 128, 4, 4), T(64, 256, 4, 3), T(128, 128, 4, 3),
               T(128, 128, 4, 4), T(128, 256, 4, 2), T(256, 128, 8, 3)),
    "medium": (T(64, 128, 4, 4), T(128, 64, 4, 5), T(128, 128, 4, 3), T(128, 128, 4, 4), T(128, 256, 4, 2),
               T(256, 64, 8, 4), T(256, 128, 8, 2), T(256, 128, 8, 3)),
    "prefill": (T(128, 64, 4, 4), T(128, 64, 8, 4), T(128, 128, 8, 3), T(256, 64, 8, 3), T(256, 64, 8, 4)),
}  # fmt: skip
SHARED_MEMORY_BYTES = 224 * 1024  # a Hopper SM's shared memory per block: larger pipelines cannot launch


def regime(tokens: int, shape: ExpertShape) -> str:
    rows_per_expert = tokens * shape.top_k / shape.experts
    return "decode" if rows_per_expert <= 4 else "medium" if rows_per_expert <= 48 else "prefill"


def block_ms(tokens: int, shape: ExpertShape) -> list[int]:
    """The regime's block sizes, but none over 4x the mean rows per expert: they would be mostly padding."""
    rows_per_expert = tokens * shape.top_k / shape.experts
    return [m for m in CANDIDATE_BLOCK_M[regime(tokens, shape)] if m <= max(16, 4 * rows_per_expert)]


def fits(block_m: int, tile: GemmTile, gated: bool, itemsize: int) -> bool:
    stage = (block_m * tile.block_k + (2 if gated else 1) * tile.block_n * tile.block_k) * itemsize
    return stage * tile.num_stages <= SHARED_MEMORY_BYTES


def candidates(tokens: int, shape: ExpertShape, gated: bool, block_m: int, tiny: bool) -> list[GemmTile]:
    tiles = (GATE_UP_TILES if gated else DOWN_TILES)[regime(tokens, shape)]
    tiles = [tile for tile in tiles if fits(block_m, tile, gated, shape.dtype.itemsize)]
    return tiles[:2] if tiny else tiles


def sweep_projection(problem, shape, w, alignments, block_m, gated, tiles) -> list[dict]:
    """Check and time each tile of one projection; one the GPU cannot run or that computes wrong is reported."""
    from batchjob.engine.native.kernels.fused_moe import grouped_gemm

    a = problem.hidden if gated else problem.gated_input
    want = problem.gated_ref if gated else problem.down_ref
    out = torch.empty(want.shape, dtype=shape.dtype, device=a.device)
    gbytes = problem.touched * shape.bytes_per_expert(gated) / 1e9
    results = []
    for tile in tiles:
        launches = [
            partial(grouped_gemm, a, w, out, weights, alignment, gated=gated, top_k=shape.top_k, block_m=block_m,
                    tile=tile)
            for weights, alignment in zip(problem.weights, alignments, strict=True)
        ]  # fmt: skip
        entry = {"block_m": block_m, "tile": tile, "us": None, "gbps": None, "error": None}
        try:
            launches[0]()
            if not close(out, want):
                entry["error"] = "wrong result"
            else:
                entry["us"] = time_launches(launches)
                entry["gbps"] = gbytes / entry["us"] * 1e6
        except Exception as err:  # noqa: BLE001 - out of resources and the like: reported, not fatal
            entry["error"] = f"{type(err).__name__}: {str(err)[:120]}"
        results.append(entry)
    return results


def router(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's routing (models/moe.py SparseMoE): softmax, top-k, renormalise."""
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def tune_tokens(tokens: int, shape: ExpertShape, w13, w2, routings: int, tiny: bool) -> dict:
    from batchjob.engine.native.kernels.fused_moe import fused_moe, sum_choices
    from batchjob.engine.native.kernels.moe_align import moe_align_block_size
    from batchjob.engine.native.kernels.moe_configs import default_config

    device = w13.device
    problem = make_problem(tokens, shape, w13, w2, routings, device)
    sweeps, best = {}, {}
    for block_m in block_ms(tokens, shape):
        alignments = [moe_align_block_size(ids, shape.experts, block_m) for ids in problem.ids]
        gate_up = sweep_projection(
            problem, shape, w13, alignments, block_m, True, candidates(tokens, shape, True, block_m, tiny)
        )
        down = sweep_projection(
            problem, shape, w2, alignments, block_m, False, candidates(tokens, shape, False, block_m, tiny)
        )
        sweeps[block_m] = gate_up + down
        timed_up, timed_down = ([e for e in s if e["us"] is not None] for s in (gate_up, down))
        if timed_up and timed_down:
            best[block_m] = (min(timed_up, key=lambda e: e["us"]), min(timed_down, key=lambda e: e["us"]))
    if not best:
        raise RuntimeError(f"{tokens} tokens: no candidate ran correctly; see the report's sweep")
    block_m, (up, down) = min(best.items(), key=lambda item: item[1][0]["us"] + item[1][1]["us"])
    config = MoEConfig(block_m, up["tile"], down["tile"])

    def layer(config: MoEConfig, index: int) -> torch.Tensor:
        weights = problem.weights[index].view(tokens, shape.top_k)
        return fused_moe(problem.hidden, w13, w2, weights, problem.ids[index], config=config)

    tuned_ok = close(layer(config, 0), problem.out_ref)
    ours = moe_align_block_size(problem.ids[0], shape.experts, block_m)
    theirs = torch_alignment(problem.ids[0], shape.experts, block_m)
    end = int(ours[2])
    align_ok = end == int(theirs[2]) and torch.equal(ours[0][:end], theirs[0][:end])
    partials = torch.zeros(tokens * shape.top_k, shape.hidden, dtype=shape.dtype, device=device)
    logits = torch.randn(tokens, shape.experts, device=device, dtype=shape.dtype)
    indices = range(routings)
    times = {
        "layer": time_launches([partial(layer, config, i) for i in indices]),
        "default_layer": time_launches([partial(layer, default_config(tokens, shape.top_k, shape.experts), i)
                                        for i in indices]),
        "align": time_launches([partial(moe_align_block_size, ids, shape.experts, block_m) for ids in problem.ids]),
        "torch_align": time_launches([partial(torch_alignment, ids, shape.experts, block_m) for ids in problem.ids]),
        "sum": time_launches([partial(sum_choices, partials, shape.top_k)]),
        "router": time_launches([partial(router, logits, shape.top_k)]),
    }  # fmt: skip
    layer_gbytes = problem.touched * (shape.bytes_per_expert(True) + shape.bytes_per_expert(False)) / 1e9
    return {
        "tokens": tokens,
        "experts_touched": problem.touched,
        "config": config,
        "gate_up": up,
        "down": down,
        "times_us": times,
        "layer_gbps": layer_gbytes / times["layer"] * 1e6,
        "correct": tuned_ok and align_ok,
        "sweep": sweeps,
    }


def summary(results: list[dict], copy_gbps: float | None) -> str:
    def tile(t: GemmTile) -> str:
        return f"{t.block_n}/{t.block_k}/{t.num_warps}/{t.num_stages}"

    def pct(gbps: float) -> str:
        return f"{100 * gbps / copy_gbps:5.1f}" if copy_gbps else "    -"

    lines = [
        "tokens  exp  bm | gate_up n/k/w/s     us  GB/s %copy | down n/k/w/s     us  GB/s %copy | align (torch)"
        "    sum router | layer us  GB/s %copy  default us  ok"
    ]
    for r in results:
        up, down, t = r["gate_up"], r["down"], r["times_us"]
        lines.append(
            f"{r['tokens']:6d} {r['experts_touched']:4.0f} {r['config'].block_m:3d} | {tile(up['tile']):>15s} "
            f"{up['us']:6.1f} {up['gbps']:5.0f} {pct(up['gbps'])} | {tile(down['tile']):>12s} {down['us']:6.1f} "
            f"{down['gbps']:5.0f} {pct(down['gbps'])} | {t['align']:5.1f} ({t['torch_align']:6.1f}) {t['sum']:6.1f} "
            f"{t['router']:6.1f} | {t['layer']:8.1f} {r['layer_gbps']:5.0f} {pct(r['layer_gbps'])} "
            f"{t['default_layer']:11.1f}  {'yes' if r['correct'] else 'NO'}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,16,64,128,256,512,2048,8192", help="token counts per step")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--inter", type=int, default=768, help="each expert's intermediate size")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--routings", type=int, default=8, help="random routings cycled per timed sequence")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="compile processes")
    parser.add_argument("--table", type=Path, help="table to merge into (default: the package's; --tiny: none)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table and report here")
    parser.add_argument("--tiny", action="store_true", help="toy shape, two tokens counts, two tiles each")
    args = parser.parse_args()
    if args.tiny:
        args.tokens, args.experts, args.inter, args.hidden, args.top_k, args.routings = "1,5", 4, 32, 64, 2, 2
        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel modules are first imported, below
    from batchjob.engine.native.kernels.moe_configs import TABLE_PATH, MoEConfigTable, device_name, shape_key

    started = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if device.type == "cuda" else torch.float16
    shape = ExpertShape(args.experts, args.inter, args.hidden, args.top_k, dtype)
    tokens = [int(t) for t in args.tokens.split(",")]
    copy_gbps = None
    if device.type == "cuda":
        from bench_lib.hardware import measure_copy_bandwidth

        copy_gbps = measure_copy_bandwidth(gib=2.0, repeats=10) / 1e9
    jobs = {
        (gated, m, tile)
        for t in tokens
        for m in block_ms(t, shape)
        for gated in (True, False)
        for tile in candidates(t, shape, gated, m, args.tiny)
    }
    compile_failures = precompile(shape, sorted(jobs, key=str), args.workers)
    gen = torch.Generator(device).manual_seed(0)
    w13 = (torch.randn(shape.experts, 2 * shape.inter, shape.hidden, generator=gen, device=device)
           / shape.hidden**0.5).to(dtype)  # fmt: skip
    w2 = (torch.randn(shape.experts, shape.hidden, shape.inter, generator=gen, device=device)
          / shape.inter**0.5).to(dtype)  # fmt: skip
    results = [tune_tokens(t, shape, w13, w2, args.routings, args.tiny) for t in tokens]

    key = shape_key(shape.experts, shape.inter, shape.hidden, shape.top_k, dtype)
    name = device_name(device)
    table_path = args.table or (None if args.tiny else TABLE_PATH)
    table = MoEConfigTable.load(table_path) if table_path else MoEConfigTable({})
    table.entries.setdefault(name, {})[key] = {r["tokens"]: r["config"] for r in results}
    table_json = json.dumps(table.to_json(), indent=1) + "\n"
    all_correct = all(r["correct"] for r in results)
    if all_correct and table_path:
        table_path.write_text(table_json)
    report = {
        "device": name,
        "shape": key,
        "copy_gbps": copy_gbps,
        "configs_compiled": len(jobs),
        "compile_failures": compile_failures,
        "seconds": time.perf_counter() - started,
        "results": results,
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "moe_tune_report.json").write_text(json.dumps(report, indent=1, default=_json) + "\n")
        if all_correct:
            (args.out / "moe_configs.json").write_text(table_json)
    copy = f"{copy_gbps:,.0f} GB/s" if copy_gbps else "not measured"
    print(f"fused MoE tuning on {name}: {key}; copy bandwidth {copy}; {len(jobs)} kernel configs, "
          f"{report['seconds']:.0f} s")  # fmt: skip
    print(summary(results, copy_gbps))
    if not all_correct:
        print("a winning config or the alignment computed a wrong result: no table written")
        return 1
    written = [str(path) for path in (table_path, args.out and args.out / "moe_configs.json") if path]
    print(f"table written: {', '.join(written)}")
    return 0


def _json(value: object) -> object:
    if isinstance(value, (GemmTile, MoEConfig)):
        return value.__dict__ if isinstance(value, GemmTile) else value.to_json()
    raise TypeError(f"not JSON: {type(value).__name__}")


if __name__ == "__main__":
    sys.exit(main())
