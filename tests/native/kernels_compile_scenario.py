"""Run by test_kernels_compile.py in a process of its own: the engine's Triton kernels compiled for an H100 (sm_90)
by Triton's real compiler, on a machine without a GPU. A driver for a device that is not here makes each launch a
no-op after the checks a real launch makes first (the kernel's shared memory against an H100's 227 KB, its threads),
so every kernel a call launches gets compiled and checked, not only the first. Each call is one engine path (a
norm, a rotary step, an attention step, a sampler, a matmul, the MoE layer); prints one JSON object: each call's
"ok" or its error, how many kernel variants were compiled, and those whose registers spill.

    python kernels_compile_scenario.py
    python kernels_compile_scenario.py --through-workers   (the same kernels compiled by compile workers first)
    python kernels_compile_scenario.py --ada   (for an L40S: sm_89, about 100 KB of shared memory a block, no TMA)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

from batchjob.engine.native.runtime.compile_worker import TargetOnlyDriver

H100_SHARED_BYTES = 232448  # shared memory a block may opt into on an H100 (and an H200)
H100_SMS = 132
# An L40S (Ada, sm_89): shared memory a block may opt into, as on an L4, an RTX 4090 and most Ampere cards but the A100.
ADA_SHARED_BYTES = 101376
ADA_SMS = 142


class AbsentDevice(TargetOnlyDriver):
    """The Triton driver of a GPU that is not here (an H100 unless told otherwise): what compiling and launching ask
    of a driver, with launches that do nothing."""

    def __init__(self, arch: int = 90, shared_bytes: int = H100_SHARED_BYTES, sms: int = H100_SMS) -> None:
        super().__init__(GPUTarget("cuda", arch, 32))
        self.utils = self
        self.shared_bytes, self.sms = shared_bytes, sms

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_device_properties(self, device: int) -> dict[str, int]:
        return {"max_shared_mem": self.shared_bytes, "multiprocessor_count": self.sms, "max_num_regs": 65536}

    def load_binary(self, name: str, kernel: bytes, shared: int, device: int) -> tuple[Any, Any, int, int, int]:
        return None, None, 0, 0, 1024

    def launcher_cls(self, src: Any, metadata: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches += 1

        return launch

    launches = 0  # launches that reached a binary


def calls(sms: int = H100_SMS, tma: bool = True) -> dict[str, Callable[[], Any]]:
    from batchjob.engine.native.kernels import (
        fp8,
        fp8_few_rows,
        fused_moe,
        fused_ops,
        invariant_matmul,
        moe_configs,
        sampling_race,
        token_mask,
    )
    from batchjob.engine.native.kernels.prefill_attention import PrefillConfig
    from batchjob.engine.native.layers.attention import make_metadata
    from batchjob.engine.native.layers.triton_attention import TritonPagedAttention

    invariant_matmul._sm_count = lambda device: sms
    invariant_matmul._has_tma = lambda device: tma

    def pointer_loads(call: Callable[[], Any]) -> Callable[[], Any]:
        """`call` with the invariant matmul's tiles loaded by address, as on a GPU without TMA."""

        def run() -> Any:
            invariant_matmul.TMA_LOADS = False
            try:
                return call()
            finally:
                invariant_matmul.TMA_LOADS = True

        return run

    device_name = moe_configs.device_name
    bf16 = torch.bfloat16
    x = torch.randn(37, 2048, dtype=bf16)
    w = torch.randn(2048, dtype=bf16)
    heads, kv_heads, dim, block = 32, 8, 128, 16
    table = torch.randn(4096, 2 * dim, dtype=bf16)

    def rotary_and_store() -> None:
        q, k, v = (torch.randn(37, n, dim, dtype=bf16) for n in (heads, kv_heads, kv_heads))
        cache = torch.zeros(64, block, kv_heads, dim, dtype=bf16)
        slots = torch.arange(37, dtype=torch.int64)
        fused_ops.rotary_qk_(q, k, torch.arange(37), table, None, (v, cache, cache.clone(), slots))

    def attention(
        query_lens: list[int],
        seq_lens: list[int],
        splits: int | None = None,
        shape: tuple[int, int, int] = (32, 8, 128),
        deterministic: bool = False,
        prefill_config: Any = None,
    ) -> Callable[[], Any]:
        heads, kv_heads, dim = shape

        def step() -> Any:
            blocks = [-(-s // block) for s in seq_lens]
            tables = [list(range(1 + sum(blocks[:i]), 1 + sum(blocks[: i + 1]))) for i in range(len(blocks))]
            cache = torch.zeros(2 + sum(blocks), block, kv_heads, dim, dtype=bf16)
            meta = make_metadata(query_lens, seq_lens, tables, block)
            q = torch.randn(sum(query_lens), heads, dim, dtype=bf16)
            k, v = (torch.randn(sum(query_lens), kv_heads, dim, dtype=bf16) for _ in range(2))
            backend = TritonPagedAttention(
                num_decode_splits=splits, prefill_config=prefill_config, deterministic=deterministic
            )
            return backend.forward(q, k, v, cache, cache, meta, dim**-0.5)

        return step

    def sampled() -> None:
        logits = torch.randn(16, 128256)
        keys = torch.randint(0, 2**62, (16,), dtype=torch.int64)
        filters = (torch.full((16,), 20), torch.full((16,), 0.9), torch.full((16,), 0.01))
        sampling_race.sample_tokens(logits, torch.full((16,), 0.8), keys, filters)

    def masked_greedy() -> None:
        logits = torch.randn(16, 128256, dtype=bf16)
        bitmask = torch.full((16, -(-128256 // 32)), -1, dtype=torch.int32)
        sampling_race.greedy_tokens(logits, (bitmask, torch.arange(16, dtype=torch.int32)))
        token_mask.apply_token_bitmask(logits.float(), bitmask, torch.arange(16, dtype=torch.int32))

    def experts(tokens: int, hidden: int, inter: int, num_experts: int, top_k: int) -> Callable[[], Any]:
        def step() -> Any:
            # Never touched (the launches do nothing): the pages of Qwen3-30B-A3B's 1.2 GB of experts stay unmapped.
            w13 = torch.empty(num_experts, 2 * inter, hidden, dtype=bf16)
            w2 = torch.empty(num_experts, hidden, inter, dtype=bf16)
            ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)])
            hidden_states = torch.randn(tokens, hidden, dtype=bf16)
            return fused_moe.fused_moe(hidden_states, w13, w2, torch.rand(tokens, top_k), ids)

        return step

    def tuned_experts() -> None:
        """Every step size the package's table tunes for this shape on an H200 (sm_90, an H100's shared memory)."""
        moe_configs.device_name = lambda device: "NVIDIA H200"
        try:
            for tokens in (1, 16, 64, 128, 256, 512, 2048, 8192):
                experts(tokens, 2048, 768, 128, 8)()
        finally:
            moe_configs.device_name = device_name

    def head_norms_rotary() -> None:  # Qwen 3: each head RMS-normalised before it turns
        q, k = torch.randn(37, 16, dim, dtype=bf16), torch.randn(37, 8, dim, dtype=bf16)
        norms = (torch.randn(dim, dtype=bf16), torch.randn(dim, dtype=bf16), 1e-6, False, 0.0)
        fused_ops.rotary_qk_(q, k, torch.arange(37), table, norms)

    def fp8_projection(group: int | None, weight_block: tuple[int, int]) -> Callable[[], Any]:
        def step() -> Any:
            q, scales = fp8.quantize(x, group)
            weight = torch.randn(1024, 2048).to(fp8.FP8)
            rows, cols = weight_block
            weight_scales = torch.rand(-(-1024 // rows), -(-2048 // cols))
            return fp8.scaled_matmul(q, scales, weight, weight_scales, weight_block, bf16)

        return step

    def few_rows(rows: int, tile: tuple[int, int, int] | None = None) -> Callable[[], Any]:
        def step() -> Any:
            q, scales = fp8.quantize(torch.randn(rows, 4096, dtype=bf16))
            weight = torch.randn(6144, 4096).to(fp8.FP8)
            return fp8_few_rows.matmul(q, scales, weight, torch.rand(6144, 1), None, bf16, tile)

        return step

    return {
        "rms_norm": lambda: fused_ops.rms_norm(x, w, 1e-5),
        "rms_norm with residual": lambda: fused_ops.rms_norm(x, w, 1e-5, residual=x.clone()),
        "rms_norm of split-K parts": lambda: fused_ops.rms_norm(torch.randn(3, 37, 2048), w, 1e-5, residual=x.clone()),
        "rotary on q and k, storing k and v": rotary_and_store,
        "silu_and_mul": lambda: fused_ops.silu_and_mul(torch.randn(37, 2 * 8192, dtype=bf16)),
        "decode attention": attention([1] * 8, [5, 17, 64, 130, 300, 1, 2, 1000]),
        "split decode attention": attention([1] * 4, [700, 1500, 64, 3000], splits=4),
        "prefill and mixed attention": attention([5, 7, 1, 70, 1], [5, 37, 19, 70, 2]),
        "invariant matmul, K split": lambda: invariant_matmul.matmul(x, torch.randn(3072, 2048, dtype=bf16)),
        "invariant matmul, K split, two row tiles": lambda: invariant_matmul.matmul(
            torch.randn(200, 2048, dtype=bf16), torch.randn(3072, 2048, dtype=bf16)
        ),
        "invariant matmul, serial": lambda: invariant_matmul.matmul(
            torch.randn(2304, 2048, dtype=bf16), torch.randn(3072, 2048, dtype=bf16)
        ),
        "invariant matmul, serial, K in four parts (Llama-3.2-1B's down)": lambda: invariant_matmul.matmul(
            torch.randn(2304, 8192, dtype=bf16), torch.randn(2048, 8192, dtype=bf16)
        ),
        "invariant matmul, serial in narrow tiles (512 rows of Llama-3.2-1B's qkv)": lambda: invariant_matmul.matmul(
            torch.randn(512, 2048, dtype=bf16), torch.randn(3072, 2048, dtype=bf16)
        ),
        "invariant matmul, serial, K in one part (Llama-3.2-1B's gate_up)": lambda: invariant_matmul.matmul(
            torch.randn(2304, 2048, dtype=bf16), torch.randn(16384, 2048, dtype=bf16)
        ),
        "invariant matmul, K split, two row tiles loaded by address": pointer_loads(
            lambda: invariant_matmul.matmul(torch.randn(200, 2048, dtype=bf16), torch.randn(3072, 2048, dtype=bf16))
        ),
        "invariant matmul, serial, K in four parts, tiles loaded by address": pointer_loads(
            lambda: invariant_matmul.matmul(torch.randn(2304, 8192, dtype=bf16), torch.randn(2048, 8192, dtype=bf16))
        ),
        "fp8 per-token activations, per-row weights": fp8_projection(None, (1, 2048)),
        "fp8 group activations, 128x128 weight blocks": fp8_projection(128, (128, 128)),
        "rms_norm with residual, quantized to fp8": lambda: fused_ops.rms_norm_fp8(x, w, 1e-5, x.clone()),
        "rms_norm of split-K parts, quantized to fp8, amax capped": lambda: fused_ops.rms_norm_fp8(
            torch.randn(2, 37, 2048), w, 1e-5, x.clone(), upper=1200.0
        ),
        "silu_and_mul quantized to fp8": lambda: fused_ops.silu_and_mul_fp8(torch.randn(37, 2 * 14336, dtype=bf16)),
        "silu_and_mul quantized to fp8, a 70B's row in blocks": lambda: fused_ops.silu_and_mul_fp8(
            torch.randn(3, 2 * 28672, dtype=bf16)
        ),
        "fp8 projection of a decode step's few rows": few_rows(32),
        "fp8 projection of one row, wide weight tiles": few_rows(1, tile=(64, 4, 5)),
        "fp8 projection of 64 rows": few_rows(64),
        "sampler with filters": sampled,
        "greedy under a bitmask, and the bitmask applied": masked_greedy,
        "fused mixture of experts": experts(48, 1024, 768, 32, 4),
        # The benchmark models' own shapes
        "Llama-3.2-1B decode attention (head_dim 64)": attention([1] * 16, list(range(40, 56)), shape=(32, 8, 64)),
        "Llama-3.2-1B prefill attention (head_dim 64)": attention([300, 1, 700], [300, 90, 700], shape=(32, 8, 64)),
        "Qwen3-0.6B mixed attention (16 heads on 8)": attention([1, 1, 120], [64, 900, 120], shape=(16, 8, 128)),
        "Llama-3.2-1B mixed attention, deterministic (every token through the varlen kernel)": attention(
            [1, 1, 700], [300, 90, 700], shape=(32, 8, 64), deterministic=True
        ),
        # A program of fewer than 4 warps keeps mma.sync, as the 16-row launch does, where 64 rows in 4 take wgmma.
        **{
            f"Llama-3.2-1B mixed attention, deterministic, row sums by a dot, {rows} rows in {warps} warps": attention(
                [1, 1, 700],
                [300, 90, 700],
                shape=(32, 8, 64),
                deterministic=True,
                prefill_config=PrefillConfig(block_m=rows, num_warps=warps, row_sum_dot=True),
            )
            for rows, warps in ((16, 4), (32, 2), (64, 4))
        },
        "Qwen 3 head norms before the rotary": head_norms_rotary,
        "Gemma's float32 norm weight with an offset": lambda: fused_ops.rms_norm(
            x, w, 1e-6, weight_fp32=True, offset=1.0
        ),
        "Llama-3.1-8B norm (4,096 wide)": lambda: fused_ops.rms_norm(
            torch.randn(32, 4096, dtype=bf16), torch.randn(4096, dtype=bf16), 1e-5
        ),
        "Qwen3-30B-A3B experts (128, top 8)": experts(64, 2048, 768, 128, 8),
        "Qwen3-30B-A3B experts with the H200 table's tuned configs": tuned_experts,
    }


def through_workers() -> None:
    """Every call's variants listed (launches skipped), compiled by two compile workers (which load no torch), then
    every call launched: each launch must find its binary under the key the workers wrote, compiling nothing. Then
    a second listing, in a process that now holds every binary (a second engine's start-up): it lists the same
    variants and launches none of them."""
    from batchjob.engine.native.runtime.compile_pool import CompilePool
    from batchjob.engine.native.runtime.kernel_variants import (
        recording_compiles,
        skipping_launches,
        zeroed_allocations,
    )

    device = AbsentDevice()
    driver.set_active(device)

    def listing() -> tuple[list, dict[str, str]]:
        errors = {}
        with zeroed_allocations(), skipping_launches() as found:
            for name, call in calls().items():
                try:
                    call()
                except Exception as exc:  # a call whose host code reads a skipped launch's output: listed so far
                    errors[name] = f"{type(exc).__name__}: {exc}"[:300]
        return found, errors

    found, listing_errors = listing()
    pool = CompilePool(2, ("cuda", 90, 32))
    pool.submit(found)
    report = pool.wait(timeout_s=900)
    folder = os.environ["TRITON_CACHE_DIR"]
    before = set(os.listdir(folder))
    with recording_compiles() as launched:
        for call in calls().values():
            call()
    launches = device.launches
    relisted, relisting_errors = listing()
    compiled = {v.key: v.cache_hash for v in report.compiled}
    print(
        json.dumps(
            {
                "listed": len(found),
                "listing_errors": listing_errors,
                "compiled": len(report.compiled),
                "failed": [f"{v.qualname}: {why}"[:300] for v, why in report.failed],
                "launched": len(launched),
                "missed": sorted({v.qualname for v in launched if compiled.get(v.key) != v.cache_hash}),
                "new_cache_entries": len(set(os.listdir(folder)) - before),
                "launches": launches,
                "relisted_as_listed": sorted(v.key for v in relisted) == sorted(v.key for v in found),
                "relisting_errors": relisting_errors,
                "relisting_launches": device.launches - launches,
            }
        )
    )


def main() -> None:
    if sys.argv[1:] == ["--through-workers"]:
        return through_workers()
    ada = sys.argv[1:] == ["--ada"]
    driver.set_active(AbsentDevice(89, ADA_SHARED_BYTES, ADA_SMS) if ada else AbsentDevice())
    results = {}
    for name, call in calls(ADA_SMS, tma=False).items() if ada else calls().items():
        try:
            call()
            results[name] = "ok"
        except Exception as exc:
            results[name] = f"{type(exc).__name__}: {exc}"[:2000] + "\n" + traceback.format_exc()[-1500:]
    folder = os.environ["TRITON_CACHE_DIR"]
    compiled = len(os.listdir(folder)) if os.path.isdir(folder) else 0
    print(json.dumps({"results": results, "compiled": compiled, "spilled": spilled(folder)}))


def spilled(folder: str) -> dict[str, int]:
    """Each compiled kernel whose registers spill to local memory, with its stack frame in bytes (cuobjdump's
    resource usage of every binary in Triton's cache): a kernel that spills keeps part of what its loop works on
    in local memory, and goes there for it at every step."""
    from triton import knobs

    found = {}
    for binary in sorted(Path(folder).glob("*/*.cubin")):
        usage = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "-res-usage", str(binary)], capture_output=True, text=True, check=True
        ).stdout
        stack = int(re.search(r"STACK:(\d+)", usage).group(1))
        if stack:
            found[f"{binary.stem} ({binary.parent.name[:8]})"] = stack
    return found


if __name__ == "__main__":
    main()
