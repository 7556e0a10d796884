"""The deterministic mode's matmul against cuBLAS at a benchmark model's projections, by row count:

    python scripts/dev/matmul_shapes.py --architecture llama-3.2-1b --rows 32,128,512,1024,8192
    python scripts/dev/matmul_shapes.py --architecture llama-3.1-8b --serial-waves 1,2,4 --parts 1,2,4 --group-m 1,16
    python scripts/dev/matmul_shapes.py --rows 2048,8192 --serial-tiles 128x128x64w8s4,128x256x64w8s3

For each projection (qkv, o, gate_up, down, lm_head) and row count it prints cuBLAS's time, the invariant
matmul's as the engine runs it, and each variant asked for: `--serial-waves W` (a step computes K's parts
within each program from W waves of programs; `--multi-tile-waves W` the same for steps of more than one row
tile), `--parts P` (K split into at most P parts) and `--group-m G` (G row
tiles walked together down each column tile: program order, the same bits), `--serial-block-n` and
`--serial-warps` (the serial launch's column tile and warps), `--tma 0` (tiles loaded by address rather than
by the tensor memory accelerator), `--shift 0` (a last row tile of fewer rows read past the input's end rather
than from the step's last rows), `--narrow 0` (the serial launch in its own tiles even where they are fewer
than a wave of programs), and `--serial-tiles MxNxKwWsS[@W]` (the serial
launch's whole shape: tile, K step, warps, pipeline stages; with @W, from W waves). A variant marked ! computed
16 of the step's rows otherwise than it computes them in a step of those rows alone. A time is a call's share of a
CUDA graph of 24 calls (median of 20 replays), each call reading another copy of the weight than the call before,
so neither the launch from Python nor the L2 cache counts (a decode step's graph replays its launches alike); the
floor is the larger of the bytes (weight, input, output) at the copy rate and the FLOPs at the bf16 matmul rate,
both measured here first. Only variants whose bits a row keeps whatever the row
count are candidates for the engine: a variant's parts must be a function of the weight's shape and the GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent)]

from bench_lib.hardware import copies_beyond_l2, measure_copy_bandwidth, measure_matmul_rate, per_call_us  # noqa: E402
from bench_lib.workloads import ARCHITECTURES  # noqa: E402


def projections(architecture: str) -> dict[str, tuple[int, int]]:
    """Projection name -> weight shape (N, K) of one layer (and the lm_head)."""
    cfg = ARCHITECTURES[architecture]
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    return {
        "qkv": (q + 2 * kv, hidden),
        "o": (hidden, q),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (cfg["vocab_size"], hidden),
    }


def call_ms(run, x, weights: list) -> float:
    """Milliseconds a call of `run(x, weight)` takes inside a CUDA graph (`per_call_us`), one weight copy after
    another: neither the launch from Python nor a weight the L2 cache still holds counts, as in an engine step."""
    return per_call_us(lambda w: lambda: run(x, w), weights) / 1e3


KNOBS = (
    "SERIAL_WAVES",
    "MULTI_TILE_SERIAL_WAVES",
    "MAX_PARTS",
    "GROUP_M",
    "SERIAL_BLOCK_M",
    "SERIAL_BLOCK_N",
    "SERIAL_BLOCK_K",
    "SERIAL_WARPS",
    "SERIAL_STAGES",
    "NARROW_BELOW_WAVES",
    "ONE_PART_BLOCK_M",
    "ONE_PART_STAGES",
    "TMA_LOADS",
    "SHIFT_LAST_ROW_TILE",
)


def serial_tile(text: str) -> dict[str, float]:
    """'128x256x64w8s3' -> the serial launch's knobs (tile M x N x K, warps, stages), for weights of one part and
    of several alike; '...@W' also sets SERIAL_WAVES to W."""
    text, _, waves = text.partition("@")
    tile, rest = text.split("w")
    warps, stages = rest.split("s")
    m, n, k = (int(v) for v in tile.split("x"))
    names = ("SERIAL_BLOCK_M", "SERIAL_BLOCK_N", "SERIAL_BLOCK_K", "SERIAL_WARPS", "SERIAL_STAGES")
    knobs = dict(zip(names, (m, n, k, int(warps), int(stages)), strict=True))
    return (
        knobs
        | {"ONE_PART_BLOCK_M": m, "ONE_PART_STAGES": int(stages)}
        | ({"SERIAL_WAVES": float(waves)} if waves else {})
    )


def variant(**knobs: float):
    """The invariant matmul with some of the module's `KNOBS` set for one call (restored after)."""
    from batchjob.engine.native.kernels import invariant_matmul as im

    def run(x, w):
        saved = {name: getattr(im, name) for name in KNOBS}
        for name, value in knobs.items():
            setattr(im, name, value)
        try:
            return im.matmul(x, w)
        finally:
            for name, value in saved.items():
                setattr(im, name, value)

    return run


