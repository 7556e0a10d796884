"""The systems under test (docs/benchmarks.md), each run the same way: start it up (timed apart), feed it the
workload's requests, time the generation, stop at `time_limit_s` with the work done so far, and free the GPU.
`native_json` and `native_json_mixed` are `native` with every request, or every other one, under
`workloads.RECORDS_SCHEMA`; `vllm`, `vllm_json` and `vllm_json_mixed` the same requests on vLLM, `vllm_tuned` on
vLLM configured for throughput as its guide says."""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_lib.workloads import RECORDS_SCHEMA, BenchRequests

# system -> (engine, every how many requests one is constrained; 0: none)
NATIVE_ENGINES = {
    "native": ("native", 0),
    "native_sync": ("native_sync", 0),
    "native_json": ("native", 1),
    "native_json_mixed": ("native", 2),
}
NATIVE_SYSTEMS = tuple(NATIVE_ENGINES)
# system -> every how many requests one is constrained (0: none)
VLLM_SYSTEMS = {"vllm": 0, "vllm_tuned": 0, "vllm_json": 1, "vllm_json_mixed": 2}
# `vllm_tuned`: vLLM's optimization guide (docs/configuration/optimization.md) for throughput: a larger chunked-prefill
# budget ("max_num_batched_tokens > 8192", its offline default on large GPUs being 16384) and more of the GPU's
# memory for the KV cache (less preemption); its other defaults (1,024 sequences, CUDA graphs, torch.compile) stay.
VLLM_TUNED = {"max_num_batched_tokens": 32768, "gpu_memory_utilization": 0.95}
CONSTRAINED_SYSTEMS = ("native", "native_json", "native_json_mixed", "vllm", "vllm_json", "vllm_json_mixed")
HF_SYSTEMS = ("hf_generate", "hf_batch_sync", "hf_batch_async")
SYSTEMS = NATIVE_SYSTEMS + tuple(VLLM_SYSTEMS) + HF_SYSTEMS
# Native engine options the vllm backend has too (`--engine-option`, a workload's settings)
VLLM_OPTIONS = ("load_format", "tensor_parallel", "max_model_len", "quantization", "kv_cache_dtype")


@dataclass(frozen=True)
class SystemResult:
    """One system on one workload. `output_tokens` counts only requested tokens; `cut` says the time limit
    stopped it before every request finished (its tok/s is then a partial throughput)."""

    system: str
    wall_s: float
    output_tokens: int
    requests_done: int
    requests_total: int
    startup_s: float
    cut: bool = False
    gpu_busy_fraction: float | None = None
    prep_ms_per_step: float | None = None
    steps: int | None = None
    busy_timeline: tuple[tuple[float, float], ...] | None = field(default=None, repr=False)
    engine_stats: dict[str, float] = field(default_factory=dict)  # whatever else the engine's stats() said
    note: str = ""
    run: str = "warm"  # "cold": a fresh process with empty caches; "warm": a fresh process, caches filled
    kernel_cache: str | None = None  # the Triton cache directory the run used
    startup_cache: str | None = None  # the `$BATCHJOB_CACHE` it used (model specs, tokenizer classes, ...)
    engine_source: str | None = None  # the checkout whose `batchjob` the run imported
    repeat: int = 0  # which of the command's `--repeat` rounds (0: the first)

    @property
    def label(self) -> str:
        return run_label(self.run, self.repeat)

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def host_ms_per_step(self) -> float | None:
        """The native loop thread's own work a step (admitting, scheduling, processing less its wait for tokens,
        laying out and launching), or None: the GPU waits for the host when it nears the GPU's time a step."""
        stats = self.engine_stats
        parts = ("admit_ms_per_step", "schedule_ms_per_step", "process_ms_per_step", "prep_ms_per_step")
        if not all(part in stats for part in (*parts, "collect_wait_ms_per_step")):
            return None
        return sum(stats[part] for part in parts) - stats["collect_wait_ms_per_step"]


def run_label(run: str, repeat: int) -> str:
    """A run as the report names it: "cold", "warm", or with a later `--repeat` round's number ("cold 2")."""
    return run if repeat == 0 else f"{run} {repeat + 1}"


@dataclass(frozen=True)
class RunSettings:
    """What every system of one run shares."""

    device: str  # "cuda" or "cpu"
    dtype: str  # "bfloat16" on the GPU
    time_limit_s: float
    hf_batch: int
    hf_max_batch_tokens: int = 8192
    hf_attn_implementation: str | None = None
    engine_options: Mapping[str, Any] = field(default_factory=dict)
    kernel_profile: str | None = None  # where the run's kernel table goes (`--kernel-profile`), or None


