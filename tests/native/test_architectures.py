"""Each family's architecture description reads its config as transformers does: per-layer windows, ropes and
MoE layers, norm styles, partial rotary and LongRoPE, and checkpoint names mapped onto our parameters.
(That the resulting models compute what transformers computes is tests/native/test_models.py's job.)"""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from batchjob.engine.native.layers.attention import TorchPagedAttention
from batchjob.engine.native.layers.rope import rope_table
from batchjob.engine.native.loading.checkpoint_names import checkpoint_slot
from batchjob.engine.native.loading.model_loader import (
    SUPPORTED_ARCHITECTURES,
    UnsupportedModelError,
    load_model,
    read_model_spec,
)
from batchjob.job.tiny_model import TINY_CONFIGS, make_tiny_model

SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def config_dir(tmp_path, config_class: str, architecture: str, **fields):
    """A model directory holding only config.json (what the spec is read from)."""
    config = getattr(transformers, config_class)(**{**SMALL, **fields})
    config.architectures = [architecture]
    config.save_pretrained(tmp_path)
    return tmp_path


def test_every_tiny_architecture_is_one_the_native_engine_supports():
    for config_class, family in TINY_CONFIGS.values():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**{**SMALL, **family}))
        assert type(model).__name__ in SUPPORTED_ARCHITECTURES


def test_gemma3_interleaves_sliding_and_global_layers_each_with_its_rope_base(tmp_path):
    spec = read_model_spec(make_tiny_model(tmp_path / "gemma3", arch="gemma3"))

    assert [layer.window for layer in spec.layers] == [8, 0, 8]
    local, global_, _ = (layer.rope for layer in spec.layers)
    assert (local.rope_type, local.theta) == ("default", 10000.0)
    assert (global_.rope_type, global_.theta, global_.factor) == ("linear", 1e6, 4.0)
    assert spec.rope == global_
    assert (spec.norm_placement, spec.norm_unit_offset, spec.qk_norm, spec.activation) == (
        "sandwich",
        True,
        "head",
        "gelu_tanh",
    )
    assert spec.attn_scale == pytest.approx(24**-0.5)
    assert spec.embed_scale == pytest.approx(64**0.5)


def test_gemma3_configs_from_before_layer_types_are_read_like_transformers(tmp_path):
    spec = read_model_spec(
        config_dir(
            tmp_path,
            "Gemma3TextConfig",
            "Gemma3ForCausalLM",
            num_hidden_layers=7,
            head_dim=16,
            sliding_window=32,
            sliding_window_pattern=3,
            rope_theta=1e6,
            rope_local_base_freq=5000.0,
        )
    )

    assert [layer.window for layer in spec.layers] == [32, 32, 0, 32, 32, 0, 32]
    assert [layer.rope.theta for layer in spec.layers] == [5000.0, 5000.0, 1e6, 5000.0, 5000.0, 1e6, 5000.0]


def test_gemma3_bidirectional_variant_is_refused(tmp_path):
    model_dir = config_dir(
        tmp_path, "Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=16, use_bidirectional_attention=True
    )

    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        read_model_spec(model_dir)


def test_gemma2_soft_caps_attention_and_logits(tmp_path):
    spec = read_model_spec(make_tiny_model(tmp_path / "gemma2", arch="gemma2"))

    assert (spec.attn_softcap, spec.final_softcap) == (1.5, 5.0)
    assert [layer.window for layer in spec.layers] == [8, 0]
    assert spec.qk_norm == "none"


def test_qwen3_moe_keeps_dense_mlps_where_mlp_only_layers_and_decoder_sparse_step_say(tmp_path):
    spec = read_model_spec(
        config_dir(
            tmp_path,
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
            norm_topk_prob=False,
        )
    )

    assert [layer.sparse for layer in spec.layers] == [False, True, False, False]
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.intermediate_size) == (8, 2, 32)
    assert not spec.moe.renormalize
    assert spec.qk_norm == "head"


def test_mixtral_routes_every_layer_and_renormalises_its_top_k(tmp_path):
    spec = read_model_spec(make_tiny_model(tmp_path / "mixtral", arch="mixtral"))

    assert all(layer.sparse for layer in spec.layers)
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.renormalize) == (4, 2, True)


def test_mixtral_checkpoint_names_map_onto_stacked_expert_slices(tmp_path):
    spec = read_model_spec(make_tiny_model(tmp_path / "mixtral", arch="mixtral"))

    up = checkpoint_slot("model.layers.1.block_sparse_moe.experts.3.w3.weight", spec)
    down = checkpoint_slot("model.layers.1.block_sparse_moe.experts.2.w2.weight", spec)
    router = checkpoint_slot("model.layers.1.block_sparse_moe.gate.weight", spec)
    pre_mlp_norm = checkpoint_slot("model.layers.1.post_attention_layernorm.weight", spec)

    assert (up.name, up.expert, up.row) == ("layers.1.mlp.experts.gate_up_proj", 3, spec.moe.intermediate_size)
    assert (down.name, down.expert, down.row) == ("layers.1.mlp.experts.down_proj", 2, None)
    assert router.name == "layers.1.mlp.gate.weight"
    assert pre_mlp_norm.name == "layers.1.pre_feedforward_layernorm.weight"


