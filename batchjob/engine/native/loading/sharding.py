"""How a model is split over the ranks of a tensor-parallel engine (Megatron-style), and which part of each
full weight a rank holds.

- Attention: each rank runs `heads / N` query heads and the KV heads they read (`kv_heads / N`, or, when
  there are fewer KV heads than ranks, the one KV head its query heads share: KV heads are then replicated).
  The fused q/k/v projection is split by output rows (column-parallel), o_proj by input columns
  (row-parallel), whose partial outputs one all-reduce sums.
- MLP: gate/up split by output rows, down by input columns, one all-reduce; the experts of a mixture the
  same way along their intermediate dimension (every rank holds every expert, a slice of each). The router
  and every norm are replicated.
- Embedding and lm_head: split by vocabulary rows (vocab-parallel), the vocabulary padded to a multiple of N;
  a token's embedding comes from the rank holding its row (one all-reduce), the logits are gathered.

A `ParamShard` says which slices of the full parameter (its checkpoint layout: fused q/k/v rows, then the
gate rows, then the up rows) land where in the rank's parameter; the loader copies checkpoint tensors, or the
dummy weights, through it. The rank's `ModelSpec` (`rank_spec`) has its own head counts and widths, so the
model, the KV cache and its sizing are built for the shard.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from batchjob.engine.native.layers.parallel import TensorParallel, vocab_per_rank
from batchjob.engine.native.models.spec import ModelSpec


@dataclass(frozen=True)
class Segment:
    local: int  # first index in the rank's parameter along the shard dimension
    full: int  # first index in the full parameter
    length: int


@dataclass(frozen=True)
class ParamShard:
    dim: int
    full_size: int  # of the full parameter along `dim`
    segments: tuple[Segment, ...]
    first_rank_only: bool = False  # a row-parallel bias: added once to the sum of the ranks' outputs

    def full_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*local_shape[: self.dim], self.full_size, *local_shape[self.dim + 1 :])

    def entry(self) -> ParamShard:
        """The same shard of one entry of a stacked parameter (one expert of [E, ...])."""
        return dataclasses.replace(self, dim=self.dim - 1)

    def covered(self) -> int:
        return sum(s.length for s in self.segments)

    def copy_(self, local: torch.Tensor, source, start: int, length: int) -> int:
        """Copy what this rank holds of full indices [start, start + length) along `dim` from `source`, a
        tensor or a safetensors slice covering exactly those indices (only the needed part is read). Returns
        the elements written."""
        written = 0
        for seg in self.segments:
            lo, hi = max(seg.full, start), min(seg.full + seg.length, start + length)
            if lo >= hi:
                continue
            index = (slice(None),) * self.dim + (slice(lo - start, hi - start),)
            part = torch.as_tensor(source[index])
            local.narrow(self.dim, seg.local + lo - seg.full, hi - lo).copy_(part)
            written += part.numel()
        return written


def _scale_shard(weight: ParamShard, spec: ModelSpec, row_dim: int) -> ParamShard | None:
    """The shard of an FP8 weight's scales, from the weight's (whose rows are dimension `row_dim`: 1 for stacked
    experts): per-row scales split with the rows and are whole where the columns split; block scales split with
    the blocks (`check_tensor_parallel` makes the shards whole blocks)."""
    block = spec.quantization.block
    if block is None:
        return weight if weight.dim == row_dim else None
    size = block[weight.dim - row_dim]
    segments = tuple(Segment(s.local // size, s.full // size, s.length // size) for s in weight.segments)
    return ParamShard(weight.dim, -(-weight.full_size // size), segments)


def kv_heads_per_rank(spec: ModelSpec, size: int) -> int:
    return max(spec.num_kv_heads // size, 1)


def first_kv_head(spec: ModelSpec, tp: TensorParallel) -> int:
    """This rank's first KV head; with fewer KV heads than ranks, the one its query heads all read."""
    return tp.rank * spec.num_kv_heads // tp.size


