"""The decoder every supported family runs, parameterised by its `ModelSpec`: norm placement (before, after or
around each sublayer), q/k norms (per head or over all heads), per-layer rope (or none) and sliding window,
partial rotary, attention scale and soft-capping, SwiGLU or GeGLU, dense or mixture-of-experts MLP.

Inputs are one flat step of T tokens from any mix of sequences (no batch dimension, no padding); attention
goes through a `PagedAttentionBackend`. q/k/v and gate/up are fused into one projection each (the loader
copies checkpoint tensors into slices of them), so a layer runs 4 matmuls instead of 7.

Under tensor parallelism (`sharding.py` says what each rank holds) the model is built from the rank's spec and
adds the collectives: one all-reduce after each attention and each MLP, one for the vocab-parallel embedding,
a gather of the logits, and, for norms over all heads (OLMo 2's q/k norms), an all-reduce of their statistics.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from batchjob.engine.native.layers import batch_invariant, split_k
from batchjob.engine.native.layers.attention import AttentionMetadata, PagedAttentionBackend
from batchjob.engine.native.layers.batch_invariant import InvariantLinear
from batchjob.engine.native.layers.elementwise import RMSNorm, act_and_mul
from batchjob.engine.native.layers.fp8_linear import Fp8Linear, LinearToQuantize, RowQuantizer
from batchjob.engine.native.layers.parallel import SINGLE, TensorParallel, vocab_per_rank
from batchjob.engine.native.layers.rope import RopeStep, RotaryEmbedding
from batchjob.engine.native.models.moe import SparseMoE
from batchjob.engine.native.models.spec import ModelSpec, UnsupportedModelError


def make_norm(spec: ModelSpec, size: int) -> RMSNorm:
    return RMSNorm(size, spec.rms_norm_eps, weight_fp32=spec.norm_weight_fp32, unit_offset=spec.norm_unit_offset)


def make_linear(spec: ModelSpec, modules: list[str], in_features: int, out_features: int, bias: bool) -> nn.Module:
    """The projection that holds the checkpoint modules `modules` (fused ones hold several, by rows): an
    `Fp8Linear` where the model's quantization covers them (all or none must be), else `nn.Linear`."""
    quantized = {spec.quantized(module) for module in modules}
    if len(quantized) > 1:
        raise UnsupportedModelError(
            f"{spec.model_dir}: {', '.join(modules)} are run as one projection, but the quantization config "
            "quantizes only some of them; use engine=hf"
        )
    if not quantized.pop():
        return (InvariantLinear if spec.batch_invariant else nn.Linear)(in_features, out_features, bias=bias)
    q = spec.quantization
    if q.source == "engine":
        return LinearToQuantize(in_features, out_features, bias=bias)
    return Fp8Linear(in_features, out_features, bias, q.activations, q.block, q.activation_scale_ub, spec.dtype)


