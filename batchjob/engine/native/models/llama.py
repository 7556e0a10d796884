"""The Llama family (Llama, Mistral, Qwen2, Qwen3) as one module parameterised by `ModelSpec` flags:
biases on q/k/v (Qwen2), RMSNorm on q and k per head (Qwen3), head_dim from the config, tied embeddings.

Inputs are one flat step of T tokens from any mix of sequences (no batch dimension, no padding); attention
goes through a `PagedAttentionBackend`. q/k/v and gate/up are fused into one projection each (the loader
copies checkpoint tensors into slices of them), so a layer runs 4 matmuls instead of 7.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchjob.engine.native.attention import AttentionMetadata, PagedAttentionBackend
from batchjob.engine.native.layers import RMSNorm, RopeStep, RotaryEmbedding, silu_and_mul
from batchjob.engine.native.models.spec import ModelSpec


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, attn: PagedAttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.scale = spec.head_dim**-0.5
        self.attn = attn

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeStep,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q, k)
        out = self.attn.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, attn: PagedAttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, attn)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeStep,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`x + residual` is this layer's input (residual None: x alone); returns the pair for the next layer,
        so each residual add is fused into the norm that follows it."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, meta, kv_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """Parameter names mirror the Hugging Face checkpoint minus its `model.` prefix, except the fused
    `qkv_proj` and `gate_up_proj`."""

    def __init__(self, spec: ModelSpec, attn: PagedAttentionBackend) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        # One position of margin: the overlapped engine loop may run one step past a sequence's last allowed
        # token (the result is discarded), and an out-of-range position would be a device-side assert on CUDA.
        self.rotary = RotaryEmbedding(spec.rope, spec.head_dim, spec.max_model_len + 1)
        self.layers = nn.ModuleList(DecoderLayer(spec, attn) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        # Tied embeddings read `embed_tokens.weight` directly instead of sharing a Parameter: sharing does not
        # survive materialising a meta-device module (`to_empty` gives each owner its own tensor).
        self.lm_head = None if spec.tie_word_embeddings else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for input_ids, positions int64 [T]; stores the step's K/V."""
        rope = self.rotary.prepare(positions)
        x, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, meta, kv_cache)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for hidden states [N, hidden] (usually each sequence's last token)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
