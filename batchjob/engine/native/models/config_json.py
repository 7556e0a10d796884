"""A model's config.json read as transformers' config class presents it to the spec (`config_spec.common_spec` and the
families' `adapt`), without importing transformers.

Importing transformers' config classes imports much of transformers and, with it, parts of torch's compiler and
distributed packages: seconds of a cold start-up, more where the environment holds no compiled bytecode (7.5 s on a
GPU node, docs/benchmarks.md). This module knows, for each supported family, the defaults of the fields the spec
reads and what its config class derives from them (layer types, the sliding window, rope parameters), as
transformers 5 computes them. It answers None for what it does not know (another `model_type`, a rope layout it
does not standardize), and the caller reads through transformers instead.

Its answer is never trusted alone: `spec_check.py` reads the same files through transformers in a process beside
the start-up, and the engine compares the two specs before it generates (tests/native/test_config_json.py compares
them for every family too).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

from batchjob.engine.config_files import read_json_file

_BASE = dict(
    num_key_value_heads=None, head_dim=None, hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False,
    pad_token_id=None, bos_token_id=None, eos_token_id=None, rope_parameters=None, dtype=None,
)  # fmt: skip
_LLAMA = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, attention_bias=False, mlp_bias=False,
)  # fmt: skip
_MISTRAL = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=131072, bos_token_id=1, eos_token_id=2, sliding_window=4096,
)  # fmt: skip
_QWEN = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, max_position_embeddings=32768, sliding_window=4096, use_sliding_window=False,
    max_window_layers=28, layer_types=None,
)  # fmt: skip
_GEMMA = dict(
    hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
    head_dim=256, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, attention_bias=False,
    bos_token_id=2, eos_token_id=1, pad_token_id=0, sliding_window=4096, layer_types=None, query_pre_attn_scalar=256,
)  # fmt: skip


def _kv_heads(c: dict[str, Any]) -> None:
    if c["num_key_value_heads"] is None:
        c["num_key_value_heads"] = c["num_attention_heads"]


def _llama(c: dict[str, Any]) -> None:
    _kv_heads(c)
    if c["head_dim"] is None:
        c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]


def _qwen(c: dict[str, Any]) -> None:
    c["sliding_window"] = c["sliding_window"] if c["use_sliding_window"] else None
    _kv_heads(c)
    if c["layer_types"] is None:
        window, first = c["sliding_window"], c["max_window_layers"]
        c["layer_types"] = [
            "sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(c["num_hidden_layers"])
        ]


def _qwen3_moe(c: dict[str, Any]) -> None:
    c["sliding_window"] = c["sliding_window"] if c["use_sliding_window"] else None
    c["mlp_only_layers"] = [] if c["mlp_only_layers"] is None else c["mlp_only_layers"]


def _gemma_layers(pattern: int) -> Callable[[dict[str, Any]], None]:
    def derive(c: dict[str, Any]) -> None:
        if c["layer_types"] is None:
            kinds = ("full_attention", "sliding_attention")
            c["layer_types"] = [kinds[bool((i + 1) % pattern)] for i in range(c["num_hidden_layers"])]

    return derive


def _gemma3(c: dict[str, Any]) -> None:
    if c.get("use_bidirectional_attention"):  # an encoder: the spec refuses it, as transformers reads it
        c["sliding_window"] = c["sliding_window"] // 2 + 1
    _gemma_layers(int(c.get("sliding_window_pattern", 6)))(c)


def _smollm3(c: dict[str, Any]) -> None:
    _kv_heads(c)
    if c["no_rope_layers"] is None:
        interval = c["no_rope_layer_interval"]
        c["no_rope_layers"] = [int((i + 1) % interval != 0) for i in range(c["num_hidden_layers"])]
    if c["layer_types"] is None:
        windowed = c["use_sliding_window"] and c["sliding_window"] is not None
        c["layer_types"] = [
            "sliding_attention" if windowed and not rope else "full_attention" for rope in c["no_rope_layers"]
        ]


class Family(NamedTuple):
    """What an architecture's transformers config class does with config.json, as far as the spec reads it."""

    model_type: str
    defaults: dict[str, Any]  # of the fields the spec reads
    derive: Callable[[dict[str, Any]], None]  # the field derivations of its `__post_init__`, in place
    rope: tuple[str, float]  # how it standardizes rope parameters ("flat", "phi3", "gemma3"), its default theta


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", {**_LLAMA, "rms_norm_eps": 1e-6}, _llama, ("flat", 10000.0)),
    "MistralForCausalLM": Family("mistral", {**_MISTRAL, "rms_norm_eps": 1e-6}, _llama, ("flat", 10000.0)),
    "Qwen2ForCausalLM": Family("qwen2", _QWEN, _qwen, ("flat", 10000.0)),
    "Qwen3ForCausalLM": Family("qwen3", {**_QWEN, "head_dim": 128, "attention_bias": False}, _qwen, ("flat", 10000.0)),
    "Qwen3MoeForCausalLM": Family(
        "qwen3_moe",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=24,
            num_attention_heads=32,
            num_key_value_heads=4,
            max_position_embeddings=32768,
            attention_bias=False,
            sliding_window=4096,
            use_sliding_window=False,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=None,
        ),  # fmt: skip
        _qwen3_moe,
        ("flat", 10000.0),
    ),
    "MixtralForCausalLM": Family(
        "mixtral",
        {**_MISTRAL, "rms_norm_eps": 1e-5, "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2},
        _kv_heads,
        ("flat", 1000000.0),
    ),
    "Gemma2ForCausalLM": Family(
        "gemma2",
        {
            **_GEMMA,
            "vocab_size": 256000,
            "max_position_embeddings": 8192,
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0,
            "use_bidirectional_attention": None,
        },  # fmt: skip
        _gemma_layers(2),
        ("flat", 10000.0),
    ),
    "Gemma3ForCausalLM": Family(
        "gemma3_text",
        {
            **_GEMMA,
            "vocab_size": 262208,
            "max_position_embeddings": 131072,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "use_bidirectional_attention": False,
        },  # fmt: skip
        _gemma3,
        ("gemma3", 1000000.0),
    ),
    "Phi3ForCausalLM": Family(
        "phi3",
        dict(
            vocab_size=32064,
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=32,
            num_attention_heads=32,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            bos_token_id=1,
            eos_token_id=32000,
            pad_token_id=32000,
            sliding_window=None,
            original_max_position_embeddings=4096,
        ),  # fmt: skip
        _kv_heads,
        ("phi3", 10000.0),
    ),
    "SmolLM3ForCausalLM": Family(
        "smollm3",
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=4,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
            attention_bias=False,
            mlp_bias=False,
            bos_token_id=128000,
            eos_token_id=128001,
            pad_token_id=128004,
            sliding_window=None,
            use_sliding_window=False,
            layer_types=None,
            no_rope_layers=None,
            no_rope_layer_interval=4,
        ),  # fmt: skip
        _smollm3,
        ("flat", 2000000.0),
    ),
    "Olmo2ForCausalLM": Family(
        "olmo2",
        dict(
            vocab_size=50304,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            max_position_embeddings=2048,
            rms_norm_eps=1e-5,
            attention_bias=False,
            eos_token_id=50279,
            pad_token_id=1,
        ),  # fmt: skip
        _kv_heads,
        ("flat", 10000.0),
    ),
}
_SCALED = ("llama3", "yarn", "longrope")