def test_checkpoints_with_stacked_experts_load_like_per_expert_ones(tmp_path):
    model_dir = make_tiny_model(tmp_path / "qwen3_moe", arch="qwen3_moe")
    per_expert, _ = load_model(model_dir, "float32", "cpu", TorchPagedAttention())
    stacked_dir = tmp_path / "stacked"
    stacked_dir.mkdir()
    for file in model_dir.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, stacked_dir)
    # transformers' in-memory layout: experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I].
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, stacked_dir / "model.safetensors")

    stacked, _ = load_model(stacked_dir, "float32", "cpu", TorchPagedAttention())

    for name, param in per_expert.state_dict().items():
        torch.testing.assert_close(stacked.state_dict()[name], param, atol=0, rtol=0)


def test_smollm3_layers_flagged_in_no_rope_layers_have_no_rotary_embedding(tmp_path):
    spec = read_model_spec(make_tiny_model(tmp_path / "smollm3", arch="smollm3"))

    assert spec.layers[0].rope is not None and spec.layers[1].rope is None


def test_olmo2_normalises_after_sublayers_and_q_k_over_all_heads(tmp_path):
    spec = read_model_spec(make_tiny_model(tmp_path / "olmo2", arch="olmo2"))

    assert (spec.norm_placement, spec.qk_norm, spec.norm_weight_fp32) == ("post", "full", True)


def test_phi3_rotates_part_of_each_head_and_switches_to_long_factors_past_the_original_length(tmp_path):
    model_dir = make_tiny_model(tmp_path / "phi3", arch="phi3")
    spec = read_model_spec(model_dir)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    original = 64

    table = rope_table(spec.layers[0].rope, spec.rotary_dim, 100)

    assert spec.rotary_dim == spec.head_dim // 2
    for seq_len, positions in ((original, range(0, original)), (original + 1, range(original, 100))):
        inv_freq, scale = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=seq_len)
        freqs = torch.arange(100, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        expected = torch.cat((emb.cos() * scale, emb.sin() * scale), dim=-1)
        torch.testing.assert_close(table[list(positions)], expected[list(positions)])


def test_mistral_sliding_window_is_a_layer_attribute_not_a_length_cap(tmp_path):
    spec = read_model_spec(make_tiny_model(tmp_path / "mistral", arch="mistral", sliding_window=64))

    assert spec.max_model_len == 1024
    assert [layer.window for layer in spec.layers] == [64, 64]


def test_qwen2_with_use_sliding_window_windows_the_layers_from_max_window_layers_on(tmp_path):
    spec = read_model_spec(
        config_dir(
            tmp_path, "Qwen2Config", "Qwen2ForCausalLM", use_sliding_window=True, sliding_window=16, max_window_layers=2
        )
    )

    assert [layer.window for layer in spec.layers] == [0, 0, 16, 16]


@pytest.mark.parametrize(
    ("config_class", "architecture"), [("Gemma2Config", "Gemma2ForCausalLM"), ("Gemma3TextConfig", "Gemma3ForCausalLM")]
)
def test_a_gemma_config_carrying_hidden_act_beside_hidden_activation_runs_natively(
    tmp_path, config_class, architecture
):
    # Gemma 2's published configs carry both; transformers' Gemma models read `hidden_activation` alone.
    model_dir = config_dir(
        tmp_path, config_class, architecture, head_dim=16, hidden_act="gelu_pytorch_tanh",
        hidden_activation="gelu_pytorch_tanh",
    )  # fmt: skip

    spec = read_model_spec(model_dir)
    assert spec.activation == "gelu_tanh"
    with pytest.raises(UnsupportedModelError, match="hidden_activation 'gelu' is not gelu_pytorch_tanh"):
        read_model_spec(
            config_dir(tmp_path / "exact", config_class, architecture, head_dim=16, hidden_activation="gelu")
        )


def test_swish_is_silu(tmp_path):
    spec = read_model_spec(config_dir(tmp_path, "LlamaConfig", "LlamaForCausalLM", hidden_act="swish"))
    assert spec.activation == "silu"


def test_an_activation_the_family_does_not_run_is_refused_naming_engine_hf(tmp_path):
    model_dir = config_dir(tmp_path, "LlamaConfig", "LlamaForCausalLM", hidden_act="gelu")

    with pytest.raises(UnsupportedModelError, match="engine=hf"):
        read_model_spec(model_dir)