def free_device_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_engine(name: str, model_dir: Path, requests: BenchRequests, settings: RunSettings) -> SystemResult:
    """batchjob's engine, or vLLM (its defaults, prefix caching off as in native runs) through the vllm backend.
    Start-up is `create_engine`; the time limit is checked between completions."""
    import json

    from batchjob.engine import Request, SamplingParams, create_engine

    engine_name, every = NATIVE_ENGINES.get(name) or ("vllm", VLLM_SYSTEMS[name])
    spec = requests.spec
    options = {"dtype": settings.dtype, "detokenize": False, **settings.engine_options}
    if engine_name == "vllm":
        options = {key: options[key] for key in ("dtype", "detokenize", *VLLM_OPTIONS) if key in options}
        options["enable_prefix_caching"] = False
        if name == "vllm_tuned":
            options.update(VLLM_TUNED)
    elif not every:
        # What a job without constraints does (batchjob/config/settings.py): no graphs for split steps it never runs,
        # and graphs of the one sampler mode its rows need.
        options.setdefault("graph_constrained", False)
        mode = "filtering" if spec.top_p < 1 else "temperature"
        options.setdefault("graph_sampling", mode if spec.temperature else "greedy")
    started = time.perf_counter()
    engine = create_engine(engine_name, str(model_dir), options)
    startup_s = time.perf_counter() - started
    schema = json.dumps(RECORDS_SCHEMA)

    def sampling(i: int, n: int) -> SamplingParams:
        if every and i % every == 0:
            return SamplingParams(max_new_tokens=n, json_schema=schema)
        return SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=spec.temperature, top_p=spec.top_p, seed=i)

    feed = (
        Request(id=i, prompt_ids=list(prompt), sampling=sampling(i, n))
        for i, (prompt, n) in enumerate(zip(requests.prompts, requests.new_tokens, strict=True))
    )
    tokens = done = 0
    cut = False
    start = time.perf_counter()
    try:
        with kernel_profile(settings.kernel_profile):
            for completion in engine.generate(feed):
                tokens += completion.completion_tokens
                done += 1
                if time.perf_counter() - start > settings.time_limit_s and done < len(requests.prompts):
                    cut = True
                    break
        wall_s = time.perf_counter() - start
        stats = dict(engine.stats())
        timeline = engine.busy_timeline() if hasattr(engine, "busy_timeline") else None
    finally:
        engine.close()
    del engine
    return SystemResult(
        system=name,
        wall_s=wall_s,
        output_tokens=tokens,
        requests_done=done,
        requests_total=len(requests.prompts),
        startup_s=startup_s,
        cut=cut,
        gpu_busy_fraction=_maybe_float(stats.get("gpu_busy_fraction")),
        prep_ms_per_step=_maybe_float(stats.get("prep_ms_per_step")),
        steps=int(stats["steps"]) if "steps" in stats else None,
        busy_timeline=tuple((float(a), float(b)) for a, b in timeline) if timeline else None,
        engine_stats={k: v for k, v in stats.items() if isinstance(v, int | float)},
    )


@contextlib.contextmanager
def kernel_profile(path: str | None) -> Iterator[None]:
    """With `path`: the generation under torch's profiler, its kernels by total device time (CPU ops on a CPU)
    written to `path` as a table. It slows the host: that run's tok/s is not comparable."""
    if path is None:
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        yield
        if on_gpu:
            torch.cuda.synchronize()
    sort_by = "cuda_time_total" if on_gpu else "cpu_time_total"
    Path(path).write_text(prof.key_averages().table(sort_by=sort_by, row_limit=40, max_name_column_width=90))


def _maybe_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _load_hf_model(model_dir: Path, settings: RunSettings):
    import torch
    from transformers import AutoModelForCausalLM

    extra = {"attn_implementation": settings.hf_attn_implementation} if settings.hf_attn_implementation else {}
    dtype = getattr(torch, settings.dtype)
    if settings.engine_options.get("load_format") == "dummy":
        # No weight files (a config-only model directory): transformers' own random initialisation, made on the
        # device. Which random weights does not change the work: EOS is ignored and every output length forced.
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir)
        with torch.device(settings.device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **extra)
    else:
        # Loaded on the CPU then moved: `device_map` would need `accelerate`, which the project does not require.
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **extra)
        model.to(settings.device)
    # EOS is ignored so that every system does the same work; generate() would otherwise stop at it.
    model.generation_config.eos_token_id = None
    return model.eval()


