"""FP8 projections of a decode step's few rows, by shape: cuBLASLt (`torch._scaled_mm`, row-wise scales) against the
engine's few-rows kernel (`kernels/fp8_few_rows.py`) with its chosen tile and with every tile asked for:

    python scripts/dev/fp8_shapes.py --architecture llama-3.1-8b --rows 1,16,32,64
    python scripts/dev/fp8_shapes.py --architecture llama-3.1-70b --rows 32,64 --block-n 32,64,128 --stages 3,4,6

For each projection (qkv, o, gate_up, down) of one layer and row count it prints the floor (the e4m3 weight, the
input and the bf16 output at the copy rate measured here first, or the FLOPs at the FP8 matmul rate measured here if
those take longer), cuBLASLt's time, the kernel's with the engine's tile and the best tile tried (BLOCK_N / warps /
stages), and the share of the floor each reaches. Above the kernel's `MAX_ROWS` the engine takes cuBLASLt with its
rows padded (`fp8_linear.blas_matmul`), and no tile is tried unless `--tiles-up-to` asks (the kernel then takes every
row, up to 256, as the MMA's columns); the product transposed (the weight as the GEMM's rows, another of torch's
tile choices, then a copy back) is timed beside it. A time is a call's share of a CUDA graph of 24 calls (median of
20 replays), each call reading another copy of the weight than the call before, so neither launch overhead nor the
L2 cache counts. A tile whose output is not cuBLASLt's within FP8 tolerance is marked !.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent)]

from bench_lib.hardware import (  # noqa: E402
    copies_beyond_l2,
    measure_copy_bandwidth,
    measure_fp8_matmul_rate,
    per_call_us,
)
from bench_lib.workloads import ARCHITECTURES  # noqa: E402
from matmul_shapes import projections  # noqa: E402


def cublaslt_call(a, a_scales, w_scales, weight):
    import torch

    scale_b = w_scales.view(1, -1)
    return lambda: torch._scaled_mm(a, weight.t(), scale_a=a_scales, scale_b=scale_b, out_dtype=torch.bfloat16)


def transposed_call(a, a_scales, w_scales, weight):
    """C = (W @ A^T)^T: the weight as the GEMM's rows, the step's rows as its columns (another tile choice of
    torch's FP8 GEMM), then the copy back to [rows, N] that the next layer reads."""
    import torch

    scale_a, scale_b = w_scales.view(-1, 1), a_scales.view(1, -1)
    return lambda: (
        torch._scaled_mm(weight, a.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16).t().contiguous()
    )


def engine_blas_call(a, a_scales, w_scales, weight):
    from batchjob.engine.native.layers.fp8_linear import blas_matmul

    return lambda: blas_matmul(a, a_scales, weight, w_scales, None)


def few_rows_call(a, a_scales, w_scales, weight, tile=None):
    import torch

    from batchjob.engine.native.kernels import fp8_few_rows

    return lambda: fp8_few_rows.matmul(a, a_scales, weight, w_scales, None, torch.bfloat16, tile)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--architecture", default="llama-3.1-8b", choices=sorted(ARCHITECTURES))
    parser.add_argument("--rows", default="1,16,32,64")
    parser.add_argument("--block-n", default="32,64,128", help="comma-separated BLOCK_N to try")
    parser.add_argument("--warps", default="4", help="comma-separated num_warps to try")
    parser.add_argument("--stages", default="3,4,5,6", help="comma-separated num_stages to try")
    parser.add_argument(
        "--tiles-up-to", type=int, default=0, help="also try the tiles above MAX_ROWS, up to this many rows"
    )
    args = parser.parse_args(argv)

    import torch

    from batchjob.engine.native.kernels import fp8, fp8_few_rows
    from batchjob.engine.native.layers.fp8_linear import quantize_weight

    copy, flops = measure_copy_bandwidth(), measure_fp8_matmul_rate()
    print(f"{torch.cuda.get_device_name()}: copy {copy / 1e12:.2f} TB/s, fp8 matmul {flops / 1e12:.0f} TFLOP/s")
    tiles = list(itertools.product(*(map(int, v.split(",")) for v in (args.block_n, args.warps, args.stages))))
    shapes = {name: shape for name, shape in projections(args.architecture).items() if name != "lm_head"}
    print(f"{'proj':8} {'N x K':>13} {'rows':>5} {'floor':>7} {'cuBLASLt':>9} {'engine':>8} {'best':>8} tile  of floor")
    generator = torch.Generator(device="cuda").manual_seed(0)
    totals = dict.fromkeys(["floor", "cuBLASLt", "engine", "best"], 0.0)
    for name, (n, k) in shapes.items():
        w, w_scales = quantize_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=generator))
        weights = copies_beyond_l2(w)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=generator)
            a, a_scales = fp8.quantize(x)
            floor = max((n * k + rows * k + 2 * rows * n) / copy, 2 * rows * n * k / flops) * 1e6

            blas = functools.partial(cublaslt_call, a, a_scales, w_scales)
            few = functools.partial(few_rows_call, a, a_scales, w_scales)
            blas_out = blas(w)().float()
            blas_us = per_call_us(blas, weights)
            few_rows = fp8_few_rows.suits(rows, k, a_scales)
            engine = per_call_us(
                few if few_rows else functools.partial(engine_blas_call, a, a_scales, w_scales), weights
            )
            timed = {} if few_rows else {("padded",): (engine, True)}
            if not few_rows:
                try:
                    out = transposed_call(a, a_scales, w_scales, w)().float()
                except RuntimeError as exc:  # a row count torch's FP8 GEMM takes only as its rows
                    print(f"  transposed: {type(exc).__name__}")
                else:
                    good = ((out - blas_out).norm() / blas_out.norm()).item() < 1e-2
                    timed[("transposed",)] = (
                        per_call_us(functools.partial(transposed_call, a, a_scales, w_scales), weights),
                        good,
                    )
            for tile in tiles if few_rows or rows <= min(args.tiles_up_to, 256) else ():
                try:
                    out = few(w, tile)().float()
                except Exception as exc:  # a tile that does not fit (shared memory): not a candidate
                    print(f"  tile {tile}: {type(exc).__name__}")
                    continue
                good = ((out - blas_out).norm() / blas_out.norm()).item() < 1e-2
                timed[tile] = (per_call_us(functools.partial(few, tile=tile), weights), good)
            best_tile, (best, good) = min(timed.items(), key=lambda item: item[1][0])
            for label, us in (("floor", floor), ("cuBLASLt", blas_us), ("engine", engine), ("best", best)):
                totals[label] += us
            tile_text = "/".join(map(str, best_tile)) + ("" if good else "!")
            print(
                f"{name:8} {n:>6} x {k:<6} {rows:>5} {floor:7.1f} {blas_us:9.1f} {engine:8.1f} {best:8.1f} "
                f"{tile_text:<9} {floor / best:5.1%} (cuBLASLt {floor / blas_us:5.1%}, engine {floor / engine:5.1%})"
            )
            print("   every tile: " + ", ".join(f"{'/'.join(map(str, t))} {us:.1f}" for t, (us, _) in timed.items()))
    print("sum us: " + ", ".join(f"{label} {us:.1f}" for label, us in totals.items()))
    print(
        f"cuBLASLt / engine {totals['cuBLASLt'] / totals['engine']:.3f}, cuBLASLt / best "
        f"{totals['cuBLASLt'] / totals['best']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
