"""Phi-3 and Phi-4-mini: the Llama layout whose checkpoints already hold the fused `qkv_proj` and
`gate_up_proj` our decoder uses, with partial rotary embeddings (`partial_rotary_factor`) and LongRoPE
scaling (see `rope.rope_table`); `sliding_window`, when set, applies to every layer."""

from __future__ import annotations

from batchjob.engine.native.models.spec import PRE_NORM_RENAMES, Architecture

PHI3 = Architecture("Phi3ForCausalLM", checkpoint_renames=PRE_NORM_RENAMES)
