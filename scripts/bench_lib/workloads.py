"""The benchmark workloads (docs/benchmarks.md): which architecture, how many requests, which lengths, drawn from
a generator seeded per workload so that every system in every run sees the same requests."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

SEED = 1234
_LAYERS = re.compile(r"(?P<base>.+)-(?P<layers>[1-9][0-9]*)-layers")


class _Architectures(dict):
    """Architecture name -> config fields; a name ending in "-N-layers" (`layers`, the bench's `--layers`) is the
    named architecture with its first N decoder layers: the same layers and step shapes, less memory."""

    def __missing__(self, name: str) -> dict[str, Any]:
        match = _LAYERS.fullmatch(name)
        if match is None or match["base"] not in self:
            raise KeyError(name)
        fields, layers = dict(self[match["base"]]), int(match["layers"])
        if layers > fields["num_hidden_layers"]:
            raise KeyError(f"{name}: {match['base']} has {fields['num_hidden_layers']} layers")
        fields["num_hidden_layers"] = layers
        return fields


# The real configs of the architectures the workloads name (weights are random: they cannot be downloaded).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(
        model_type="llama",
        num_hidden_layers=32,
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3",
        num_hidden_layers=28,
        hidden_size=1024,
        intermediate_size=3072,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        num_hidden_layers=48,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
}
ARCHITECTURES = _Architectures(ARCHITECTURES)
# Llama 3.2 1B and Llama 3.1 70B are the 8B's recipe, narrower and shallower (its embeddings tied) or wider and
# deeper.
ARCHITECTURES["llama-3.2-1b"] = {
    **ARCHITECTURES["llama-3.1-8b"],
    "num_hidden_layers": 16,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "head_dim": 64,
    "tie_word_embeddings": True,
    "rope_parameters": {**ARCHITECTURES["llama-3.1-8b"]["rope_parameters"], "factor": 32.0},
}
ARCHITECTURES["llama-3.1-70b"] = {
    **ARCHITECTURES["llama-3.1-8b"],
    "num_hidden_layers": 80,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
}


# Llama 3.1 70B in FP8 as llm-compressor's FP8_DYNAMIC scheme exports it (compressed-tensors: per-channel weights,
# dynamic per-token activations, the lm_head in bf16), the usual FP8 release of such a model.
_FP8 = {"num_bits": 8, "type": "float", "symmetric": True}
ARCHITECTURES["llama-3.1-70b-fp8"] = {
    **ARCHITECTURES["llama-3.1-70b"],
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**_FP8, "strategy": "channel", "dynamic": False},
                "input_activations": {**_FP8, "strategy": "token", "dynamic": True},
            }
        },
        "ignore": ["lm_head"],
    },
}


@dataclass(frozen=True)
class WorkloadSpec:
    """How a workload's requests are drawn. Lengths are `(low, high)` inclusive ranges; `shared_prefix`
    tokens are the same for every request and come before the `prompt` tokens, which are unique."""

    name: str
    title: str
    architecture: str
    requests: int
    prompt: tuple[int, int]
    new_tokens: tuple[int, int]
    shared_prefix: int = 0
    temperature: float = 0.0  # 0: greedy; else every request samples with its own seed (its index)
    top_p: float = 1.0
    tensor_parallel: int = 1  # GPUs of one engine
    load_format: str = "auto"  # dummy: no weight files, the engine makes random weights (models too big to write)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


WORKLOADS: dict[str, WorkloadSpec] = {
    "W1": WorkloadSpec("W1", "seed", "llama-3.1-8b", 32, (128, 128), (1024, 1024)),
    "W2": WorkloadSpec("W2", "mixed", "llama-3.2-1b", 512, (64, 1024), (64, 512)),
    "W3": WorkloadSpec("W3", "shared prefix", "llama-3.2-1b", 1024, (64, 64), (128, 128), shared_prefix=1024),
    "W4": WorkloadSpec("W4", "nano-vllm bench", "qwen3-0.6b", 256, (100, 1024), (100, 1024)),
    "W5": WorkloadSpec(
        "W5", "synthetic data", "llama-3.1-8b", 1024, (128, 2048), (128, 1024), temperature=0.8, top_p=0.95
    ),
    "W6": WorkloadSpec("W6", "MoE", "qwen3-30b-a3b", 512, (100, 1024), (100, 1024)),
    "W7": WorkloadSpec(
        "W7", "beyond one GPU", "llama-3.1-70b", 256, (128, 1024), (128, 512), tensor_parallel=2, load_format="dummy"
    ),
    "W8": WorkloadSpec(
        "W8", "70B in FP8 on one GPU", "llama-3.1-70b-fp8", 512, (256, 256), (512, 512), load_format="dummy"
    ),
}


def workload(name: str, greedy: bool = False, layers: int | None = None) -> WorkloadSpec:
    """The named workload; `greedy`: the same requests decoded greedily (W5 without its sampling, for the
    sampler's cost: the same prompts, output lengths and floor, since a sampler reads only the logits); `layers`:
    on its architecture's first `layers` decoder layers (a model too large for the GPU, its steps' kernels as the
    whole model's)."""
    spec = TINY_WORKLOAD if name == TINY_WORKLOAD.name else WORKLOADS[name]
    if layers is not None:
        spec = replace(spec, architecture=f"{spec.architecture}-{layers}-layers")
        ARCHITECTURES[spec.architecture]  # a KeyError now where the model has fewer layers
    return replace(spec, temperature=0.0, top_p=1.0) if greedy else spec


# `--tiny`: the CPU smoke run, on the tiny llama of `batchjob.job.tiny_model`.
TINY_WORKLOAD = WorkloadSpec("tiny", "tiny smoke", "tiny-llama", 8, (8, 24), (16, 16))


@dataclass(frozen=True)
class BenchRequests:
    """One workload's drawn requests: request i's prompt token ids and forced output length."""

    spec: WorkloadSpec
    prompts: tuple[tuple[int, ...], ...]
    new_tokens: tuple[int, ...]

    @property
    def prompt_lengths(self) -> np.ndarray:
        return np.array([len(p) for p in self.prompts], dtype=np.int64)

    @property
    def output_lengths(self) -> np.ndarray:
        return np.array(self.new_tokens, dtype=np.int64)

    @property
    def total_output_tokens(self) -> int:
        return int(sum(self.new_tokens))


def draw_requests(spec: WorkloadSpec, vocab_size: int, special_ids: int = 3) -> BenchRequests:
    """Draw the workload's prompt token ids and output lengths. Ids avoid the first `special_ids` ids and the
    last one (pad, bos, unk, eos of the bench tokenizer) so that prompts are ordinary text."""
    rng = np.random.default_rng(SEED)
    n = spec.requests
    prompt_lengths = rng.integers(spec.prompt[0], spec.prompt[1] + 1, size=n)
    new_tokens = rng.integers(spec.new_tokens[0], spec.new_tokens[1] + 1, size=n)
    low, high = special_ids, vocab_size - 1
    prefix = rng.integers(low, high, size=spec.shared_prefix).tolist()
    prompts = tuple(tuple(prefix + rng.integers(low, high, size=int(length)).tolist()) for length in prompt_lengths)
    return BenchRequests(spec=spec, prompts=prompts, new_tokens=tuple(int(x) for x in new_tokens))


# `--constrained`: every constrained request follows this schema, a list of product records as a synthetic-data
# or extraction job would ask for (nested objects, enums, bounded integers, bounded strings and arrays). Its
# minItems cannot be reached within W2's 512 new tokens, so a constrained request runs to its forced length,
# the same work as the unconstrained one (tokens a schema forces count as output without a step of their own).
RECORDS_SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 100,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999999},
                    "title": {"type": "string", "maxLength": 60},
                    "category": {"enum": ["books", "electronics", "garden", "toys", "food"]},
                    "price": {"type": "number", "minimum": 0},
                    "in_stock": {"type": "boolean"},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
                    "seller": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "maxLength": 40},
                            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                        },
                        "required": ["name", "rating"],
                        "additionalProperties": False,
                    },
                },
                "required": ["id", "title", "category", "price", "in_stock", "tags", "seller"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["records"],
    "additionalProperties": False,
}
