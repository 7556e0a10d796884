"""What scripts/tune_moe.py measures with: a random-routing MoE problem with its float reference, a CUDA-graph timer,
parallel precompilation of the candidates, and the torch alignment the Triton one replaced (its reference)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

from bench_lib.hardware import graph_ms


@dataclass(frozen=True)
class ExpertShape:
    experts: int
    inter: int
    hidden: int
    top_k: int
    dtype: torch.dtype

    def bytes_per_expert(self, gated: bool) -> int:
        rows = 2 * self.inter if gated else self.hidden
        return rows * (self.hidden if gated else self.inter) * self.dtype.itemsize


@dataclass
class Problem:
    """One token count's inputs: `routings` random routings (each launch of a timed sequence takes the next, so its
    experts are mostly not in L2 from the launch before, as with a model's layers), and routing 0's reference."""

    hidden: torch.Tensor
    ids: list[torch.Tensor]
    weights: list[torch.Tensor]  # flat float32 [T*K]
    gated_ref: torch.Tensor  # float32 [T*K, I]: silu(gate) * up
    gated_input: torch.Tensor  # gated_ref in the model dtype: the down projection's input
    down_ref: torch.Tensor  # float32 [T*K, H]: routing-weighted down projection of gated_input
    out_ref: torch.Tensor  # float32 [T, H]
    touched: float  # mean distinct experts per routing


def random_routing(tokens: int, shape: ExpertShape, gen: torch.Generator, device) -> tuple:
    """Top-k of uniformly random scores: each token's k experts distinct, all experts equally likely."""
    scores = torch.rand(tokens, shape.experts, generator=gen, device=device)
    weights, ids = scores.topk(shape.top_k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).reshape(-1).float(), ids


def make_problem(tokens: int, shape: ExpertShape, w13, w2, routings: int, device) -> Problem:
    gen = torch.Generator(device).manual_seed(tokens)
    hidden = torch.randn(tokens, shape.hidden, generator=gen, device=device).to(shape.dtype)
    pairs = [random_routing(tokens, shape, gen, device) for _ in range(routings)]
    weights0, ids0 = pairs[0]
    flat = ids0.reshape(-1)
    gated_ref = torch.zeros(flat.numel(), shape.inter, device=device)
    down_ref = torch.zeros(flat.numel(), shape.hidden, device=device)
    gated_input = torch.zeros(flat.numel(), shape.inter, device=device, dtype=shape.dtype)
    for expert in flat.unique().tolist():
        rows = (flat == expert).nonzero().squeeze(1)
        gate, up = (hidden[rows // shape.top_k].float() @ w13[expert].float().T).chunk(2, dim=-1)
        gated_ref[rows] = torch.nn.functional.silu(gate) * up
        gated_input[rows] = gated_ref[rows].to(shape.dtype)
        down_ref[rows] = (gated_input[rows].float() @ w2[expert].float().T) * weights0[rows, None]
    return Problem(
        hidden=hidden,
        ids=[ids for _, ids in pairs],
        weights=[weights for weights, _ in pairs],
        gated_ref=gated_ref,
        gated_input=gated_input,
        down_ref=down_ref,
        out_ref=down_ref.view(tokens, shape.top_k, shape.hidden).sum(1),
        touched=sum(ids.unique().numel() for _, ids in pairs) / routings,
    )


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within rounding to bf16 of the intermediate values, relative to the output's scale."""
    scale = want.abs().max().clamp(min=1e-6)
    return bool(((got.float() - want).abs() <= 1e-2 * scale + 3e-2 * want.abs()).all())


def time_launches(launches: list[Callable[[], object]], replays: int = 3) -> float:
    """Microseconds per launch: replayed from one CUDA graph, or on the CPU (the interpreter) each timed once."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        for launch in launches:
            launch()
        return (time.perf_counter() - start) / len(launches) * 1e6

    def run_all() -> None:
        for launch in launches:
            launch()

    return graph_ms(run_all, reps=replays) * 1e3 / len(launches)


def torch_alignment(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple:
    """The alignment as plain torch ops (a stable sort and some twenty small kernels), which the Triton one replaced."""
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    max_blocks = -(-(pairs + min(num_experts, pairs) * (block_m - 1)) // block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert_of_sorted = flat[order]
    rank = torch.arange(pairs, device=flat.device) - (counts.cumsum(0) - counts)[expert_of_sorted]
    destination = (padded_end - padded)[expert_of_sorted] + rank
    sorted_pairs = torch.full((max_blocks * block_m,), pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs.scatter_(0, destination, order.to(torch.int32))
    block_starts = torch.arange(max_blocks, device=flat.device) * block_m
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_experts.to(torch.int32), padded_end[-1:].to(torch.int32)


def _compile_jobs(shape: ExpertShape, jobs: list[tuple]) -> list[str]:
    """Run each (gated, block_m, tile) once on a two-expert problem of the real row sizes, filling Triton's disk
    cache with the full problem's specialisations."""
    from batchjob.engine.native.kernels.fused_moe import grouped_gemm
    from batchjob.engine.native.kernels.moe_align import moe_align_block_size

    device = torch.device("cuda")
    tokens, experts = 4, 2
    w13 = torch.zeros(experts, 2 * shape.inter, shape.hidden, device=device, dtype=shape.dtype)
    w2 = torch.zeros(experts, shape.hidden, shape.inter, device=device, dtype=shape.dtype)
    hidden = torch.zeros(tokens, shape.hidden, device=device, dtype=shape.dtype)
    ids = torch.randint(0, experts, (tokens, shape.top_k), device=device)
    weights = torch.ones(tokens * shape.top_k, device=device)
    gated = torch.zeros(tokens * shape.top_k, shape.inter, device=device, dtype=shape.dtype)
    down = torch.zeros(tokens * shape.top_k, shape.hidden, device=device, dtype=shape.dtype)
    failures = []
    for gated_gemm, block_m, tile in jobs:
        alignment = moe_align_block_size(ids, experts, block_m)
        a, b, out = (hidden, w13, gated) if gated_gemm else (gated, w2, down)
        try:
            grouped_gemm(a, b, out, weights, alignment, gated=gated_gemm, top_k=shape.top_k, block_m=block_m, tile=tile)
        except Exception as err:  # noqa: BLE001 - a config the GPU cannot run is reported, not fatal
            failures.append(f"{'gate_up' if gated_gemm else 'down'} {block_m} {tile}: {type(err).__name__}")
    torch.cuda.synchronize()
    return failures


def precompile(shape: ExpertShape, jobs: list[tuple], workers: int) -> list[str]:
    """Compile the candidates in `workers` processes (Triton compiles one kernel at a time per process)."""
    if workers <= 1 or not torch.cuda.is_available():
        return []
    import multiprocessing

    chunks = [jobs[i::workers] for i in range(workers)]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return [failure for failures in pool.map(_compile_jobs, [shape] * workers, chunks) for failure in failures]
