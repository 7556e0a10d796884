"""Does a decode step's attention (bound by reading the KV cache) run beside its matmuls (bound by the tensor
cores at a few hundred rows) when the two go to two CUDA streams? Llama-3.1-8B's shapes on a GPU.

    python scripts/bench_overlap.py [--rows 512] [--context 1500] [--layers 8] [--out overlap.json]

Every variant is captured as one CUDA graph over `--layers` layers of distinct weights and distinct caches (so
neither stays in L2) and replayed; times are per layer:

- `attention` / `matmuls`: each alone (all rows);
- `serial`: a layer's attention then its matmuls, on one stream (the engine's order);
- `independent`: all the attention on one stream, all the matmuls on another, no dependency (the best overlap
  can do);
- `halves`: the rows split in two halves on two streams, a half's attention waiting for its qkv projection and
  its o/MLP matmuls waiting for its attention, so one half's attention runs beside the other half's matmuls
  (what a step's forward could do, with each weight read twice);
- `halves, matmuls first`: the same with the matmul stream at a higher priority.

With `--programs P,...` the attention, `independent` and `halves` variants run again with the decode kernel on a
persistent grid of P programs (`DecodeConfig.programs`), which leaves the other multiprocessors to the matmuls.

With `--carveouts C,...` the matmuls, `independent` and `halves` variants run again with every matmul through
cuBLASLt told to use all but C multiprocessors (torch's SM carve-out, cuBLASLt's SM count target), the usual
attention grid taking the C left free and whatever the matmuls leave between kernels.

Prints the table and writes it as JSON with the copy rate measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable

import torch
from bench_lib.hardware import measure_copy_bandwidth

from batchjob.engine.native.kernels.decode_attention import paged_decode_attention
from batchjob.engine.native.layers.triton_attention import TritonPagedAttention

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, BLOCK = 4096, 32, 8, 128, 14336, 16
DTYPE, DEVICE = torch.bfloat16, torch.device("cuda")


class Layer:
    """One layer's weights, KV cache (every sequence's blocks scattered) and step buffers."""

    def __init__(self, rows: int, context: int) -> None:
        w = lambda n, k: torch.randn(n, k, dtype=DTYPE, device=DEVICE) * 0.02  # noqa: E731
        self.qkv, self.o = w((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), w(HIDDEN, HEADS * HEAD_DIM)
        self.gate_up, self.down = w(2 * INTERMEDIATE, HIDDEN), w(HIDDEN, INTERMEDIATE)
        blocks = -(-context // BLOCK)
        order = torch.randperm(rows * blocks, device=DEVICE).to(torch.int32) + 1
        self.tables = order.view(rows, blocks)
        self.k_cache = torch.randn(rows * blocks + 1, BLOCK, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
        self.v_cache = torch.randn_like(self.k_cache)
        self.seq_lens = torch.full((rows,), context, dtype=torch.int32, device=DEVICE)


class Step:
    """The rows' activations and the two halves' views."""

    def __init__(self, rows: int) -> None:
        self.x = torch.randn(rows, HIDDEN, dtype=DTYPE, device=DEVICE)
        self.qkv = torch.empty(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=DTYPE, device=DEVICE)
        self.attn = torch.zeros(rows, HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
        self.h = torch.empty(rows, HIDDEN, dtype=DTYPE, device=DEVICE)
        self.gu = torch.empty(rows, 2 * INTERMEDIATE, dtype=DTYPE, device=DEVICE)
        self.cu = torch.arange(rows + 1, dtype=torch.int32, device=DEVICE)
        self.rows = rows


def qkv_proj(step: Step, layer: Layer, part: slice) -> None:
    torch.mm(step.x[part], layer.qkv.t(), out=step.qkv[part])


def attention(step: Step, layer: Layer, part: slice, splits: int, config) -> None:
    q = step.qkv[:, : HEADS * HEAD_DIM].view(step.rows, HEADS, HEAD_DIM)
    paged_decode_attention(
        q, layer.k_cache, layer.v_cache, layer.tables[part], layer.seq_lens[part], step.cu[part.start :],
        HEAD_DIM**-0.5, splits, step.attn, config,
    )  # fmt: skip


def o_and_mlp(step: Step, layer: Layer, part: slice) -> None:
    torch.mm(step.attn[part].view(-1, HEADS * HEAD_DIM), layer.o.t(), out=step.h[part])
    torch.mm(step.h[part], layer.gate_up.t(), out=step.gu[part])
    torch.mm(step.gu[part, :INTERMEDIATE], layer.down.t(), out=step.x[part])


def carved(fn: Callable[[], None], carveout: int) -> Callable[[], None]:
    """`fn` with its matmuls through cuBLASLt on all but `carveout` multiprocessors (both read at each call, so a
    graph captured inside keeps them)."""

    def run():
        backend = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        torch._C._set_sm_carveout_experimental(carveout)
        try:
            fn()
        finally:
            torch._C._set_sm_carveout_experimental(None)
            torch.backends.cuda.preferred_blas_library(backend)

    return run


def graph_seconds(fn: Callable[[], None], replays: int = 5) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / replays


def copy_rate() -> float:
    """Bytes read and written per second by a device-to-device copy, as the roofline measures it (eagerly: a
    copy replayed from a CUDA graph moved 2.7 TB/s on an H200 against 4.3 TB/s)."""
    return measure_copy_bandwidth(gib=2.0)


def variants(
    step: Step,
    layers: list[Layer],
    backend: TritonPagedAttention,
    programs: int = 0,
    launch: dict | None = None,
    carveout: int = 0,
) -> dict[str, Callable[[], None]]:
    """Every variant; with `programs` only those with attention, the decode kernel on a grid of that many
    (`launch`: its tiles, warps and stages instead of the default's); with `carveout` those with matmuls, the
    matmuls kept off that many multiprocessors."""
    rows, half = step.rows, step.rows // 2
    whole, first, second = slice(0, rows), slice(0, half), slice(half, rows)
    plan = {}
    for part, n in ((whole, rows), (first, half), (second, rows - half)):
        splits, config = backend.decode_splits(n, KV_HEADS, DEVICE), backend.decode_launch_config(n, KV_HEADS, DEVICE)
        if programs:
            if splits != 1:
                raise SystemExit(f"{n} rows run the split kernel: a persistent grid needs one split")
            config = dataclasses.replace(config, programs=programs, **(launch or {}))
        plan[part] = (splits, config)
    attend = lambda layer, part: attention(step, layer, part, *plan[part])  # noqa: E731

    def attention_only():
        for layer in layers:
            attend(layer, whole)

    def matmuls_only():
        for layer in layers:
            qkv_proj(step, layer, whole)
            o_and_mlp(step, layer, whole)

    def serial():
        for layer in layers:
            qkv_proj(step, layer, whole)
            attend(layer, whole)
            o_and_mlp(step, layer, whole)

    def independent():
        side, main = torch.cuda.Stream(), torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            attention_only()
        matmuls_only()
        main.wait_stream(side)

    def halves(priority: int) -> Callable[[], None]:
        def run():
            main = torch.cuda.current_stream()
            mm, att = torch.cuda.Stream(priority=priority), torch.cuda.Stream()
            mm.wait_stream(main)
            att.wait_stream(main)
            with torch.cuda.stream(mm):
                qkv_proj(step, layers[0], first)
                qkv_proj(step, layers[0], second)
            ready = {first: torch.cuda.Event(), second: torch.cuda.Event()}
            for part in (first, second):
                ready[part].record(mm)
            for i, layer in enumerate(layers):
                done = {}
                for part in (first, second):
                    att.wait_event(ready[part])
                    with torch.cuda.stream(att):
                        attend(layer, part)
                    done[part] = torch.cuda.Event()
                    done[part].record(att)
                for part in (first, second):
                    mm.wait_event(done[part])
                    with torch.cuda.stream(mm):
                        o_and_mlp(step, layer, part)
                        if i + 1 < len(layers):
                            qkv_proj(step, layers[i + 1], part)
                    ready[part] = torch.cuda.Event()
                    ready[part].record(mm)
            main.wait_stream(mm)
            main.wait_stream(att)

        return run

    if launch:
        shape = "x".join(str(launch[k]) for k in ("block_n", "num_warps", "num_stages"))
        shape += "p" if launch["prefetch_table"] else ""
        return {
            f"attention on {programs}, {shape}": attention_only,
            f"independent, attention on {programs}, {shape}": independent,
        }
    if carveout:
        return {
            f"matmuls, {carveout} SMs carved out": carved(matmuls_only, carveout),
            f"serial, {carveout} carved out": carved(serial, carveout),
            f"independent, {carveout} carved out": carved(independent, carveout),
            f"halves, {carveout} carved out": carved(halves(0), carveout),
            f"halves, matmuls first, {carveout} carved out": carved(halves(-1), carveout),
        }
    if programs:
        return {
            f"attention on {programs}": attention_only,
            f"serial, attention on {programs}": serial,
            f"independent, attention on {programs}": independent,
            f"halves, attention on {programs}": halves(0),
            f"halves, matmuls first, attention on {programs}": halves(-1),
        }
    return {
        "attention": attention_only,
        "matmuls": matmuls_only,
        "serial": serial,
        "independent": independent,
        "halves": halves(0),
        "halves, matmuls first": halves(-1),  # negative: a higher priority
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="512", help="comma-separated")
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--programs", default="", help="comma-separated persistent grid sizes for the attention")
    parser.add_argument(
        "--launches",
        default="",
        help="comma-separated BLOCK_NxWARPSxSTAGES[p] tried on each persistent grid (p: block table read ahead)",
    )
    parser.add_argument("--carveouts", default="", help="comma-separated SM counts kept free of the matmuls")
    parser.add_argument("--out")
    args = parser.parse_args()
    backend = TritonPagedAttention()
    results = {"copy_bytes_per_s": copy_rate(), "device": torch.cuda.get_device_name(), "cases": []}
    print(f"{results['device']}: device-to-device copy {results['copy_bytes_per_s'] / 1e12:.2f} TB/s")
    for rows in (int(r) for r in args.rows.split(",")):
        layers = [Layer(rows, args.context) for _ in range(args.layers)]
        step = Step(rows)
        runs = variants(step, layers, backend)
        for programs in (int(p) for p in args.programs.split(",") if p):
            runs |= variants(step, layers, backend, programs)
            for shape in (s for s in args.launches.split(",") if s):
                block_n, warps, stages = (int(v) for v in shape.rstrip("p").split("x"))
                launch = dict(block_n=block_n, num_warps=warps, num_stages=stages, prefetch_table=shape.endswith("p"))
                runs |= variants(step, layers, backend, programs, launch)
        for carveout in (int(c) for c in args.carveouts.split(",") if c):
            runs |= variants(step, layers, backend, carveout=carveout)
        times = {name: graph_seconds(fn) / args.layers for name, fn in runs.items()}
        kv_bytes = 2 * rows * args.context * KV_HEADS * HEAD_DIM * 2
        print(f"{rows} rows x {args.context} tokens of context, per layer (KV {kv_bytes / 1e6:.0f} MB):")
        for name, seconds in times.items():
            print(f"  {name:<44} {seconds * 1e6:8.1f} us  {times['serial'] / seconds:5.3f}x of serial")
        results["cases"].append({"rows": rows, "context": args.context, "kv_bytes": kv_bytes, "seconds": times})
        del layers, step
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