def run_hf_generate(model_dir: Path, requests: BenchRequests, settings: RunSettings) -> SystemResult:
    """Static batches: each chunk of `hf_batch` requests is left-padded to its longest prompt and runs for its
    longest output, so on mixed lengths it computes more than it is credited for (only requested tokens count)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Deadline(StoppingCriteria):
        def __init__(self, deadline: float) -> None:
            self.deadline = deadline

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            stop = time.perf_counter() > self.deadline
            return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

    started = time.perf_counter()
    model = _load_hf_model(model_dir, settings)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    warmup_ids = torch.tensor([list(requests.prompts[0][:8])], device=settings.device)
    model.generate(warmup_ids, max_new_tokens=4, do_sample=False, pad_token_id=pad)
    _synchronize(settings.device)
    startup_s = time.perf_counter() - started

    tokens = done = 0
    start = time.perf_counter()
    deadline = start + settings.time_limit_s
    for first in range(0, len(requests.prompts), settings.hf_batch):
        if time.perf_counter() > deadline:
            break
        prompts = requests.prompts[first : first + settings.hf_batch]
        wanted = requests.new_tokens[first : first + settings.hf_batch]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=settings.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=settings.device)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max(wanted),
            pad_token_id=pad,
            **_hf_sampling(requests),
            stopping_criteria=StoppingCriteriaList([Deadline(deadline)]),
        )
        generated = out.shape[1] - width
        tokens += sum(min(n, generated) for n in wanted)
        done += sum(n <= generated for n in wanted)
    _synchronize(settings.device)
    wall_s = time.perf_counter() - start
    del model
    note = f"static batches of {settings.hf_batch}"
    if len(set(requests.new_tokens)) > 1 or len(set(requests.prompt_lengths.tolist())) > 1:
        note += ", padded to the longest prompt and output of each batch; only requested tokens counted"
    total = len(requests.prompts)
    return SystemResult("hf_generate", wall_s, tokens, done, total, startup_s, done < total, note=note)


def _hf_sampling(requests: BenchRequests) -> dict[str, Any]:
    """transformers' generation settings for the workload: greedy, or sampling with its temperature and top-p
    (transformers draws from one global generator, not per-request seeds: the work is the same)."""
    spec = requests.spec
    if spec.greedy:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": spec.temperature, "top_p": spec.top_p, "top_k": 0}


def _synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def kv_blocks_for(requests: BenchRequests, block_size: int) -> int:
    """Blocks to hold every request at once (prompt + output, plus one block of slack each), so that the peer
    never preempts for lack of cache: its throughput is then not limited by a default sizing."""
    lengths = requests.prompt_lengths + requests.output_lengths
    return int(sum(math.ceil(n / block_size) + 1 for n in lengths.tolist()))


def run_hf_continuous(model_dir: Path, requests: BenchRequests, settings: RunSettings, use_async: bool) -> SystemResult:
    """transformers continuous batching (the manager behind `generate_batch`), with per-request max_new_tokens."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    name = "hf_batch_async" if use_async else "hf_batch_sync"
    started = time.perf_counter()
    model = _load_hf_model(model_dir, settings)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    block_size = 256 if settings.device == "cuda" else 32
    cb_config = ContinuousBatchingConfig(
        block_size=block_size,
        num_blocks=kv_blocks_for(requests, block_size),
        max_batch_tokens=settings.hf_max_batch_tokens,
        use_async_batching=use_async,
    )
    hints = WorkloadHints(
        max_prompt_length=int(requests.prompt_lengths.max()),
        max_generated_length=int(requests.output_lengths.max()),
        num_requests=len(requests.prompts),
    )
    generation_config = GenerationConfig(
        max_new_tokens=int(requests.output_lengths.max()), eos_token_id=-1, pad_token_id=pad, **_hf_sampling(requests)
    )
    manager = model.init_continuous_batching(
        generation_config=generation_config, continuous_batching_config=cb_config, workload_hints=hints
    )
    manager.warmup()
    _synchronize(settings.device)
    startup_s = time.perf_counter() - started

    for i, (prompt, n) in enumerate(zip(requests.prompts, requests.new_tokens, strict=True)):
        # eos -1: no end-of-sequence token, every request runs to its max_new_tokens
        manager.add_request(list(prompt), request_id=str(i), max_new_tokens=n, eos_token_id=-1)
    tokens = done = 0
    start = time.perf_counter()
    deadline = start + settings.time_limit_s
    manager.start()
    try:
        while done < len(requests.prompts) and time.perf_counter() < deadline:
            result = manager.get_result(timeout=0.5)
            if result is not None and result.is_finished():
                tokens += len(result.generated_tokens)
                done += result.error is None
            elif result is None and not manager.is_running():
                raise RuntimeError(f"{name}: the continuous batching thread stopped after {done} requests")
        wall_s = time.perf_counter() - start
        cut = done < len(requests.prompts)
    finally:
        manager.stop(block=True, timeout=120, hard_stop=True)
    # A hard stop fails the requests still running; their partial outputs are work done within the limit.
    while (result := manager.get_result(timeout=0)) is not None:
        tokens += len(result.generated_tokens)
    manager.destroy()
    del manager, model
    note = f"{cb_config.num_blocks} KV blocks of {block_size} (every request fits at once)"
    return SystemResult(name, wall_s, tokens, done, len(requests.prompts), startup_s, cut, note=note)


def run_system(name: str, model_dir: Path, requests: BenchRequests, settings: RunSettings) -> SystemResult:
    """Run one system and free the device afterwards, whatever happened."""
    try:
        if name in NATIVE_SYSTEMS or name in VLLM_SYSTEMS:
            return run_engine(name, model_dir, requests, settings)
        if name == "hf_generate":
            return run_hf_generate(model_dir, requests, settings)
        if name in ("hf_batch_sync", "hf_batch_async"):
            return run_hf_continuous(model_dir, requests, settings, use_async=name == "hf_batch_async")
        raise ValueError(f"unknown system {name!r}: choose from {', '.join(SYSTEMS)} (--systems)")
    finally:
        free_device_memory()
