"""Incremental detokenisation for stop strings.

Decoding the whole output after every token costs O(n^2); instead each step decodes a short window of recent
tokens and keeps the text that is complete (a byte-level tokenizer can split one character over several
tokens, shown as U+FFFD until its last byte arrives). The stop-string search covers only the new text plus
the tail that a stop string could straddle.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, tokenizer, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.longest = max(len(s) for s in self.stop)
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def feed(self, output_ids: Sequence[int]) -> int | None:
        """`output_ids` are all output tokens so far (one more than last call). Returns the index in `text`
        where a stop string starts, once one has appeared; then `text[:index]` is the final text."""
        prefix = self._decode(output_ids[self.prefix_offset : self.read_offset])
        full = self._decode(output_ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return None
        new = full[len(prefix) :]
        search_from = max(0, len(self.text) - self.longest + 1)
        self.text += new
        # The decoded tokens become the next window's left context, so a character split across the
        # boundary still decodes whole.
        self.prefix_offset, self.read_offset = self.read_offset, len(output_ids)
        found = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        return min(found) if found else None
