"""How fast does a decode step's attention read the KV cache from part of the GPU's multiprocessors, and does it
then run beside the step's matmuls on the rest? Llama-3.1-8B's shapes, CUDA green contexts (torch's
`GreenContext`) confining each to its own SMs.

    python scripts/bench_sm_split.py [--rows 512] [--context 1500] [--layers 8] [--sms 48,64,80] \
        [--launches 64x4x4,32x4x2,...] [--out sm-split.json]

For each count A in `--sms`: the attention alone in a green context of A SMs (the usual launch and each of
`--launches`, BLOCK_NxWARPSxSTAGES[p][h], p: the block table read ahead, h: the grid's first dimension the KV
heads; a program per (sequence, KV head)), the matmuls alone in one of the other SMs, and both at once, each in
its own, with no dependency between them (the best a step whose halves overlap could do). Launched eagerly (a
green context's stream, then timed with events on the usual stream around them; `--graph`: a CUDA graph of
that); times per layer, with the attention's read rate.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from collections.abc import Callable

import torch
from bench_overlap import HEAD_DIM, KV_HEADS, Layer, Step, attention, copy_rate, o_and_mlp, qkv_proj

from batchjob.engine.native.layers.triton_attention import TritonPagedAttention


def timed(
    launch: Callable[[list[torch.cuda.Stream]], None],
    streams: list[torch.cuda.Stream],
    graph: bool = False,
    repeats: int = 5,
) -> float:
    """Seconds per call of `launch(streams)`, each stream starting after the usual stream and the usual stream
    waiting for all of them (`graph`: of a CUDA graph of that)."""
    main = torch.cuda.current_stream()
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            capture = torch.cuda.current_stream()
            streams = [capture if s == main else s for s in streams]
            for s in streams:
                s.wait_stream(capture)
            launch(streams)
            for s in streams:
                capture.wait_stream(s)
        launch, streams = (lambda _: captured.replay()), [main]  # noqa: E731
    best = float("inf")
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record(main)
        for s in streams:
            s.wait_stream(main)
        launch(streams)
        for s in streams:
            main.wait_stream(s)
        end.record(main)
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--sms", default="48,64,80", help="comma-separated SM counts for the attention")
    parser.add_argument("--launches", default="64x4x4,64x4x2,32x4x2,32x4x4,64x8x3,128x8x2,32x2x3,16x4x4")
    parser.add_argument("--workqueue", default=None, help="green contexts' workqueue scope: device_ctx or balanced")
    parser.add_argument("--graph", action="store_true", help="time CUDA graphs of the launches")
    parser.add_argument("--out")
    args = parser.parse_args()
    from torch.cuda.green_contexts import GreenContext

    timed_as_asked = functools.partial(timed, graph=args.graph)
    backend = TritonPagedAttention()
    total_sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = {"copy_bytes_per_s": copy_rate(), "device": torch.cuda.get_device_name(), "sms": total_sms, "cases": []}
    print(f"{results['device']}: {total_sms} SMs, device-to-device copy {results['copy_bytes_per_s'] / 1e12:.2f} TB/s")
    layers = [Layer(args.rows, args.context) for _ in range(args.layers)]
    step = Step(args.rows)
    whole = slice(0, args.rows)
    base = backend.decode_launch_config(args.rows, KV_HEADS, step.x.device)
    configs = {"usual": base}
    for shape in (s for s in args.launches.split(",") if s):
        block_n, warps, stages = (int(v) for v in shape.rstrip("ph").split("x"))
        configs[shape] = dataclasses.replace(
            base,
            block_n=block_n,
            num_warps=warps,
            num_stages=stages,
            prefetch_table="p" in shape.split("x")[-1],
            heads_first="h" in shape.split("x")[-1],
        )
    kv_bytes = 2 * args.rows * args.context * KV_HEADS * HEAD_DIM * 2

    def attend_all(config):
        def run(streams):
            with torch.cuda.stream(streams[0]):
                for layer in layers:
                    attention(step, layer, whole, 1, config)

        return run

    def matmuls_all(streams):
        with torch.cuda.stream(streams[-1]):
            for layer in layers:
                qkv_proj(step, layer, whole)
                o_and_mlp(step, layer, whole)

    def both(config):
        def run(streams):
            matmuls_all(streams)
            attend_all(config)(streams)

        return run

    # Compile and load every launch on the usual stream first.
    for config in configs.values():
        attend_all(config)([torch.cuda.current_stream()])
    matmuls_all([torch.cuda.current_stream()])
    torch.cuda.synchronize()
    usual = [torch.cuda.current_stream()]
    two = [torch.cuda.Stream(), torch.cuda.Stream()]
    results["independent"] = timed_as_asked(both(base), two) / args.layers
    print(f"  attention and matmuls on two usual streams: {results['independent'] * 1e6:.1f} us a layer")
    whole_gpu = {name: timed_as_asked(attend_all(c), usual) / args.layers for name, c in configs.items()}
    mm_whole = timed_as_asked(matmuls_all, usual) / args.layers
    print(f"{args.rows} rows x {args.context} tokens, per layer (KV {kv_bytes / 1e6:.0f} MB), all {total_sms} SMs:")
    print(f"  matmuls {mm_whole * 1e6:.1f} us")
    for name, seconds in whole_gpu.items():
        print(f"  attention {name:<10} {seconds * 1e6:8.1f} us  {kv_bytes / seconds / 1e12:5.2f} TB/s")
    results["cases"].append({"sms": total_sms, "matmuls": mm_whole, "attention": whole_gpu})
    for sms in (int(s) for s in args.sms.split(",") if s):
        started = time.perf_counter()
        try:
            scope = dict(workqueue_scope=args.workqueue) if args.workqueue else {}
            att_ctx = GreenContext.create(num_sms=sms, device_id=0, **scope)
            mm_ctx = GreenContext.create(num_sms=total_sms - sms, device_id=0, **scope)
            att_stream, mm_stream = att_ctx.Stream(), mm_ctx.Stream()
        except Exception as error:  # noqa: BLE001 - a probe: report and go on
            print(f"  {sms} SMs: no green contexts ({type(error).__name__}: {error})")
            results["cases"].append({"sms": sms, "error": repr(error)})
            continue
        case = {"sms": sms, "attention": {}, "both": {}}
        try:
            case["matmuls"] = timed_as_asked(matmuls_all, [mm_stream]) / args.layers
            print(f"  {sms} SMs for attention, {total_sms - sms} for matmuls: matmuls {case['matmuls'] * 1e6:.1f} us")
            for name, config in configs.items():
                alone = timed_as_asked(attend_all(config), [att_stream]) / args.layers
                together = timed_as_asked(both(config), [att_stream, mm_stream]) / args.layers
                case["attention"][name], case["both"][name] = alone, together
                serial = whole_gpu["usual"] + mm_whole
                print(
                    f"    attention {name:<10} {alone * 1e6:8.1f} us  {kv_bytes / alone / 1e12:5.2f} TB/s;"
                    f" beside the matmuls {together * 1e6:8.1f} us, {serial / together:5.3f}x of serial"
                )
        except Exception as error:  # noqa: BLE001
            print(f"  {sms} SMs: failed ({type(error).__name__}: {error})")
            case["error"] = repr(error)
        case["seconds"] = time.perf_counter() - started
        results["cases"].append(case)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