def native_config(model_dir: Path, architecture: str) -> SimpleNamespace | None:
    """config.json as the architecture's transformers config class would present it, or None where this module
    cannot tell (the caller then asks transformers)."""
    if architecture not in FAMILIES:
        return None
    model_type, defaults, derive, (rope_style, theta) = FAMILIES[architecture]
    raw = read_json_file(model_dir / "config.json")  # a fresh object: its nested dicts are this call's to change
    if raw.get("model_type") not in (None, model_type) or "auto_map" in raw:
        return None
    config = {**_BASE, **defaults, **raw}
    if architecture in ("MixtralForCausalLM", "Qwen3MoeForCausalLM"):  # two names of one field (attribute_map)
        experts = raw.get("num_local_experts", raw.get("num_experts"))
        experts = config.get("num_local_experts", config.get("num_experts")) if experts is None else experts
        config["num_experts"] = config["num_local_experts"] = experts
    if "torch_dtype" in raw and raw.get("dtype") is None:
        config["dtype"] = raw["torch_dtype"]
    derive(config)
    rope = _rope_parameters(config, raw, rope_style, theta)
    if rope is None:
        return None
    config["rope_parameters"] = rope
    return SimpleNamespace(**config)


def _rope_parameters(config: dict[str, Any], raw: dict[str, Any], style: str, theta: float) -> dict | None:
    """transformers 5's standardized `rope_parameters`: `rope_scaling` (the older name) or `rope_parameters`, with
    `rope_type`, `rope_theta` and the pretraining length of the scaled types filled in."""
    if style == "gemma3":
        return _gemma3_rope(config, raw)
    params = copy.deepcopy(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    if not isinstance(params, dict) or any(isinstance(value, dict) for value in params.values()):
        return None  # nested by layer type: not a layout these families use
    params.setdefault("rope_theta", raw.get("rope_theta", theta))
    if style == "phi3":
        params.setdefault("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        if params.get("rope_type", params.get("type")) in ("su", "yarn"):
            params["rope_type"] = "longrope"
    elif "partial_rotary_factor" in raw:
        params.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in _SCALED:
        if "original_max_position_embeddings" in config:  # a field of the class (Phi-3) wins over the dict
            params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        else:
            params.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    return params


def _gemma3_rope(config: dict[str, Any], raw: dict[str, Any]) -> dict | None:
    params = copy.deepcopy(raw.get("rope_parameters")) or {
        "sliding_attention": {"rope_type": "default"},
        "full_attention": {"rope_type": "default"},
    }
    if not isinstance(params, dict) or set(params) - {"sliding_attention", "full_attention"}:
        return None
    if raw.get("rope_scaling") is not None:
        params["full_attention"].update(raw["rope_scaling"])
    full = params.get("full_attention") or {"rope_type": "default"}
    local = params.get("sliding_attention") or {"rope_type": "default"}
    full.setdefault("rope_theta", raw.get("rope_theta", 1000000.0))
    local.setdefault("rope_theta", raw.get("rope_local_base_freq", 10000.0))
    for kind in (full, local):
        kind.setdefault("rope_type", kind.get("type", "default"))
        if kind["rope_type"] in _SCALED:
            kind.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    return {"full_attention": full, "sliding_attention": local}
