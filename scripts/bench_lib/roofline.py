"""The physical floor of a workload's time on the measured hardware (the method: docs/benchmarks.md): a decode
step reads the weights it uses (a mixture: the experts its tokens hit) and the running sequences' KV cache at the
copy rate, unless its FLOPs take longer; steps are simulated from the request lengths within the KV budget;
prefill is its FLOPs, a shared prefix counted once. The shape is the native engine's `ModelSpec`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from bench_lib.workloads import BenchRequests

BF16_BYTES = 2


def expected_experts_hit(tokens: int, experts: int, experts_per_token: int) -> float:
    """Expected distinct experts hit by `tokens` tokens, each picking `experts_per_token` of them at random."""
    if experts == 0 or tokens == 0:
        return 0.0
    return experts * (1.0 - (1.0 - experts_per_token / experts) ** tokens)


@dataclass(frozen=True)
class ModelShape:
    """What the floor needs to know about an architecture."""

    parameters: int  # unique parameters: a tied lm_head is counted once
    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    embedding_parameters: int  # the input embedding table (looked up, not multiplied)
    tied_embeddings: bool  # the lm_head is the embedding table
    moe_layers: int = 0  # layers whose MLP is a mixture of experts
    experts: int = 0  # per MoE layer
    experts_per_token: int = 0
    expert_parameters: int = 0  # of one expert in one layer
    fp8_parameters: int = 0  # weights of FP8 projections, multiplied at the FP8 rate
    held_bytes: int | None = None  # the weights' bytes on the GPU when some are FP8 (None: all bf16)
    kv_element_bytes: int = BF16_BYTES  # 1 with an FP8 KV cache

    @property
    def weight_bytes(self) -> int:
        """Every weight, as the GPU holds them: bf16, FP8 projections a byte a weight (and their scales)."""
        return self.parameters * BF16_BYTES if self.held_bytes is None else self.held_bytes

    @property
    def expert_bytes(self) -> int:
        return self.moe_layers * self.experts * self.expert_parameters * BF16_BYTES

    def matmul_seconds(
        self, linear_tokens: float, head_tokens: float, pairs: float, bf16_rate: float, fp8_rate: float | None = None
    ) -> float:
        """Seconds of the matmuls of `linear_tokens` tokens through every layer, `head_tokens` through the lm_head
        and `pairs` (query, key) pairs of attention, FP8 projections at the FP8 rate."""
        head = self.vocab * self.hidden
        layers = self.matmul_parameters_per_token - head - self.fp8_parameters
        bf16 = 2.0 * layers * linear_tokens + 2.0 * head * head_tokens + self.attention_flops(pairs)
        return bf16 / bf16_rate + 2.0 * self.fp8_parameters * linear_tokens / (fp8_rate or bf16_rate)

    def step_weight_bytes(self, tokens: int) -> float:
        """Weight bytes a step of `tokens` tokens reads: all but the experts, and the experts it hits."""
        hit = expected_experts_hit(tokens, self.experts, self.experts_per_token)
        return self.weight_bytes - self.expert_bytes + self.moe_layers * hit * self.expert_parameters * BF16_BYTES

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.kv_element_bytes

    @property
    def matmul_parameters_per_token(self) -> int:
        """Parameters a token is multiplied with: every layer (its own experts only) and the lm_head."""
        unused_experts = self.moe_layers * (self.experts - self.experts_per_token) * self.expert_parameters
        return self.parameters - (0 if self.tied_embeddings else self.embedding_parameters) - unused_experts

    def attention_flops(self, query_context_pairs: float) -> float:
        """FLOPs of QK^T and PV (2 each per multiply-add) for that many (query, key) pairs in every layer."""
        return 4.0 * self.layers * self.attention_heads * self.head_dim * query_context_pairs


def model_shape(architecture: dict[str, Any], quantization: str = "auto", kv_cache_dtype: str = "auto") -> ModelShape:
    """The shape of an architecture of `bench_lib.workloads.ARCHITECTURES` as the native engine builds it (on the
    meta device) with those engine options: fp8 quantizes its projections, fp8_e4m3 caches a byte a value."""
    import torch
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from batchjob.engine.native.layers.attention import TorchPagedAttention
    from batchjob.engine.native.layers.fp8_linear import Fp8Linear
    from batchjob.engine.native.loading.model_loader import quantize_loaded
    from batchjob.engine.native.models.decoder import CausalLM
    from batchjob.engine.native.models.registry import ARCHITECTURES, spec_from_config

    fields = dict(architecture)
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    described = ARCHITECTURES[MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    spec = spec_from_config(config, described, f"<{model_type}>", {}, "bfloat16", None, quantization, kv_cache_dtype)
    with torch.device("meta"):
        model = CausalLM(spec, TorchPagedAttention())
        quantize_loaded(model)
    moe = spec.moe
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    scales = sum(p.numel() for m in fp8 for p in (m.weight_scale, m.input_scale) if p is not None)
    return ModelShape(
        parameters=sum(p.numel() for p in model.parameters()) - scales,
        held_bytes=sum(p.numel() * p.element_size() for p in model.parameters()) if fp8 else None,
        fp8_parameters=sum(m.weight.numel() for m in fp8),
        kv_element_bytes=spec.kv_bytes_per_token // (2 * spec.num_layers * spec.num_kv_heads * spec.head_dim),
        layers=spec.num_layers,
        attention_heads=spec.num_heads,
        kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        hidden=spec.hidden_size,
        vocab=spec.vocab_size,
        embedding_parameters=model.embed_tokens.weight.numel(),
        tied_embeddings=spec.tie_word_embeddings,
        moe_layers=sum(layer.sparse for layer in spec.layers),
        experts=moe.num_experts if moe else 0,
        experts_per_token=moe.top_k if moe else 0,
        expert_parameters=3 * spec.hidden_size * moe.intermediate_size if moe else 0,
    )


@dataclass(frozen=True)
class RooflineFloor:
    decode_s: float
    prefill_s: float
    decode_steps: int
    peak_concurrency: int
    output_tokens: int

    @property
    def total_s(self) -> float:
        return self.decode_s + self.prefill_s

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.total_s


def decode_floor(
    shape: ModelShape,
    prompt_lengths: np.ndarray,
    output_lengths: np.ndarray,
    kv_budget_tokens: int,
    copy_bytes_per_s: float,
    matmul_flops_per_s: float,
    fp8_matmul_flops_per_s: float | None = None,
    serial: bool = False,
) -> tuple[float, int, int]:
    """Seconds, steps and peak concurrency of the decode phase. The first output token of each request comes
    from its prefill, so a request of L output tokens takes L - 1 decode steps; at decode step j its
    attention reads `prompt + j` tokens of KV. A step takes the longer of its reads and its FLOPs; with `serial`,
    its attention's KV read and then the longer of its weights' read and its matmuls' FLOPs, as kernels that run
    one after another do."""
    remaining = output_lengths.astype(np.int64) - 1
    footprint = prompt_lengths + output_lengths
    if (footprint > kv_budget_tokens).any():
        raise ValueError(f"a request needs {footprint.max()} KV tokens, more than the budget {kv_budget_tokens}")
    context = prompt_lengths.astype(np.int64).copy()
    running = np.zeros(len(remaining), dtype=bool)
    done = remaining <= 0
    next_waiting, seconds, steps, peak = 0, 0.0, 0, 0
    while not done.all():
        used = int(footprint[running].sum())
        while next_waiting < len(remaining) and (
            done[next_waiting] or used + footprint[next_waiting] <= kv_budget_tokens
        ):
            if not done[next_waiting]:
                running[next_waiting] = True
                used += int(footprint[next_waiting])
            next_waiting += 1
        context[running] += 1
        batch = int(running.sum())
        kv_tokens = int(context[running].sum())
        kv_s = kv_tokens * shape.kv_bytes_per_token / copy_bytes_per_s
        weights_s = shape.step_weight_bytes(batch) / copy_bytes_per_s
        if serial:
            matmul_s = shape.matmul_seconds(batch, batch, 0, matmul_flops_per_s, fp8_matmul_flops_per_s)
            seconds += kv_s + max(weights_s, matmul_s)
        else:
            compute_s = shape.matmul_seconds(batch, batch, kv_tokens, matmul_flops_per_s, fp8_matmul_flops_per_s)
            seconds += max(kv_s + weights_s, compute_s)
        steps += 1
        peak = max(peak, batch)
        remaining[running] -= 1
        finished = running & (remaining <= 0)
        done |= finished
        running &= ~finished
    return seconds, steps, peak


def prefill_floor(
    shape: ModelShape,
    prompt_lengths: np.ndarray,
    shared_prefix: int,
    matmul_flops_per_s: float,
    fp8_matmul_flops_per_s: float | None = None,
) -> float:
    """Seconds of prefill compute: 2 FLOPs per parameter per prompt token through every layer, the lm_head
    for each request's last prompt token only, plus causal attention. A shared prefix is computed once."""
    unique = prompt_lengths.astype(np.float64) - shared_prefix
    tokens = shared_prefix + unique.sum()
    pairs = shared_prefix * (shared_prefix + 1) / 2 + (unique * shared_prefix + unique * (unique + 1) / 2).sum()
    return shape.matmul_seconds(tokens, len(prompt_lengths), pairs, matmul_flops_per_s, fp8_matmul_flops_per_s)


def roofline(
    shape: ModelShape,
    requests: BenchRequests,
    copy_bytes_per_s: float,
    matmul_flops_per_s: float,
    kv_budget_bytes: int,
    fp8_matmul_flops_per_s: float | None = None,
    serial: bool = False,
) -> RooflineFloor:
    """The workload's floor; `serial`: its decode steps' as `decode_floor`'s kernels one after another."""
    prompts, outputs = requests.prompt_lengths, requests.output_lengths
    kv_tokens = kv_budget_bytes // shape.kv_bytes_per_token
    rates = (matmul_flops_per_s, fp8_matmul_flops_per_s)
    decode_s, steps, peak = decode_floor(shape, prompts, outputs, kv_tokens, copy_bytes_per_s, *rates, serial)
    prefill_s = prefill_floor(shape, prompts, requests.spec.shared_prefix, *rates)
    return RooflineFloor(decode_s, prefill_s, steps, peak, requests.total_output_tokens)
