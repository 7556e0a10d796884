"""The roofline's rates, measured in the same run as the systems (copy, bf16 and FP8 matmul); `graph_ms`, and
`per_call_us` for the kernel profilers in scripts/dev."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class HardwareRates:
    copy_bytes_per_s: float  # bytes read + bytes written per second by a large device-to-device copy
    matmul_flops_per_s: float  # dense bf16 matmul rate
    device: str
    fp8_matmul_flops_per_s: float | None = None  # e4m3 x e4m3 -> bf16 with row-wise scales; None: no FP8 units

    def summary(self) -> str:
        fp8 = f", fp8 {self.fp8_matmul_flops_per_s / 1e12:.0f}" if self.fp8_matmul_flops_per_s else ""
        bf16 = f"bf16 matmul {self.matmul_flops_per_s / 1e12:.0f} TFLOP/s"
        return f"{self.device}: copy {self.copy_bytes_per_s / 1e12:.2f} TB/s, {bf16}{fp8}"


def graph_ms(fn, reps: int = 20) -> float:
    """Milliseconds per replay of `fn` captured as a CUDA graph (as the engine runs its decode steps)."""
    import torch

    stream = torch.cuda.Stream()
    # The inputs were made on the caller's stream: the side stream must not read them before they exist.
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def median_seconds(fn, repeats: int, warmup: int = 3) -> float:
    """The median seconds of `fn` on the GPU over `repeats` calls (CUDA events), after `warmup` calls."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


L2_BYTES = 256 << 20  # read between two reads of one copy: more than any GPU's L2 cache holds


def copies_beyond_l2(tensor) -> list:
    """`tensor` and as many clones as make `L2_BYTES` between two reads of one copy, for `per_call_us` to walk."""
    count = max(1, -(-L2_BYTES // (tensor.numel() * tensor.element_size())))
    return [tensor] + [tensor.clone() for _ in range(count - 1)]


def per_call_us(make_call, weights: list, calls: int = 24) -> float:
    """Microseconds a call of `make_call(weight)` takes inside a CUDA graph of `calls` calls, one weight copy after
    another (as a step's layers read weights the L2 cache does not hold), so no launch overhead is counted."""
    import torch

    for weight in weights:
        make_call(weight)()  # compiled and warm before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            make_call(weights[i % len(weights)])()
    return 1e6 * median_seconds(graph.replay, 20) / calls


def measure_copy_bandwidth(gib: float = 4.0, repeats: int = 20) -> float:
    """Bytes read and written per second by a copy of `gib` GiB: how fast a decode step can stream from HBM."""
    import torch

    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 256)
    dst = torch.empty_like(src)
    return 2 * n / median_seconds(lambda: dst.copy_(src), repeats)


def measure_matmul_rate(size: int = 8192, repeats: int = 20) -> float:
    """bf16 FLOPs per second of a `size`^3 matmul on random data (random, not zeros: zeros run faster)."""
    import torch

    generator = torch.Generator(device="cuda").manual_seed(1234)
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16, generator=generator)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16, generator=generator)
    out = torch.empty_like(a)
    return 2 * size**3 / median_seconds(lambda: torch.matmul(a, b, out=out), repeats)


def measure_fp8_matmul_rate(size: int = 8192, repeats: int = 20) -> float | None:
    """FLOPs per second of a `size`^3 FP8 matmul with row-wise scales, as the engine's FP8 projections run it; None
    before compute capability 8.9."""
    import torch

    if torch.cuda.get_device_capability() < (8, 9):
        return None
    generator = torch.Generator(device="cuda").manual_seed(1234)
    a = torch.randn(size, size, device="cuda", generator=generator).to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device="cuda", generator=generator).to(torch.float8_e4m3fn).t()
    scale_a = torch.ones(size, 1, device="cuda")
    scale_b = torch.ones(1, size, device="cuda")

    def matmul():
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)

    return 2 * size**3 / median_seconds(matmul, repeats)


def measure_hardware() -> HardwareRates:
    import torch

    rates = HardwareRates(
        copy_bytes_per_s=measure_copy_bandwidth(),
        matmul_flops_per_s=measure_matmul_rate(),
        device=torch.cuda.get_device_name(),
        fp8_matmul_flops_per_s=measure_fp8_matmul_rate(),
    )
    # The probes' buffers (8 GiB) must not stay cached while the systems size their KV caches.
    torch.cuda.empty_cache()
    return rates
