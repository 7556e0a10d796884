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

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
DEFAULT_CACHE = cache_root()
SAMPLE_PROMPTS = Path(__file__).parent / "data" / "sample_prompts.parquet"

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


def _config(arch: str, vocab_size: int, tokenizer, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

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
    if arch == "llama":
        common.update(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
            tie_word_embeddings=True,
        )
        config_cls = LlamaConfig
    elif arch == "mistral":
        config_cls = MistralConfig
        common.update(sliding_window=None)
    elif arch == "qwen2":
        config_cls = Qwen2Config
        common.update(tie_word_embeddings=True)
    elif arch == "qwen3":
        config_cls = Qwen3Config
        common.update(head_dim=32)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    common.update(overrides)
    return config_cls(**common)


def make_tiny_model(out_dir: str | Path, arch: str = "llama", seed: int = 0, **config_overrides) -> Path:
    """Write a tiny random model of `arch` to `out_dir` (atomically: a half-written directory never
    appears under the final name). Returns the directory."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out_dir = Path(out_dir)
    tokenizer = train_tokenizer()
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
