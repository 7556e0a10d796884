"""Large byte-level BPE tokenizers for structured outputs, whose masks cost what the vocabulary makes them: a BPE
trained offline (a minute or two) with Llama 3's split on Zipf-distributed pseudo-words, JSON records and code-like
lines, so that its merges mix JSON punctuation with letters (`{"`, `":"`) as real ones do, 128,256 ids as Llama 3;
and tiktoken's cl100k_base, a real vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# Llama 3's pre-tokenizer pattern: words with one leading non-letter, numbers of up to 3 digits, punctuation runs.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
NUM_SPECIAL = 256

_ONSETS = "b c d f g h j k l m n p r s t v w z bl br ch cl cr dr fl fr gl gr pl pr sc sh sk sl sm sn sp st str th tr wh"
_VOWELS = "a e i o u ai ea ee ie oa oo ou y"
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "rt", "ck", "ll", "ss")


def _corpus(seed: int, documents: int, words_per_document: int) -> list[str]:
    rng = np.random.default_rng(seed)
    onsets, vowels = _ONSETS.split(), _VOWELS.split()
    size = 600_000
    parts = [rng.integers(0, n, size=(size, 3)) for n in (len(onsets), len(vowels), len(_CODAS))]
    syllables = rng.integers(1, 4, size=size)
    lexicon = sorted(
        {
            "".join(onsets[parts[0][i, j]] + vowels[parts[1][i, j]] + _CODAS[parts[2][i, j]] for j in range(n))
            for i, n in enumerate(syllables)
        }
    )
    rng.shuffle(lexicon)
    weights = 1.0 / np.arange(1, len(lexicon) + 1)
    cumulative = np.cumsum(weights / weights.sum())
    docs = []
    for d in range(documents):
        ids = np.searchsorted(cumulative, rng.random(words_per_document))
        words = [lexicon[min(i, len(lexicon) - 1)] for i in ids]
        if d % 3 == 0:
            # JSON records, compact and indented, over the same words: merges such as `{"`, `":`, `"},{"`.
            records = [
                {
                    words[i]: words[i + 1],
                    words[i + 2]: int(rng.integers(-5000, 100000)),
                    words[i + 3]: [words[i + 4].capitalize(), round(float(rng.normal(0, 100)), 3)],
                    words[i + 5]: {words[i + 6]: bool(i % 2), words[i + 7]: None},
                }
                for i in range(0, len(words) - 8, 8)
            ]
            docs.append(json.dumps(records, separators=(",", ":")) if d % 2 else json.dumps(records, indent=2))
        else:
            sentences = [" ".join(words[i : i + 12]).capitalize() + "." for i in range(0, len(words), 12)]
            docs.append(" ".join(sentences) + f"\n{d}: x = f({words[0]}, {d * 31 % 977});\n")
    return docs


def train_bpe(vocab_size: int = 128_256, seed: int = 0, documents: int = 1500, words_per_document: int = 2000):
    """A `PreTrainedTokenizerFast` with `vocab_size` ids: `vocab_size - 256` trained byte-level BPE tokens, then
    256 special tokens (BOS, EOS, PAD and reserved ones), as in Llama 3."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - NUM_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_corpus(seed, documents, words_per_document), trainer=trainer)
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(NUM_SPECIAL - 3)]
    core.add_special_tokens([AddedToken(t, special=True) for t in (BOS, EOS, PAD, *reserved)])
    if core.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"the generated corpus gave {core.get_vocab_size()} ids, not {vocab_size}: raise `documents`"
        )
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD)


# cl100k_base's 100,256 tokens are the first of Llama 3's 128,256; tiktoken reads it from TIKTOKEN_CACHE_DIR or
# downloads it.
CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
CL100K_TOKENS = 100_256


def cl100k_tokenizer(cache_dir: Path):
    """A `PreTrainedTokenizerFast` of cl100k_base's tokens (ids 0-100,255) with Llama 3's pre-tokenizer split
    and 256 special tokens after them (BOS, EOS, PAD and reserved ones), saved under `cache_dir` on first use."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path = Path(cache_dir) / "cl100k"
    if not (path / "tokenizer.json").exists():
        core = TikTokenConverter(vocab_file=CL100K_URL, pattern=LLAMA3_SPLIT).converted()
        if core.get_vocab_size() != CL100K_TOKENS:
            raise RuntimeError(f"cl100k_base gave {core.get_vocab_size()} tokens, not {CL100K_TOKENS}")
        reserved = [f"<|reserved_special_token_{i}|>" for i in range(NUM_SPECIAL - 3)]
        core.add_special_tokens([AddedToken(t, special=True) for t in (BOS, EOS, PAD, *reserved)])
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD)
        tokenizer.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def bpe_tokenizer(cache_dir: Path, vocab_size: int = 128_256):
    """`train_bpe(vocab_size)`, saved under `cache_dir` on first use and loaded from there afterwards."""
    from transformers import AutoTokenizer

    path = Path(cache_dir) / f"bpe-{vocab_size}"
    if not (path / "tokenizer.json").exists():
        train_bpe(vocab_size).save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def named_tokenizer(name: str, cache_dir: Path):
    """ "bpe" (`bpe_tokenizer`), "cl100k" (`cl100k_tokenizer`) or a tokenizer directory."""
    if name in ("bpe", "cl100k"):
        return bpe_tokenizer(cache_dir) if name == "bpe" else cl100k_tokenizer(cache_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)
