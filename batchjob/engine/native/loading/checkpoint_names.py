"""Checkpoint tensor names -> where each goes in the model (`checkpoint_slot`): a family's renames, then q/k/v and
gate/up into their rows of one fused projection, and per-expert weights into their entry of the stacked expert
weights."""

from __future__ import annotations

import re
from dataclasses import dataclass

from batchjob.engine.native.models.registry import ARCHITECTURES
from batchjob.engine.native.models.spec import ModelSpec

_QKV = re.compile(r"(.*)\.self_attn\.([qkv])_proj\.(weight|bias)")
_GATE_UP = re.compile(r"(.*)\.mlp\.(gate|up)_proj\.(weight|bias)")
_EXPERT = re.compile(r"(.*)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
# The scales beside an FP8 checkpoint's weights (`weight_scale_inv`: block FP8's name for the same thing).
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale")


@dataclass(frozen=True)
class Slot:
    """Where a checkpoint tensor goes: parameter `name`, its `expert`-th entry (stacked experts), rows from
    `row` on (fused q/k/v or gate/up)."""

    name: str
    expert: int | None = None
    row: int | None = None


def checkpoint_slot(key: str, spec: ModelSpec) -> Slot | None:
    """Checkpoint tensor name -> its `Slot` in our model, or None for tensors we do not need. The family's
    renames come first (`Architecture.checkpoint_renames`), then the fused and stacked slots every family
    shares."""
    name = key.removeprefix("model.")
    if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and spec.tie_word_embeddings):
        return None
    if spec.quantization is not None and name.endswith(SCALE_SUFFIXES):
        return None  # an FP8 weight's or activation's scale: read by `fp8_scales.load_scales`
    for pattern, replacement in ARCHITECTURES[spec.architecture].checkpoint_renames:
        name = re.sub(pattern, replacement, name)
    q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    if match := _QKV.fullmatch(name):
        prefix, which, kind = match.groups()
        return Slot(f"{prefix}.self_attn.qkv_proj.{kind}", row={"q": 0, "k": q_size, "v": q_size + kv_size}[which])
    if match := _EXPERT.fullmatch(name):
        prefix, expert, which = match.groups()
        if which == "down":
            return Slot(f"{prefix}.mlp.experts.down_proj", expert=int(expert))
        row = 0 if which == "gate" else spec.moe.intermediate_size
        return Slot(f"{prefix}.mlp.experts.gate_up_proj", expert=int(expert), row=row)
    if match := _GATE_UP.fullmatch(name):
        prefix, which, kind = match.groups()
        return Slot(f"{prefix}.mlp.gate_up_proj.{kind}", row=0 if which == "gate" else spec.intermediate_size)
    return Slot(name)
