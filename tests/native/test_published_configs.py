"""Configs in the layout their makers published on the Hugging Face Hub (the keys and the kinds of values that shape
a spec, written out here, not downloaded): each reads into the spec the native engine runs, with the windows, rope
and activation its transformers model uses. A key a family's own transformers model ignores (Gemma 2's
`hidden_act`) must not turn the model away."""

from __future__ import annotations

import json

from batchjob.engine.native.loading.model_loader import read_model_spec

QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 152064,
}
MISTRAL_7B_V03 = {
    "architectures": ["MistralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32768,
}
GEMMA2_2B = {
    "architectures": ["Gemma2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": [1, 107],
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304,
    "initializer_range": 0.02,
    "intermediate_size": 9216,
    "max_position_embeddings": 8192,
    "model_type": "gemma2",
    "num_attention_heads": 8,
    "num_hidden_layers": 26,
    "num_key_value_heads": 4,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "torch_dtype": "float32",
    "use_cache": True,
    "vocab_size": 256000,
}
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "initializer_range": 0.02,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 262144,
}
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
SMOLLM3_3B = {
    "architectures": ["SmolLM3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": None,
    "eos_token_id": 128012,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "layer_types": ["full_attention"] * 36,
    "max_position_embeddings": 65536,
    "max_window_layers": 28,
    "mlp_bias": False,
    "model_type": "smollm3",
    "no_rope_layer_interval": 4,
    "no_rope_layers": [1, 1, 1, 0] * 9,
    "num_attention_heads": 16,
    "num_hidden_layers": 36,
    "num_key_value_heads": 4,
    "pad_token_id": 128004,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 5000000.0,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": False,
    "use_sliding_window": False,
    "vocab_size": 128256,
}
PHI35_MINI = {
    "architectures": ["Phi3ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "embd_pdrop": 0.0,
    "eos_token_id": 32000,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "model_type": "phi3",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096,
    "pad_token_id": 32000,
    "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"long_factor": [1.0 + i / 8 for i in range(48)], "short_factor": [1.0] * 48, "type": "longrope"},
    "rope_theta": 10000.0,
    "sliding_window": 262144,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32064,
}


def _spec(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return read_model_spec(tmp_path)


def test_qwen2_5_with_a_sliding_window_it_does_not_use_runs_every_layer_in_full(tmp_path):
    spec = _spec(tmp_path, QWEN25_7B)
    assert {layer.window for layer in spec.layers} == {0}
    assert (spec.qkv_bias, spec.o_bias, spec.rope.theta, spec.num_kv_heads) == (True, False, 1e6, 4)


def test_mistral_v0_3_without_a_sliding_window(tmp_path):
    spec = _spec(tmp_path, MISTRAL_7B_V03)
    assert {layer.window for layer in spec.layers} == {0}
    assert (spec.head_dim, spec.rms_norm_eps, spec.vocab_size) == (128, 1e-05, 32768)


def test_gemma_2_with_hidden_act_beside_hidden_activation(tmp_path):
    spec = _spec(tmp_path, GEMMA2_2B)
    assert spec.activation == "gelu_tanh"
    assert [layer.window for layer in spec.layers[:4]] == [4096, 0, 4096, 0]
    assert (spec.attn_softcap, spec.final_softcap, spec.eos_token_ids) == (50.0, 30.0, (1, 107))


def test_gemma_3_with_a_local_rope_base_and_a_window_every_sixth_layer_global(tmp_path):
    spec = _spec(tmp_path, GEMMA3_1B)
    windows = [layer.window for layer in spec.layers]
    assert windows[:6] == [512] * 5 + [0] and windows.count(0) == 4
    local, global_ = spec.layers[0].rope, spec.layers[5].rope
    assert (local.theta, global_.theta) == (10000.0, 1000000.0)
    assert spec.activation == "gelu_tanh" and spec.qk_norm == "head"


def test_llama_3_1_with_llama3_rope_scaling_and_three_eos_ids(tmp_path):
    spec = _spec(tmp_path, LLAMA31_8B)
    assert (spec.rope.rope_type, spec.rope.factor, spec.rope.original_max_position_embeddings) == ("llama3", 8.0, 8192)
    assert spec.eos_token_ids == (128001, 128008, 128009)


def test_qwen3_without_a_sliding_window(tmp_path):
    spec = _spec(tmp_path, QWEN3_8B)
    assert {layer.window for layer in spec.layers} == {0}
    assert (spec.head_dim, spec.qk_norm, spec.max_model_len) == (128, "head", 40960)


def test_smollm3_leaves_every_fourth_layer_without_rope(tmp_path):
    spec = _spec(tmp_path, SMOLLM3_3B)
    assert [layer.rope is None for layer in spec.layers[:8]] == [False, False, False, True] * 2
    assert {layer.window for layer in spec.layers} == {0}
    assert spec.tie_word_embeddings and spec.rope.theta == 5000000.0


def test_phi_3_5_with_longrope_scaling_from_its_original_length(tmp_path):
    spec = _spec(tmp_path, PHI35_MINI)
    rope = spec.rope
    assert (rope.rope_type, rope.original_max_position_embeddings, len(rope.long_factor)) == ("longrope", 4096, 48)
    assert rope.factor == 131072 / 4096
    assert {layer.window for layer in spec.layers} == {262144}
