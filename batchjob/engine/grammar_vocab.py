"""llguidance's view of a model's vocabulary: the index of its tokenizer for logits of the model's width, the EOS
ids the grammar may end on, and the string slices a mask takes whole (structured outputs, grammar.py)."""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any

# Lengths of the string-content token sets the mask computation takes whole (llguidance's "slices"): inside a
# JSON string of bounded length (maxLength), a set applies while it fits the characters left, so finer steps than
# the library's default (10, 30) leave fewer tokens to walk one by one near the bound. The masks are the same
# with any slices (a CPU test compares them); `scripts/dev/profile_masks.py` times them (docs/engine.md: on the
# benchmark's records schema and 128k vocabulary, a mean of 153 us against 240 with the default slices).
STRING_SLICE_LENGTHS = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16, 20, 25, 30, 40)


def string_slices(general: Sequence[str]) -> list[str]:
    """llguidance's general slices with the bounded string-content ones replaced by `STRING_SLICE_LENGTHS`.
    `general` is `[whitespace, content{1,10}, content{1,30}, content+]`; another layout is returned as it is."""
    bounded = [s for s in general if s.endswith("}") and "{1," in s]
    if not bounded:
        return list(general)
    content = bounded[0][: bounded[0].rindex("{1,")]
    others = [s for s in general if s not in bounded]
    unbounded = [s for s in others if s.startswith(content)]
    return [s for s in others if s not in unbounded] + [f"{content}{{1,{n}}}" for n in STRING_SLICE_LENGTHS] + unbounded


def grammar_eos_ids(eos_token_ids: Sequence[int], tokenizer_eos: int | None, limit: int) -> list[int] | None:
    """The EOS ids to give llguidance: the model's below `limit` (the narrower of the tokenizer and the logits;
    llguidance refuses an EOS beyond the tokenizer, and a model whose logits are wider than its tokenizer may name
    one in its config), else the tokenizer's own. A constrained sample then ends on an EOS its grammar knows; the
    model's others still end unconstrained samples."""
    inside = [t for t in eos_token_ids if t < limit]
    if inside:
        return inside
    return [tokenizer_eos] if tokenizer_eos is not None and tokenizer_eos < limit else None


def vocabulary_index(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> Any:
    """llguidance's index of `tokenizer` for logits `vocab_size` wide (the model's). A tokenizer with added tokens
    beyond the logits (a pad token appended without resizing the model) is indexed without them: the model cannot
    produce them, and llguidance refuses a tokenizer larger than its vocabulary. Raises ValueError when ordinary
    tokens lie beyond the logits, or for a tokenizer llguidance cannot read."""
    import llguidance
    import llguidance.hf

    slices = string_slices(llguidance.LLTokenizer.general_slices())
    size = len(tokenizer)
    eos = grammar_eos_ids(eos_token_ids, tokenizer.eos_token_id, min(size, vocab_size))
    if size <= vocab_size:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos, slices=slices)
    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    spec = json.loads(backend.to_str())
    spec["added_tokens"] = [t for t in spec.get("added_tokens", []) if t["id"] < vocab_size]
    try:
        return llguidance.LLTokenizer(json.dumps(spec), n_vocab=vocab_size, eos_token=eos, slices=slices)
    except ValueError as err:
        raise ValueError(f"the tokenizer has {size} ids and the model's logits {vocab_size} ({err})") from err
