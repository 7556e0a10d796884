"""Tiny random-weight models saved as real Hugging Face model directories.

Nothing here touches the network: the tokenizer is a byte-level BPE trained on the fly on the bundled
prompts, the weights are drawn from a seeded generator, and everything is written with
`save_pretrained` (safetensors), so the real loading code is what runs in tests and in the default job.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from batchjob.caches import cache_root

DEFAULT_CACHE = cache_root()
SAMPLE_PROMPTS = Path(__file__).parents[1] / "data" / "sample_prompts.parquet"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


def _training_corpus() -> list[str]:
    import pyarrow.parquet as pq

    texts = pq.read_table(SAMPLE_PROMPTS, columns=["prompt"]).column("prompt").to_pylist()
    return texts + ["The quick brown fox jumps over the lazy dog. 0123456789 !?.,;:'\"()[]{}"]


def train_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer (every byte sequence encodes) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_training_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|bos|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# Each tiny architecture: its transformers config class and what differs from the common tiny shape. Windows
# and rope switch-over points are small, so short test prompts already cross them.
TINY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": (
        "LlamaConfig",
        dict(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
            tie_word_embeddings=True,
        ),
    ),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            head_dim=16,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=1.5,
            final_logit_softcapping=5.0,
            tie_word_embeddings=True,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            head_dim=16,
            num_hidden_layers=3,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
            },
            tie_word_embeddings=True,
        ),
    ),
    "phi3": (
        "Phi3Config",
        dict(
            partial_rotary_factor=0.5,
            original_max_position_embeddings=64,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0, 1.1, 1.3, 1.6],
                "long_factor": [1.0, 2.0, 4.0, 8.0],
            },
        ),
    ),
    "smollm3": ("SmolLM3Config", dict(no_rope_layer_interval=2)),
    "olmo2": ("Olmo2Config", dict()),
}
ARCHITECTURES = tuple(TINY_CONFIGS)


def _config(arch: str, vocab_size: int, tokenizer, **overrides):
    import transformers

    if arch not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    config_name, family = TINY_CONFIGS[arch]
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    return getattr(transformers, config_name)(**{**common, **family, **overrides})


def make_tiny_model(
    out_dir: str | Path, arch: str = "llama", seed: int = 0, tokenizer=None, **config_overrides
) -> Path:
    """Write a tiny random model of `arch` to `out_dir` (atomically: a half-written directory never
    appears under the final name), with `tokenizer`'s whole vocabulary (default: a small one trained now).
    Returns the directory."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out_dir = Path(out_dir)
    tokenizer = train_tokenizer() if tokenizer is None else tokenizer
    config = _config(arch, len(tokenizer), tokenizer, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) * (1.0 / param.shape[-1] ** 0.5))
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    staging.chmod(0o755)
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / "batchjob_tiny.json").write_text(json.dumps({"arch": arch, "seed": seed}))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def default_tiny_model(arch: str = "llama") -> Path:
    """The embedded default model, created on first use in the cache folder."""
    path = DEFAULT_CACHE / f"tiny-{arch}"
    if not (path / "config.json").exists():
        make_tiny_model(path, arch=arch)
    return path
