"""A native engine's start-up, up to its loop: on one device (the weights, the constraint compiler, the runner with
its KV cache, graphs and warm-up, the tokenizer loading beside them), or as the job process of a tensor-parallel
engine (its ranks hold the model and run the steps). Either way `EngineStart` is what the loop (`engine.py`) is
given, with the seconds of each start-up step in its statistics.
"""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from batchjob.engine.devices import torch_device
from batchjob.engine.grammar import GrammarCompiler
from batchjob.engine.native.models.spec import ModelSpec
from batchjob.engine.native.options import NativeOptions
from batchjob.engine.native.runtime.device_start import load_on_device, short_thread_switches, start_runner
from batchjob.engine.native.runtime.model_runner import ModelRunner
from batchjob.engine.native.runtime.precompile import compiling_ahead
from batchjob.engine.transformers_import import load_tokenizer

if TYPE_CHECKING:
    from batchjob.engine.native.executor.rank_group import RankGroup


@dataclasses.dataclass
class EngineStart:
    """What a started engine runs its loop with. `runner` is the device's model runner, or the ranks of a
    tensor-parallel engine (then also `ranks`; `model` None and no KV cache in this process)."""

    device: torch.device
    spec: ModelSpec
    runner: ModelRunner | RankGroup
    num_blocks: int
    grammars: GrammarCompiler
    tokenizer: Any
    stats: dict[str, float]
    model: torch.nn.Module | None = None
    kv_caches: list[tuple[torch.Tensor, ...]] = dataclasses.field(default_factory=list)
    ranks: RankGroup | None = None


def check_gpu_count(opts: NativeOptions) -> None:
    """The job process's checks of a tensor-parallel engine's devices (its ranks are given cuda:r each)."""
    if opts.tensor_parallel > 1 and opts.device.startswith("cuda:"):
        raise ValueError(
            f"engine.device={opts.device} with engine.tensor_parallel={opts.tensor_parallel}: use "
            "engine.device=cuda or auto (rank r runs on the r-th visible GPU; CUDA_VISIBLE_DEVICES picks them)"
        )
    if opts.tensor_parallel > 1 and torch_device(opts.device).type == "cuda":
        visible = torch.cuda.device_count()
        if visible < opts.tensor_parallel:
            raise ValueError(
                f"engine.tensor_parallel={opts.tensor_parallel} needs {opts.tensor_parallel} GPUs, but {visible} "
                f"are visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}); lower it or "
                "request more GPUs"
            )


def start_on_device(model_path: str, opts: NativeOptions) -> EngineStart:
    device = torch_device(opts.device)
    context_s = _start_device(device)
    started = time.perf_counter()
    with short_thread_switches(), compiling_ahead(model_path, opts, device) as kernels:
        # Without detokenizing, token ids in and out are all the engine sees: no tokenizer needed (benchmarks).
        tokenizer = _load_tokenizer_beside(model_path) if opts.detokenize else None
        model, spec = load_on_device(model_path, opts, device)
        grammars = _make_grammars(spec, opts, tokenizer)
        loaded = time.perf_counter()
        ready = start_runner(model, spec, opts, device, opts.sampler_gates, kernels)
        tokenizer = None if tokenizer is None else tokenizer.result()
    stats = {
        **ready.stats,
        "cuda_context_s": context_s,
        "load_s": loaded - started,  # the weights
        "startup_s": time.perf_counter() - started + context_s,
    }
    return EngineStart(device, spec, ready.runner, ready.num_blocks, grammars, tokenizer, stats, model, ready.kv_caches)


def start_ranks(model_path: str, opts: NativeOptions) -> EngineStart:
    """The job process of a tensor-parallel engine: the ranks (`rank_group.py`) hold the model and run the steps;
    this process runs the scheduler and turns tokens into completions, as a single-device engine."""
    from batchjob.engine.native.executor.rank_group import RankGroup
    from batchjob.engine.native.loading.model_loader import device_dtype, read_model_spec

    started = time.perf_counter()
    device = torch_device(opts.device)
    # the dtype the ranks run
    spec = read_model_spec(model_path, opts.dtype, opts.max_model_len, opts.quantization, opts.kv_cache_dtype)
    spec = device_dtype(spec, opts.dtype, device)
    tokenizer = _load_tokenizer_beside(spec.model_dir) if opts.detokenize else None
    grammars = _make_grammars(spec, opts, tokenizer)
    rank_options = {**dataclasses.asdict(opts), "detokenize": False}
    ranks = RankGroup(spec.model_dir, rank_options, opts.tensor_parallel, device.type == "cuda")
    tokenizer = None if tokenizer is None else tokenizer.result()
    stats = {**ranks.startup_stats, "startup_s": time.perf_counter() - started}
    # this process computes nothing; the ranks have the devices
    return EngineStart(torch.device("cpu"), spec, ranks, ranks.num_blocks, grammars, tokenizer, stats, ranks=ranks)


def _make_grammars(spec: ModelSpec, opts: NativeOptions, tokenizer: Future[Any] | None) -> GrammarCompiler:
    """The constraint compiler. An engine that may see constraints (`graph_constrained`, which a job turns off
    when none of its rows can carry one) builds the grammar library's vocabulary index during start-up."""
    grammars = GrammarCompiler(None, spec.vocab_size, spec.eos_token_ids, spec.model_dir, opts.mask_threads)
    if opts.graph_constrained:
        grammars.prepare_beside(tokenizer)
    return grammars


def _start_device(device: torch.device) -> float:
    """Seconds to create `device`'s CUDA context (0 on CPU): apart from the weights' load, which it used to
    inflate on a cold node."""
    if device.type != "cuda":
        return 0.0
    started = time.perf_counter()
    torch.empty(1, device=device)
    torch.cuda.synchronize(device)
    return time.perf_counter() - started


def _load_tokenizer_beside(model_path: str | Path) -> Future[Any]:
    """The model's tokenizer, loading in a thread: about a second for a 128k vocabulary, spent while the weights
    load and the engine sizes its KV cache, captures graphs and warms up (the output processor is its first user).
    """
    from batchjob.engine.native.loading.model_loader import resolve_model_dir

    model_dir = resolve_model_dir(model_path, with_weights=False)
    pool = ThreadPoolExecutor(1, thread_name_prefix="batchjob-engine-tokenizer")
    try:  # transformers itself is imported there too: seconds of imports beside the start-up
        return pool.submit(load_tokenizer, model_dir)
    finally:
        pool.shutdown(wait=False)  # the thread ends with the load