def same_bits(run, x, w) -> bool:
    """Whether `run` computes the step's first 16 rows and 16 rows from its middle as it does those rows alone."""
    import torch

    whole, middle = run(x, w), x.shape[0] // 2 + 3
    return torch.equal(whole[:16], run(x[:16], w)) and torch.equal(whole[middle : middle + 16], run(x[middle:][:16], w))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--architecture", default="llama-3.2-1b", choices=sorted(ARCHITECTURES))
    parser.add_argument("--rows", default="32,128,256,512,1024,2048,8192")
    parser.add_argument("--serial-waves", default="", help="comma-separated SERIAL_WAVES to try besides the engine's")
    parser.add_argument("--multi-tile-waves", default="", help="comma-separated MULTI_TILE_SERIAL_WAVES to try")
    parser.add_argument("--parts", default="", help="comma-separated MAX_PARTS to try besides the engine's")
    parser.add_argument("--group-m", default="", help="comma-separated GROUP_M to try besides the engine's")
    parser.add_argument("--serial-block-n", default="", help="comma-separated SERIAL_BLOCK_N to try")
    parser.add_argument("--serial-warps", default="", help="comma-separated SERIAL_WARPS to try")
    parser.add_argument("--serial-tiles", default="", help="comma-separated serial launch shapes, MxNxKwWsS")
    parser.add_argument("--narrow", default="", help="comma-separated NARROW_BELOW_WAVES to try (0: never)")
    parser.add_argument("--tma", default="", help="comma-separated TMA_LOADS to try (0: tiles loaded by address)")
    parser.add_argument("--shift", default="", help="comma-separated SHIFT_LAST_ROW_TILE to try (0: past the end)")
    parser.add_argument("--only", default="", help="comma-separated projections (default: all)")
    args = parser.parse_args(argv)

    import torch

    from batchjob.engine.native.kernels import invariant_matmul as im

    copy, flops = measure_copy_bandwidth(), measure_matmul_rate()
    print(f"{torch.cuda.get_device_name()}: copy {copy / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    block = f"{im.BLOCK_M}x{im.BLOCK_N}x{im.BLOCK_K}"
    print(
        f"engine: SERIAL_WAVES={im.SERIAL_WAVES} ({im.MULTI_TILE_SERIAL_WAVES} from two row tiles), "
        f"MAX_PARTS={im.MAX_PARTS}, GROUP_M={im.GROUP_M}, tiles {block}, "
        f"TMA_LOADS={im.TMA_LOADS}"
    )
    asked = {
        "waves": ("SERIAL_WAVES", args.serial_waves),
        "tile_waves": ("MULTI_TILE_SERIAL_WAVES", args.multi_tile_waves),
        "parts": ("MAX_PARTS", args.parts),
        "group": ("GROUP_M", args.group_m),
        "sn": ("SERIAL_BLOCK_N", args.serial_block_n),
        "sw": ("SERIAL_WARPS", args.serial_warps),
        "tma": ("TMA_LOADS", args.tma),
        "shift": ("SHIFT_LAST_ROW_TILE", args.shift),
        "narrow": ("NARROW_BELOW_WAVES", args.narrow),
    }
    runs = {"engine": variant()}
    for label, (knob, values) in asked.items():
        number = float if "WAVES" in knob else int  # a fraction of a wave is a row count too
        runs |= {f"{label}={v}": variant(**{knob: number(v)}) for v in filter(None, values.split(","))}
    runs |= {v: variant(**serial_tile(v)) for v in filter(None, args.serial_tiles.split(","))}
    shapes = projections(args.architecture)
    wanted = [s for s in args.only.split(",") if s] or list(shapes)
    width = max(10, *(len(label) + 1 for label in runs))
    print(f"{'proj':8} {'N x K':>13} {'rows':>5} {'floor':>7} {'cuBLAS':>7} " + " ".join(f"{n:>{width}}" for n in runs))
    generator = torch.Generator(device="cuda").manual_seed(0)
    total = dict.fromkeys(["floor", "cuBLAS", *runs], 0.0)
    for name in wanted:
        n, k = shapes[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=generator)
        weights = copies_beyond_l2(w)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=generator)
            floor = max(2 * (n * k + rows * k + rows * n) / copy, 2 * rows * n * k / flops) * 1e3
            blas = call_ms(lambda x, w: x @ w.T, x, weights)
            times = {label: call_ms(run, x, weights) for label, run in runs.items()}
            for label, ms in (("floor", floor), ("cuBLAS", blas), *times.items()):
                total[label] += ms
            mode = "serial" if im.serial(rows, w) else f"{im.num_parts(w)} parts"
            # A variant whose first rows, or 16 rows from the middle of the step, differ from its own launch for
            # those rows alone is no candidate (marked !): its bits change with the row count.
            same = {label: same_bits(run, x, w) for label, run in runs.items()}
            cells = " ".join(f"{ms:{width - 1}.3f}{' ' if same[label] else '!'}" for label, ms in times.items())
            print(f"{name:8} {n:>6} x {k:<6} {rows:>5} {floor:7.3f} {blas:7.3f} {cells}  ({mode} as the engine)")
    print("sum ms: " + ", ".join(f"{label} {ms:.2f}" for label, ms in total.items()))
    print("cuBLAS / each: " + ", ".join(f"{label} {total['cuBLAS'] / total[label]:.3f}" for label in runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
