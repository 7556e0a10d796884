"""The device side of an engine's start-up, in order: the model and its weights, the KV cache sized from what is
left of the card after the largest step, the model runner with its IO slots, the CUDA graphs, the warm-up.

`load_on_device` and `start_runner` are separate because the engine builds the constraint compiler's vocabulary
index between them (it needs the model's spec and runs in a thread beside the rest). Each step's seconds go to
the engine's statistics (`load_s`, `kv_sizing_s`, `graph_capture_s`, `warmup_s`): the start-up breakdown of a
job's "ready to generate" line.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from batchjob.engine.api import EngineSetupError
from batchjob.engine.grammar import bitmask_words
from batchjob.engine.native.models.decoder import CausalLM
from batchjob.engine.native.models.spec import ModelSpec
from batchjob.engine.native.options import NativeOptions
from batchjob.engine.native.runtime.io_slot import SlotLimits
from batchjob.engine.native.runtime.kv_cache import allocate_kv_cache, decide_num_blocks, profile_peak_bytes
from batchjob.engine.native.runtime.model_runner import ModelRunner
from batchjob.engine.native.runtime.precompile import KernelPrecompile
from batchjob.engine.native.runtime.step_layout import GRAPH_MODES_BY_NAME, decode_buckets, mixed_buckets
from batchjob.engine.native.runtime.warmup import WarmupLimits, launch_steps, warm_up, warmup_steps

if TYPE_CHECKING:
    from batchjob.engine.native.runtime.kernel_variants import KernelVariant

log = logging.getLogger("batchjob.engine.native")
# How long a thread that wants the interpreter lock waits for the one holding it, during start-up (Python's
# default: 5 ms).
STARTUP_SWITCH_INTERVAL_S = 0.0002


@dataclass
class DeviceReady:
    """What `start_runner` leaves: the cache (a key and a value tensor per layer), its block count, the runner,
    and the seconds and bytes of each start-up step."""

    kv_caches: list[tuple[torch.Tensor, ...]]
    num_blocks: int
    runner: ModelRunner
    stats: dict[str, float] = field(default_factory=dict)


@contextmanager
def short_thread_switches() -> Iterator[None]:
    """Start-up with the interpreter's switch interval cut to `STARTUP_SWITCH_INTERVAL_S`, restored after.

    Threads run beside the start-up: the tokenizer's (transformers' imports, seconds of Python), the weight readers,
    Triton's cache key (hashing 500 MB in 1 MB reads). Each time the start-up's thread comes back from a call that
    let go of the lock (a GPU synchronisation, a kernel's load, a copy), it waits for a busy thread to give the lock
    up, up to the switch interval; so does a reader after each read. With the default interval, 500 waits of 1 ms
    beside one busy thread took 3.3 s instead of 0.6 s, and Triton's key took 7.6 s instead of 0.4 s beside a busy
    thread (1.1 s at 0.5 ms)."""
    saved = sys.getswitchinterval()
    sys.setswitchinterval(min(STARTUP_SWITCH_INTERVAL_S, saved))
    try:
        yield
    finally:
        sys.setswitchinterval(saved)


def load_on_device(model_path: str | Path, opts: NativeOptions, device: torch.device) -> tuple[CausalLM, ModelSpec]:
    """The model with its weights (or dummy ones) on `device`, and its spec."""
    from batchjob.engine.native.layers.attention import TorchPagedAttention
    from batchjob.engine.native.loading.model_loader import load_model

    if device.type == "cuda":
        from batchjob.engine.native.layers.triton_attention import TritonPagedAttention

        _hash_triton_beside()
        attn = TritonPagedAttention(deterministic=opts.deterministic)
    else:
        attn = TorchPagedAttention(deterministic=opts.deterministic)
    return load_model(
        model_path,
        opts.dtype,
        device,
        attn,
        opts.max_model_len,
        opts.load_format,
        quantization=opts.quantization,
        kv_cache_dtype=opts.kv_cache_dtype,
        deterministic=opts.deterministic,
    )


def start_runner(
    model: CausalLM,
    spec: ModelSpec,
    opts: NativeOptions,
    device: torch.device,
    gates: bool = False,
    kernels: KernelPrecompile | None = None,
) -> DeviceReady:
    """Size and allocate the KV cache, build the runner, capture its CUDA graphs and warm it up (on a GPU).
    `gates`: once warmed up, masked samplers may wait on the GPU behind gates (the masks are filled by a thread
    other than the loop's). `kernels`: the start-up's Triton kernels compiled by worker processes first
    (`precompile.py`), and what it launched kept as the next start-up's plan."""
    if kernels is None:
        return _start_runner(model, spec, opts, device, gates)
    kernels.compile_before_start(lambda found: list_start_variants(model, spec, opts, device, found))
    with kernels.recording():
        ready = _start_runner(model, spec, opts, device, gates)
    ready.stats.update(kernels.stats)
    return ready


def list_start_variants(
    model: CausalLM,
    spec: ModelSpec,
    opts: NativeOptions,
    device: torch.device,
    on_found: Callable[[KernelVariant], None] | None = None,
) -> list[KernelVariant]:
    """The Triton kernel variants `start_runner` launches, found by launching its steps (the KV sizing's largest,
    every graph's work, the warm-up) through one layer of each kind on a scratch runner with a one-block cache,
    each launch of a variant not compiled yet skipped (`kernel_variants.py`). `on_found` gets each variant as the
    listing finds it."""
    from batchjob.engine.native.runtime.kernel_variants import skipping_launches, zeroed_allocations

    cuda = device.type == "cuda"
    with torch.no_grad(), zeroed_allocations(), skipping_launches(on_found) as found:
        if cuda:  # the KV sizing's profile (a GPU's only)
            with model.kernel_layers():
                profile_peak_bytes(model, spec, opts, device)
        runner, limits = _make_runner(model, spec, opts, device, allocate_kv_cache(spec, 1, opts.block_size, device))
        if cuda:
            # The runner's buffers were zeroed on this stream, behind the profile's work; its other streams must
            # not read them before (a buffer reused from the profile holds its values: as an index, out of range).
            torch.cuda.synchronize(device)
        if opts.cuda_graphs:
            runner.graphs.launch_uncaptured(*_graph_kinds(opts))
        if _warms_up(opts, device):
            launch_steps(runner, _warmup_steps(opts, spec, limits), opts.block_size)
        if cuda:
            torch.cuda.synchronize(device)
        del runner
    if cuda:
        torch.cuda.empty_cache()
    return found


def _make_runner(
    model: CausalLM, spec: ModelSpec, opts: NativeOptions, device: torch.device, kv_caches: list
) -> tuple[ModelRunner, SlotLimits]:
    limits = SlotLimits(
        max_tokens=max(opts.max_num_batched_tokens, _max_graph_batch(opts)),
        max_rows=opts.max_num_seqs,
        max_blocks_per_seq=_blocks_per_seq(opts, spec),
        max_top_logprobs=20,
        bitmask_words=bitmask_words(spec.vocab_size),
    )
    runner = ModelRunner(
        model,
        kv_caches,
        opts.block_size,
        limits,
        device,
        spec.max_model_len,
        spec.vocab_size,
        debug_poison=opts.debug_poison_slots,
    )
    return runner, limits


def _max_graph_batch(opts: NativeOptions) -> int:
    return min(opts.graph_max_batch or opts.max_num_seqs, opts.max_num_seqs)


def _blocks_per_seq(opts: NativeOptions, spec: ModelSpec) -> int:
    return -(-(spec.max_model_len + 1) // opts.block_size)


def _graph_kinds(opts: NativeOptions) -> tuple[list[int], tuple, bool, list[int]]:
    """What `StepGraphs.capture` captures: decode buckets, sampler modes, split steps or not, mixed buckets."""
    modes = GRAPH_MODES_BY_NAME[opts.graph_sampling]
    # The ranks of a tensor-parallel engine never split a step: constrained requests are refused there.
    split = opts.graph_constrained and opts.tensor_parallel == 1
    mixed = mixed_buckets(opts.max_num_batched_tokens, opts.max_num_seqs) if opts.graph_mixed else []
    return decode_buckets(_max_graph_batch(opts)), modes, split, mixed


def _warms_up(opts: NativeOptions, device: torch.device) -> bool:
    # On a CPU nothing compiles and there is no caching allocator to prime: the warm-up would be pure cost.
    return opts.warmup if opts.warmup is not None else device.type == "cuda"


def _warmup_steps(opts: NativeOptions, spec: ModelSpec, limits: SlotLimits) -> list:
    steps = warmup_steps(
        WarmupLimits(opts.max_num_seqs, opts.max_num_batched_tokens, spec.max_model_len, limits.max_top_logprobs)
    )
    if opts.tensor_parallel > 1:
        steps = [step for step in steps if not step.constrained]
    return steps


def _start_runner(
    model: CausalLM, spec: ModelSpec, opts: NativeOptions, device: torch.device, gates: bool
) -> DeviceReady:
    started = time.perf_counter()
    num_blocks = decide_num_blocks(model, spec, opts, device)
    kv_caches = allocate_kv_cache(spec, num_blocks, opts.block_size, device)
    kv_sized = time.perf_counter()
    _check_fits(opts, spec, num_blocks, _blocks_per_seq(opts, spec))
    runner, limits = _make_runner(model, spec, opts, device, kv_caches)
    ready = DeviceReady(kv_caches, num_blocks, runner)
    ready.stats.update(
        kv_blocks=num_blocks,
        block_size=opts.block_size,
        slot_bytes=runner.slots[1].device_bytes,
        kv_sizing_s=kv_sized - started,  # the KV sizing profile (the first kernels load there too)
    )
    if device.type == "cuda" and opts.cuda_graphs:
        _capture_graphs(ready, opts)
    if _warms_up(opts, device):
        ready.stats["warmup_s"] = warm_up(runner, _warmup_steps(opts, spec, limits), opts.block_size)
        if gates:
            # Every kernel the run launches is loaded, and the mask worker, not the loop, fills the masks:
            # masked samplers may wait on the GPU behind gates the worker opens (host_gate.py).
            runner.use_gates()
    return ready


def _check_fits(opts: NativeOptions, spec: ModelSpec, num_blocks: int, blocks_per_seq: int) -> None:
    if num_blocks - 1 < blocks_per_seq:
        raise EngineSetupError(
            f"the KV cache holds {num_blocks - 1} blocks of {opts.block_size} tokens, fewer than one sequence "
            f"of max_model_len={spec.max_model_len} needs ({blocks_per_seq}); lower engine.max_model_len "
            f"or give the cache more memory (engine.gpu_memory_utilization / engine.kv_cache_gb)"
        )
    if not opts.enable_chunked_prefill and opts.max_num_batched_tokens < spec.max_model_len:
        raise EngineSetupError(
            f"without chunked prefill a whole sequence must fit one step, but engine.max_num_batched_tokens="
            f"{opts.max_num_batched_tokens} < max_model_len={spec.max_model_len}; raise it, lower "
            "engine.max_model_len, or set engine.enable_chunked_prefill=true"
        )


def _capture_graphs(ready: DeviceReady, opts: NativeOptions) -> None:
    captured, modes, split, mixed = _graph_kinds(opts)
    graphs = ready.runner.graphs
    seconds, nbytes = graphs.capture(captured, modes, split, mixed)
    kv_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in ready.kv_caches)
    slot_bytes = ready.stats["slot_bytes"]
    log.info(
        "captured %d CUDA graphs (2 slots x %d decode buckets x %d sampler modes, plus %d for steps with "
        "constrained rows and %d for mixed steps, token buckets: %s) in %.1f s using %.1f MiB, plus %.1f MiB "
        "for the second IO slot (%.2f%% of the KV cache together)",
        len(graphs.decode),
        len(captured),
        len(graphs.buckets.modes),
        graphs.split_count,
        len(graphs.mixed),
        ", ".join(map(str, graphs.buckets.mixed)) or "none",
        seconds,
        nbytes / 2**20,
        slot_bytes / 2**20,
        100 * (nbytes + slot_bytes) / kv_bytes,
    )
    ready.stats.update(
        decode_buckets=len(graphs.buckets.decode),
        graph_capture_s=seconds,
        graph_bytes=nbytes,
        kv_cache_bytes=kv_bytes,
        graph_modes=len(graphs.buckets.modes),
        mixed_graph_modes=len(graphs.buckets.mixed_modes),
    )


def _hash_triton_beside() -> None:
    """Triton keys its kernel cache with a hash of its own files (libtriton alone is about 500 MB), computed once
    per process at the first kernel launch: 0.3-0.5 s of a start-up. Hashing releases the interpreter lock, so a
    thread computes it while the weights load; the first launch then finds it done (Triton keeps it)."""
    from triton.runtime import cache

    key = getattr(cache, "triton_key", None)  # Triton's own; absent from a version that keys otherwise
    if callable(key):
        threading.Thread(target=key, name="batchjob-triton-key", daemon=True).start()
