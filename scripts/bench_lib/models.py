"""Model directories for the benchmark: the real config of an architecture, seeded random bf16 weights (throughput
does not depend on their values) and a word-level tokenizer of exactly `vocab_size` ids, cached under
`--model-cache`."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench_lib.workloads import ARCHITECTURES, SEED

# Where the scripts keep what they build (models, tokenizers) unless told otherwise.
DEFAULT_CACHE = Path(os.environ.get("BATCHJOB_CACHE", Path.home() / ".cache" / "batchjob")) / "bench"
PAD, BOS, UNK = "<pad>", "<bos>", "<unk>"
EOS = "<eos>"
# Ids the prompts avoid: pad, bos and unk first, eos last (see `draw_requests`).
BENCH_SPECIAL_IDS = 3
TINY_SPECIAL_IDS = 6  # batchjob.job.tiny_model puts its six special tokens first


def word_level_tokenizer(vocab_size: int):
    """A tokenizer whose every id in `range(vocab_size)` is a word, so any generated id detokenizes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [PAD, BOS, UNK] + [f"w{i}" for i in range(BENCH_SPECIAL_IDS, vocab_size - 1)] + [EOS]
    core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS, unk_token=UNK, eos_token=EOS)


def model_config(architecture: str):
    """The transformers config of `architecture` (bench_lib.workloads.ARCHITECTURES), naming its causal-LM class."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    fields = dict(ARCHITECTURES[architecture])
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(
        model_type,
        **fields,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=fields["vocab_size"] - 1,
        attention_bias=False,
        dtype="bfloat16",  # as the real checkpoints declare: engine.dtype=auto then runs them in bfloat16
    )
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    return config


@contextmanager
def _staged(out_dir: Path) -> Iterator[Path]:
    """A directory beside `out_dir` for the block to fill, renamed to `out_dir` once complete: a build stopped
    half-way leaves nothing a later run would take for a cached model."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        yield staging
        staging.chmod(0o755)
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _fill_random(model, seed: int) -> None:
    """Normals of std 0.02 (the architectures' own init) for matrices, ones for norms: finite activations in bf16."""
    import torch

    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)


def _generation_config(config):
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )


def random_model_dir(architecture: str, cache_dir: Path) -> Path:
    """The cached directory of `architecture` with seeded random bf16 weights, made on the GPU on first use."""
    import torch
    from transformers import AutoModelForCausalLM

    out_dir = Path(cache_dir) / f"{architecture}-random-seed{SEED}"
    if (out_dir / "config.json").exists():
        return out_dir
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"building the random {architecture} model needs a CUDA GPU; on a CPU use --tiny "
            f"(or copy a cached {out_dir.name} into --model-cache)"
        )
    config = model_config(architecture)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    _fill_random(model, SEED)
    model.generation_config = _generation_config(config)
    with _staged(out_dir) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        word_level_tokenizer(config.vocab_size).save_pretrained(staging)
    del model
    torch.cuda.empty_cache()
    return out_dir


def config_model_dir(architecture: str, cache_dir: Path) -> Path:
    """The cached directory of `architecture` without weights, for `engine.load_format=dummy` (the engine makes
    seeded random weights on the GPU, so a 70B model needs no disk); needs no GPU."""
    out_dir = Path(cache_dir) / f"{architecture}-config-only"
    if (out_dir / "config.json").exists():
        return out_dir
    config = model_config(architecture)
    with _staged(out_dir) as staging:
        config.save_pretrained(staging)
        _generation_config(config).save_pretrained(staging)
        word_level_tokenizer(config.vocab_size).save_pretrained(staging)
    return out_dir


def tiny_model_dir(cache_dir: Path) -> Path:
    """The tiny llama of `batchjob.job.tiny_model`, cached like the big ones."""
    from batchjob.job.tiny_model import make_tiny_model

    out_dir = Path(cache_dir) / "tiny-llama"
    if not (out_dir / "config.json").exists():
        make_tiny_model(out_dir, arch="llama")
    return out_dir


def bpe_model_dir(architecture: str, cache_dir: Path, tokenizer_name: str = "bpe") -> Path:
    """`random_model_dir(architecture)` with a byte-level BPE tokenizer ("bpe" or "cl100k", `bench_lib.bpe`) for
    structured outputs: a word-level vocabulary cannot spell JSON. The weights are linked, not copied."""
    from bench_lib.bpe import bpe_tokenizer, cl100k_tokenizer

    base = random_model_dir(architecture, cache_dir)
    out_dir = Path(cache_dir) / f"{base.name}-{tokenizer_name}"
    if (out_dir / "config.json").exists():
        return out_dir
    if tokenizer_name == "cl100k":
        tokenizer = cl100k_tokenizer(cache_dir)
    else:
        tokenizer = bpe_tokenizer(cache_dir, vocab_size=ARCHITECTURES[architecture]["vocab_size"])
    with _staged(out_dir) as staging:
        for item in base.iterdir():
            if not item.name.startswith("tokenizer") and item.name != "special_tokens_map.json":
                (staging / item.name).symlink_to(item.resolve())
        tokenizer.save_pretrained(staging)
    return out_dir


def text_tokens(architecture: str, tokenizer_name: str) -> int:
    """How many ids below a constrained run's tokenizer's special ones (its ordinary tokens)."""
    from bench_lib.bpe import CL100K_TOKENS, NUM_SPECIAL

    return CL100K_TOKENS if tokenizer_name == "cl100k" else ARCHITECTURES[architecture]["vocab_size"] - NUM_SPECIAL