def sharded_rms_norm(norm: RMSNorm, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """`norm` over the last dimension of x as if the ranks' slices were one vector: the sum of squares is
    all-reduced, and divided by `tp.size` times the local width, which is also right for replicated KV heads
    (a head held by r ranks is counted r times, and r times as many channels are assumed)."""
    h = x.float()
    sum_sq = tp.all_reduce(h.pow(2).sum(-1, keepdim=True))
    h = h * torch.rsqrt(sum_sq / (tp.size * x.shape[-1]) + norm.eps)
    if norm.weight_fp32:
        return (h * (norm.offset + norm.weight.float())).to(x.dtype)
    return norm.weight * h.to(x.dtype)


def add_then_norm(
    x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual); without a norm, the sum twice. `x` may be split-K partial sums, or
    `residual` itself when a projection already added its product into it (split_k.linear)."""
    if residual is None or x is residual:
        return (x if norm is None else norm(x)), x
    if norm is None:
        total = x + residual
        return total, total
    return norm(x, residual)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, attn: PagedAttentionBackend, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        prefix = f"model.layers.{layer}.self_attn"
        qkv = [f"{prefix}.{name}_proj" for name in "qkv"]
        self.qkv_proj = make_linear(spec, qkv, spec.hidden_size, self.q_size + 2 * self.kv_size, spec.qkv_bias)
        self.o_proj = make_linear(spec, [f"{prefix}.o_proj"], self.q_size, spec.hidden_size, spec.o_bias)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm != "none":
            per_head = spec.qk_norm == "head"
            self.q_norm = make_norm(spec, spec.head_dim if per_head else self.q_size)
            self.k_norm = make_norm(spec, spec.head_dim if per_head else self.kv_size)
        self.scale = spec.attn_scale
        self.window = spec.layers[layer].window
        self.softcap = spec.attn_softcap
        self.attn = attn
        self.fused_add = False  # the layer sets it where a fused add + norm follows (split_k.linear)

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeStep | None,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "full" and self.tp.active:
            q, k = sharded_rms_norm(self.q_norm, q, self.tp), sharded_rms_norm(self.k_norm, k, self.tp)
        elif self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        norms = (self.q_norm, self.k_norm) if self.qk_norm == "head" else None
        stored = False
        if rope is not None:
            # A backend that takes stored keys and values lets the rope kernel write them into the cache.
            store = (v, kv_cache[0], kv_cache[1], meta.slot_mapping) if self.attn.kv_from_rope else None
            q, k, stored = rope.apply(q, k, norms, store)
        elif norms is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.attn.forward(
            q, k, v, *kv_cache, meta, self.scale, window=self.window, softcap=self.softcap, kv_stored=stored
        )
        return split_k.linear(out.reshape(num_tokens, self.q_size), self.o_proj, residual if self.fused_add else None)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        prefix, width = f"model.layers.{layer}.mlp", spec.intermediate_size
        gate_up = [f"{prefix}.gate_proj", f"{prefix}.up_proj"]
        self.gate_up_proj = make_linear(spec, gate_up, spec.hidden_size, 2 * width, spec.mlp_bias)
        self.down_proj = make_linear(spec, [f"{prefix}.down_proj"], width, spec.hidden_size, spec.mlp_bias)
        self.activation = spec.activation
        self.fused_add = False  # the layer sets it where a fused add + norm follows (split_k.linear)
        self.fp8_out: RowQuantizer | None = None  # set where down_proj is FP8 (`quantize_at_source`)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        h = act_and_mul(self.gate_up_proj(x), self.activation, self.fp8_out)
        return split_k.linear(h, self.down_proj, residual if self.fused_add else None)


class DecoderLayer(nn.Module):
    """Norm names follow the Gemma layout, which has all four: `input_layernorm` (before attention),
    `post_attention_layernorm` (on its output), `pre_feedforward_layernorm`, `post_feedforward_layernorm`.
    A family has the subset its `norm_placement` says."""

    def __init__(self, spec: ModelSpec, layer: int, attn: PagedAttentionBackend, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        before = spec.norm_placement in ("pre", "sandwich")
        after = spec.norm_placement in ("post", "sandwich")
        self.input_layernorm = make_norm(spec, spec.hidden_size) if before else None
        self.self_attn = Attention(spec, layer, attn, tp)
        self.post_attention_layernorm = make_norm(spec, spec.hidden_size) if after else None
        self.pre_feedforward_layernorm = make_norm(spec, spec.hidden_size) if before else None
        self.mlp = SparseMoE(spec, layer) if spec.layers[layer].sparse else MLP(spec, layer)
        self.post_feedforward_layernorm = make_norm(spec, spec.hidden_size) if after else None
        # The attention's and the MLP's outputs go straight into a fused residual add + norm (this layer's
        # second, the next layer's first or the final one) only with norms before the sublayers and one rank:
        # there they may be split-K partial sums, which that norm adds up, or the residual with the product
        # already added by the matmul (split_k.py).
        fused_add = spec.norm_placement == "pre" and not tp.active
        self.self_attn.fused_add = fused_add and not spec.o_bias
        if isinstance(self.mlp, MLP):
            self.mlp.fused_add = fused_add and not spec.mlp_bias

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeStep | None,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`x + residual` is this layer's input (residual None: x alone); returns the pair for the next layer,
        so each residual add is fused into the norm that follows it where there is one."""
        h, residual = add_then_norm(x, residual, self.input_layernorm)
        h = self.tp.all_reduce(self.self_attn(h, rope, meta, kv_cache, residual))
        if self.post_attention_layernorm is not None:
            h = self.post_attention_layernorm(h)
        h, residual = add_then_norm(h, residual, self.pre_feedforward_layernorm)
        h = self.tp.all_reduce(self.mlp(h, residual) if isinstance(self.mlp, MLP) else self.mlp(h))
        if self.post_feedforward_layernorm is not None:
            h = self.post_feedforward_layernorm(h)
        return h, residual


def quantize_at_source(model: CausalLM) -> None:
    """Where a dense layer's projection is an `Fp8Linear` quantizing its input per token, the kernel before it
    writes its output quantized instead (`RowQuantizer`): the RMSNorm before q/k/v and before gate/up, the
    activation before down. Each saves a quantizing kernel; o_proj still quantizes the attention's output."""
    for layer in model.layers:
        if layer.input_layernorm is not None:
            layer.input_layernorm.fp8_out = RowQuantizer.feeding(layer.self_attn.qkv_proj)
        if isinstance(layer.mlp, MLP):
            if layer.pre_feedforward_layernorm is not None:
                layer.pre_feedforward_layernorm.fp8_out = RowQuantizer.feeding(layer.mlp.gate_up_proj)
            layer.mlp.fp8_out = RowQuantizer.feeding(layer.mlp.down_proj)


class CausalLM(nn.Module):
    """Parameter names mirror the Hugging Face checkpoint minus its `model.` prefix, except the fused
    `qkv_proj` and `gate_up_proj`, the stacked experts and the Gemma-layout norm names (see `DecoderLayer`);
    the loader maps checkpoint names onto them. Under tensor parallelism `spec` is the rank's (`rank_spec`)."""

    def __init__(self, spec: ModelSpec, attn: PagedAttentionBackend, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.spec = spec
        self.tp = tp
        # Vocabulary rows this rank holds (all of them without tensor parallelism).
        self.vocab_rows = vocab_per_rank(spec.vocab_size, tp.size)
        self.embed_tokens = nn.Embedding(self.vocab_rows, spec.hidden_size)
        # transformers multiplies by the scale rounded to the model dtype.
        self.embed_scale = torch.tensor(spec.embed_scale, dtype=spec.dtype, device="cpu").item()
        # One table per distinct rope (Gemma 3: local and global bases). One position of margin: the overlapped
        # engine loop may run one step past a sequence's last allowed token (the result is discarded), and an
        # out-of-range position would be a device-side assert on CUDA.
        ropes = list(dict.fromkeys(layer.rope for layer in spec.layers if layer.rope is not None))
        self.rotaries = nn.ModuleList(RotaryEmbedding(r, spec.rotary_dim, spec.max_model_len + 1) for r in ropes)
        self.rope_index = [None if layer.rope is None else ropes.index(layer.rope) for layer in spec.layers]
        self.layers = nn.ModuleList(DecoderLayer(spec, i, attn, tp) for i in range(spec.num_layers))
        self._run = range(spec.num_layers)  # the layers a forward runs (`kernel_layers` narrows it)
        self.norm = make_norm(spec, spec.hidden_size)
        # Tied embeddings read `embed_tokens.weight` directly instead of sharing a Parameter: sharing does not
        # survive materialising a meta-device module (`loader._materialise` gives each owner its own tensor).
        self.lm_head = None if spec.tie_word_embeddings else nn.Linear(spec.hidden_size, self.vocab_rows, bias=False)

    @contextmanager
    def kernel_layers(self) -> Iterator[None]:
        """Inside, a forward runs only one layer of each kind that launches its own kernel variants: the first
        (it has no residual to add yet) and the first of each other `LayerSpec` (rope, window, dense or sparse
        MLP). The warm-up and the runs before graph capture exist to compile and load every kernel variant a step
        can meet; the other layers would launch the same ones (2 of Llama-3.2-1B's 16 layers, 3 of Gemma 3's)."""
        first_of_kind = {}
        for index, layer in enumerate(self.spec.layers[1:], start=1):
            first_of_kind.setdefault(layer, index)
        self._run = [0, *sorted(first_of_kind.values())]
        try:
            yield
        finally:
            self._run = range(self.spec.num_layers)

    def reset_tables(self) -> None:
        """Fill the rope tables, after the module was materialised from the meta device."""
        for rotary in self.rotaries:
            rotary.reset_table()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for input_ids, positions int64 [T]; stores the step's K/V."""
        ropes = [rotary.prepare(positions) for rotary in self.rotaries]
        x, residual = self._embed(input_ids), None
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self.layers)} layers")
        for i in self._run:
            index = self.rope_index[i]
            x, residual = self.layers[i](x, residual, None if index is None else ropes[index], meta, kv_caches[i])
        return add_then_norm(x, residual, self.norm)[0]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.active:
            return self.embed_tokens(input_ids)
        # Each rank looks up the ids in its rows and contributes zeros for the others.
        local = input_ids - self.tp.rank * self.vocab_rows
        outside = (local < 0) | (local >= self.vocab_rows)
        x = self.embed_tokens(local.masked_fill(outside, 0)).masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)

    def compute_logits(
        self, hidden: torch.Tensor, out: torch.Tensor | None = None, float32: bool = True
    ) -> torch.Tensor:
        """float32 logits [N, vocab] for hidden states [N, hidden] (usually each sequence's last token); every
        rank gets all of them. `out`: a float32 [N, vocab] tensor to write them into (the conversion to float32
        is then that write, with no float32 copy of its own), or one of the model's dtype, which the matmul
        writes (logits without a soft cap). `float32=False`: for an argmax only, the logits may stay in the
        model's dtype (soft-capped ones are still converted: the cap could tie two of them)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        invariant = self.spec.batch_invariant
        if out is not None and out.dtype == weight.dtype and not self.tp.active and self.spec.final_softcap <= 0:
            if invariant:
                return out.copy_(batch_invariant.matmul(hidden, weight))
            return torch.mm(hidden, weight.t(), out=out)
        logits = batch_invariant.matmul(hidden, weight) if invariant else F.linear(hidden, weight)
        if self.tp.active:
            logits = self.tp.all_gather_last(logits)[:, : self.spec.vocab_size]
        cap = self.spec.final_softcap
        if not float32 and out is None and cap <= 0:
            return logits
        logits = logits.float() if out is None else out.copy_(logits)
        if cap > 0:
            logits = cap * torch.tanh(logits / cap) if out is None else logits.div_(cap).tanh_().mul_(cap)
        return logits
