"""GPU microbenchmark of a decode step's matmuls through torch's two BLAS back-ends, cuBLAS and cuBLASLt, on the
projection shapes of the benchmark models at the row counts of decode steps.

    python scripts/bench_decode_gemm.py results/decode-gemm.json [--models llama-3.1-8b] [--rows 1,8,16,32,64]
    python scripts/bench_decode_gemm.py results/split-k.json --split-k 2,4,8 [--models ...] [--rows ...]

Each matmul is timed as the engine runs it, replayed from a CUDA graph, over enough copies of its weight that
none is still in the L2 cache when it is read again. Reported: microseconds a call, and the weight's bytes over
that time as a fraction of a device-to-device copy measured in the same run; then a decode step's matmuls
added up (every layer's four and the lm_head) for each back-end.

With `--split-k`, the projections that feed a residual add (o, down) are timed together with that add and the
RMSNorm after it, as the engine runs them: a plain matmul and the fused norm, against split-K partial sums
(`split_k.py`) into that many parts, added up by the norm; microseconds a pair, by back-end.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib.hardware import graph_ms, measure_copy_bandwidth  # noqa: E402

from batchjob.engine.native.kernels import fused_ops  # noqa: E402
from batchjob.engine.native.layers import split_k  # noqa: E402

DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16
BACKENDS = ("cublas", "cublaslt")
# (hidden, intermediate, q heads, kv heads, head dim, vocab, layers) of the benchmark models.
MODELS = {
    "llama-3.1-8b": (4096, 14336, 32, 8, 128, 128256, 32),
    "llama-3.2-1b": (2048, 8192, 32, 8, 64, 128256, 16),
    "qwen3-0.6b": (1024, 3072, 16, 8, 128, 151936, 28),
}
# Bytes of weight copies a timed graph cycles through: several times the L2 cache.
CYCLE_BYTES = 512 << 20
CALLS = 64


def shapes(model: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each projection: its weight's rows and columns."""
    hidden, inter, heads, kv_heads, head_dim, vocab, _ = MODELS[model]
    return {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (vocab, hidden),
    }


def bench_shape(n: int, k: int, rows: int) -> dict[str, float]:
    """Seconds a call of `F.linear` of `rows` rows against an [n, k] weight, by BLAS back-end."""
    copies = max(1, -(-CYCLE_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, dtype=DTYPE, device=DEVICE) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, k, dtype=DTYPE, device=DEVICE)
    calls = max(CALLS, copies)

    def cycle() -> None:
        for i in range(calls):
            F.linear(x, weights[i % copies])

    seconds = {}
    for backend in BACKENDS:
        torch.backends.cuda.preferred_blas_library(backend)
        seconds[backend] = graph_ms(cycle) / 1e3 / calls
    torch.backends.cuda.preferred_blas_library("cublas")
    return seconds


def bench_split(n: int, k: int, rows: int, splits: list[int]) -> dict[str, float]:
    """Seconds a (matmul, residual add + RMSNorm) pair, plain and split into each of `splits` parts (keyed
    "<parts>/<backend>", 1 = plain), and the largest difference of the split norms' outputs from the plain."""
    copies = max(1, -(-CYCLE_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, dtype=DTYPE, device=DEVICE) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, k, dtype=DTYPE, device=DEVICE)
    residual = torch.randn(rows, n, dtype=DTYPE, device=DEVICE)
    norm_weight = torch.ones(n, dtype=DTYPE, device=DEVICE)
    calls = max(CALLS, copies)

    def run(parts: int, weight: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, weight) if parts == 1 else split_k.partial_products(x, weight, parts)
        return fused_ops.rms_norm(h, norm_weight, 1e-5, res)[0]

    result: dict[str, float] = {}
    reference = run(1, weights[0], residual.clone())
    for parts in [1, *splits]:
        if k % parts:
            continue
        diff = (run(parts, weights[0], residual.clone()).float() - reference.float()).abs().max().item()
        result[f"{parts}/maxdiff"] = diff
        for backend in BACKENDS:
            torch.backends.cuda.preferred_blas_library(backend)

            def cycle(parts: int = parts) -> None:
                for i in range(calls):
                    run(parts, weights[i % copies], residual)

            result[f"{parts}/{backend}"] = graph_ms(cycle) / 1e3 / calls
    torch.backends.cuda.preferred_blas_library("cublas")
    return result


def main_split(args: argparse.Namespace) -> None:
    splits = [int(s) for s in args.split_k.split(",")]
    report: dict = {"device": torch.cuda.get_device_name(), "results": []}
    for model in args.models.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            cells = []
            for name in ("o", "down"):
                n, k = shapes(model)[name]
                result = bench_split(n, k, rows, splits)
                torch.cuda.empty_cache()
                report["results"].append({"model": model, "proj": name, "n": n, "k": k, "rows": rows, **result})
                times = ", ".join(
                    f"{key} {value * 1e6:.1f}" for key, value in result.items() if not key.endswith("maxdiff")
                )
                diffs = max(value for key, value in result.items() if key.endswith("maxdiff"))
                cells.append(f"{name}: {times} us (max diff {diffs:.3g})")
            print(f"{model} M={rows}: " + "; ".join(cells), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rows", default="1,8,16,24,32,48,64,128,256")
    parser.add_argument("--split-k", default="", help="comma-separated part counts: time split-K o/down instead")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_gemm.py needs a CUDA GPU; run it on a machine with one")
    if args.split_k:
        main_split(args)
        return
    rate = measure_copy_bandwidth()
    print(f"copy rate {rate / 1e12:.2f} TB/s, L2 {torch.cuda.get_device_properties(0).L2_cache_size >> 20} MiB")
    report: dict = {"copy_bytes_per_s": rate, "device": torch.cuda.get_device_name(), "results": [], "steps": []}
    for model in args.models.split(","):
        layers = MODELS[model][-1]
        for rows in (int(r) for r in args.rows.split(",")):
            totals = dict.fromkeys(BACKENDS, 0.0)
            cells = []
            for name, (n, k) in shapes(model).items():
                seconds = bench_shape(n, k, rows)
                torch.cuda.empty_cache()
                report["results"].append({"model": model, "proj": name, "n": n, "k": k, "rows": rows, **seconds})
                for backend in BACKENDS:
                    totals[backend] += (1 if name == "lm_head" else layers) * seconds[backend]
                fractions = "/".join(f"{n * k * 2 / seconds[b] / rate:.0%}" for b in BACKENDS)
                cells.append(f"{name} {seconds['cublas'] * 1e6:.1f}/{seconds['cublaslt'] * 1e6:.1f} us ({fractions})")
            report["steps"].append({"model": model, "rows": rows, **totals})
            step = "/".join(f"{totals[b] * 1e3:.3f}" for b in BACKENDS)
            print(f"{model} M={rows}: step {step} ms (cublas/cublaslt); " + "; ".join(cells), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