def check_tensor_parallel(spec: ModelSpec, size: int) -> None:
    """ValueError naming what does not split `size` ways (checked from config.json, before any GPU work)."""
    if size == 1:
        return
    problems = []
    if spec.num_heads % size:
        problems.append(f"its {spec.num_heads} attention heads")
    kv = spec.num_kv_heads
    if kv % size and size % kv:
        problems.append(f"its {kv} KV heads (need a multiple of {size}, or a divisor of it to replicate them)")
    if any(not layer.sparse for layer in spec.layers) and spec.intermediate_size % size:
        problems.append(f"its MLP width {spec.intermediate_size}")
    if spec.moe is not None and spec.moe.intermediate_size % size:
        problems.append(f"its expert width {spec.moe.intermediate_size}")
    block = spec.quantization and spec.quantization.block
    if block is not None:
        # Column-parallel projections split rows (q/k/v, gate/up), row-parallel ones columns (o, down).
        local = {
            "query heads": (spec.num_heads * spec.head_dim // size, block),
            "key/value heads": (kv_heads_per_rank(spec, size) * spec.head_dim, block[:1]),
            "MLP width": (spec.intermediate_size // size, block),
            "expert width": ((spec.moe.intermediate_size if spec.moe else 0) // size, block),
        }
        problems += [
            f"the width of its {what} a rank holds ({width}) in whole FP8 weight blocks of {block[0]} x {block[1]}"
            for what, (width, sides) in local.items()
            if any(width % side for side in sides)
        ]
    if problems:
        raise ValueError(
            f"engine.tensor_parallel={size} does not divide {' or '.join(problems)} of {spec.model_dir}; "
            "pick a tensor_parallel that does (or use engine.data_parallel to use more GPUs)"
        )


def rank_spec(spec: ModelSpec, tp: TensorParallel) -> ModelSpec:
    """The spec of one rank's shard: its heads and widths (the vocabulary stays the model's)."""
    if not tp.active:
        return spec
    moe = spec.moe and dataclasses.replace(spec.moe, intermediate_size=spec.moe.intermediate_size // tp.size)
    return dataclasses.replace(
        spec,
        num_heads=spec.num_heads // tp.size,
        num_kv_heads=kv_heads_per_rank(spec, tp.size),
        intermediate_size=spec.intermediate_size // tp.size,
        moe=moe,
    )


def _split(full: int, size: int, rank: int, offset: int = 0, local: int = 0) -> Segment:
    length = full // size
    return Segment(local=local, full=offset + rank * length, length=length)


_NAME = re.compile(
    r".*\.(?P<param>self_attn\.qkv_proj|self_attn\.o_proj|self_attn\.q_norm|self_attn\.k_norm|mlp\.gate_up_proj"
    r"|mlp\.down_proj|mlp\.experts\.gate_up_proj(?:_scale)?|mlp\.experts\.down_proj(?:_scale)?)"
    r"(\.(?P<kind>weight|bias|weight_scale|input_scale))?"
)


def param_shard(name: str, spec: ModelSpec, tp: TensorParallel) -> ParamShard | None:
    """Which part of the full parameter `name` this rank holds; None: all of it (replicated). `spec` is the
    full model's."""
    if not tp.active:
        return None
    if name in ("embed_tokens.weight", "lm_head.weight"):
        rows = vocab_per_rank(spec.vocab_size, tp.size)
        start = tp.rank * rows
        return ParamShard(0, spec.vocab_size, (Segment(0, start, max(0, min(rows, spec.vocab_size - start))),))
    match = _NAME.fullmatch(name)
    if match is None or match["kind"] == "input_scale":  # a static activation scale: one number, every rank's
        return None
    param, kind = match["param"], match["kind"]
    if kind == "weight_scale":
        return _scale_shard(param_shard(name.removesuffix("_scale"), spec, tp), spec, row_dim=0)
    if param.endswith("_scale"):  # FP8 experts' scales
        return _scale_shard(param_shard(name.removesuffix("_scale"), spec, tp), spec, row_dim=1)
    d, heads, kv = spec.head_dim, spec.num_heads, spec.num_kv_heads
    q = _split(heads * d, tp.size, tp.rank)
    kv_local = kv_heads_per_rank(spec, tp.size) * d
    k_start = first_kv_head(spec, tp) * d
    if param == "self_attn.qkv_proj":
        k = Segment(q.length, heads * d + k_start, kv_local)
        v = Segment(q.length + kv_local, (heads + kv) * d + k_start, kv_local)
        return ParamShard(0, (heads + 2 * kv) * d, (q, k, v))
    if param == "self_attn.o_proj":
        return ParamShard(0, 0, (), first_rank_only=True) if kind == "bias" else ParamShard(1, heads * d, (q,))
    if param in ("self_attn.q_norm", "self_attn.k_norm"):
        if spec.qk_norm != "full":
            return None  # per-head norms: every rank has the same head_dim weights
        if param == "self_attn.q_norm":
            return ParamShard(0, heads * d, (q,))
        return ParamShard(0, kv * d, (Segment(0, k_start, kv_local),))
    experts = param.startswith("mlp.experts")
    width = spec.moe.intermediate_size if experts else spec.intermediate_size
    if param.endswith("gate_up_proj"):
        gate = _split(width, tp.size, tp.rank)
        up = _split(width, tp.size, tp.rank, offset=width, local=gate.length)
        return ParamShard(1 if experts else 0, 2 * width, (gate, up))
    if kind == "bias":
        return ParamShard(0, 0, (), first_rank_only=True)
    return ParamShard(2 if experts else 1, width, (_split(width, tp.size, tp.rank),))
