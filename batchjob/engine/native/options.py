"""The native engine's options (`engine.*` keys), checked before anything is loaded."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchjob.errors import did_you_mean

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
QUANTIZATIONS = ("auto", "fp8")
KV_CACHE_DTYPE_NAMES = ("auto", "fp8_e4m3")
# `graph_sampling`: which sampler modes get CUDA graphs (true: all, false: greedy); a job whose rows all sample
# alike names its one mode, and steps of a cheaper mode replay its graphs
GRAPH_SAMPLING = ("all", "greedy", "temperature", "filtering")
_TYPES = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}


def _has_type(value: Any, annotation: str) -> bool:
    """`value` fits a field annotated `bool`, `int`, `float`, `str`, or one of those `| None`."""
    base, _, optional = annotation.partition(" | ")
    if value is None:
        return optional == "None"
    if isinstance(value, bool) and base != "bool":
        return False
    return isinstance(value, _TYPES[base])


@dataclass(frozen=True)
class NativeOptions:
    async_loop: bool = True
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"
    quantization: str = "auto"
    kv_cache_dtype: str = "auto"
    tensor_parallel: int = 1
    block_size: int = 16
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    kv_cache_gb: float | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    admission_window: int = 0
    cuda_graphs: bool = True
    graph_sampling: str = "all"
    graph_constrained: bool = True
    constrained_lag: bool = False
    gate_masked_sampler: bool = True
    mask_chunk_rows: int = 0
    mask_threads: int = 0
    jump_forward: bool = False
    graph_mixed: bool = True
    graph_max_batch: int | None = None
    warmup: bool | None = None
    compile_workers: int | None = None
    detokenize: bool = True
    seed: int = 0
    deterministic: bool = False
    debug_poison_slots: bool = False

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> NativeOptions:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            named = ", ".join(f"engine.{key}{did_you_mean(key, known, prefix='engine.')}" for key in unknown)
            raise ValueError(f"unknown native engine option(s) {named}; known options: {', '.join(sorted(known))}")
        options = dict(options)
        if isinstance(options.get("graph_sampling"), bool):
            options["graph_sampling"] = "all" if options["graph_sampling"] else "greedy"
        opts = cls(**options)
        opts.validate()
        return opts

    @property
    def chunked_masks(self) -> bool:
        """Whether a step's bitmasks fill chunk by chunk as the step before settles its rows (step_masks.py)."""
        return self.mask_chunk_rows > 0 and self.async_loop

    @property
    def sampler_gates(self) -> bool:
        """Whether, once warmed up, masked samplers may wait on the GPU behind host gates: when a thread other
        than the loop's fills the masks."""
        return self.gate_masked_sampler and self.async_loop and not self.chunked_masks

    def validate(self) -> None:
        problems = [
            f"engine.{f.name}={getattr(self, f.name)!r}: must be {f.type.replace(' | None', ' or null')}"
            for f in dataclasses.fields(self)
            if not _has_type(getattr(self, f.name), f.type)
        ]
        if problems:
            raise ValueError("invalid native engine options: " + "; ".join(problems))
        if self.dtype not in DTYPES:
            problems.append(f"engine.dtype={self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.load_format not in LOAD_FORMATS:
            problems.append(
                f"engine.load_format={self.load_format!r}: choose auto (the safetensors weights) or dummy "
                "(random weights from config.json alone, for benchmarks)"
            )
        if self.quantization not in QUANTIZATIONS:
            problems.append(
                f"engine.quantization={self.quantization!r}: choose auto (run the checkpoint as it is, FP8 ones in "
                "FP8) or fp8 (quantize a bf16/fp16/fp32 checkpoint's projections to FP8 as it loads)"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            problems.append(
                f"engine.kv_cache_dtype={self.kv_cache_dtype!r}: choose auto (the model's dtype) or fp8_e4m3 (K and V "
                "in FP8: twice the tokens in the same memory)"
            )
        if self.graph_sampling not in GRAPH_SAMPLING:
            problems.append(
                f"engine.graph_sampling={self.graph_sampling!r}: choose one of {', '.join(GRAPH_SAMPLING)} "
                "(true: all, false: greedy)"
            )
        if self.tensor_parallel < 1:
            problems.append(f"engine.tensor_parallel={self.tensor_parallel}: must be >= 1 (GPUs of one engine)")
        if not (self.device in ("auto", "cpu", "cuda") or str(self.device).startswith("cuda:")):
            problems.append(f"engine.device={self.device!r}: use auto, cpu, cuda or cuda:N")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            problems.append(f"engine.block_size={self.block_size}: must be a power of two (16 is usual)")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                problems.append(f"engine.{name}={getattr(self, name)}: must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            problems.append(f"engine.max_model_len={self.max_model_len}: must be >= 2 (or null for the model's)")
        if not 0 < self.gpu_memory_utilization <= 1:
            problems.append(f"engine.gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1]")
        if self.admission_window < 0:
            problems.append(
                f"engine.admission_window={self.admission_window}: must be >= 0 (0 admits requests in input order)"
            )
        if self.mask_chunk_rows < 0:
            problems.append(
                f"engine.mask_chunk_rows={self.mask_chunk_rows}: must be >= 0 (0 fills a step's masks in one call)"
            )
        if self.mask_threads < 0:
            problems.append(
                f"engine.mask_threads={self.mask_threads}: must be >= 0 "
                "(0: 80% of the CPUs the job may use, at most 32)"
            )
        if self.compile_workers is not None and self.compile_workers < 0:
            problems.append(
                f"engine.compile_workers={self.compile_workers}: must be >= 0 (0: the start-up compiles its kernels "
                "itself; null: up to 8 worker processes, from the CPUs the job may use)"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            problems.append(f"engine.num_kv_blocks={self.num_kv_blocks}: must be >= 2 (or null to size it)")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            problems.append(f"engine.kv_cache_gb={self.kv_cache_gb}: must be > 0 (or null)")
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            problems.append(
                "without chunked prefill, engine.max_num_batched_tokens must be >= engine.max_model_len "
                "(a whole prompt must fit one step); raise it or set engine.enable_chunked_prefill=true"
            )
        if problems:
            raise ValueError("invalid native engine options: " + "; ".join(problems))
