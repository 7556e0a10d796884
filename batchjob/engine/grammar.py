"""Structured outputs through llguidance: constraints compiled once per distinct constraint, one matcher per
sample, token bitmasks filled in parallel off the GIL.

llguidance was chosen by measurement (docs/engine.md, docs/history/benchmarks-2026.md): on a 128k-token
vocabulary it was the one library whose every finished sample parsed with strict `json.loads` and validated,
with millisecond compiles and forced-token (jump-forward) support. A bitmask row holds one bit per vocabulary
id (int32 words, bit `i % 32` of word `i // 32`); a set bit allows the token.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from batchjob.engine.api import Constraint
from batchjob.engine.grammar_vocab import vocabulary_index
from batchjob.engine.regex_dialect import ascii_regex, ascii_schema_text
from batchjob.engine.transformers_import import load_tokenizer

if TYPE_CHECKING:
    import torch

# Distinct compiled constraints kept (per-row schemas can all differ; each entry holds matchers in their start
# state).
CACHE_ENTRIES = 256
# Advancing a step's matchers by their tokens: in llguidance's threads from this many rows (fewer are not worth
# a call to its thread pool), with at most this many threads.
PARALLEL_CONSUME_ROWS = 8
CONSUME_THREADS = 8


def mask_threads(threads: int = 0) -> int:
    """llguidance's threads for the bitmasks: `threads`, or with 0 the library's own default (80% of the CPUs
    this process may run on, at most 32), counted here so the engine knows it."""
    if threads > 0:
        return threads
    return max(1, min(32, len(os.sched_getaffinity(0)) * 80 // 100))


def lexers_per_constraint(threads: int) -> int:
    """Copies of a compiled constraint that do not share a lexer. llguidance's matchers copied from one share
    their lexer behind one lock, held for a whole mask: the rows of one constraint then fill their masks one at
    a time however many threads the library has (docs/engine.md, "Masks in parallel"). Rows draw from this many
    copies in turn, enough that two threads seldom want the same one; odd, so that the halves the library splits
    a step's rows into do not line up copy for copy."""
    return 4 * threads + 1


class GrammarError(ValueError):
    """A constraint that cannot compile (bad JSON schema feature, bad regex, bad grammar)."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def grammar_text(constraint: Constraint, translated: bool = True) -> str:
    """The llguidance grammar of `constraint` (not yet checked: `check_constraint` or `GrammarCompiler` does).
    A regex and a schema's patterns are `translated` first, `\\d`, `\\w` and `\\s` to ASCII (regex_dialect.py);
    raises ValueError for a construct that cannot be enforced."""
    from llguidance import LLMatcher, grammar_from

    if constraint.kind == "json_schema":
        options = {"whitespace_flexible": constraint.json_whitespace}
        schema = ascii_schema_text(constraint.text) if translated else constraint.text
        return LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if constraint.kind == "regex":
        return grammar_from("regex", ascii_regex(constraint.text) if translated else constraint.text)
    if constraint.kind == "grammar":
        # Lark, or GBNF (llama.cpp's syntax) converted to Lark.
        return grammar_from("grammar", constraint.text)
    return grammar_from(constraint.kind, constraint.text)


def _compile_error(constraint: Constraint, error: str) -> str:
    """llguidance's `error` for `constraint`'s grammar, in the terms of the text its user wrote: where the
    untranslated regex or schema fails too, its own error (which quotes `\\d{3`, not the `[0-9]{3` compiled)."""
    from llguidance import LLMatcher

    if constraint.kind not in ("regex", "json_schema"):
        return error
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar_text(constraint, translated=False))
    return messages[0] if is_error else error


def check_constraint(constraint: Constraint) -> None:
    """Raise `GrammarError` naming what is wrong if `constraint` cannot compile; needs no tokenizer."""
    from llguidance import LLMatcher

    try:
        grammar = grammar_text(constraint)
    except ValueError as err:
        raise GrammarError(f"{constraint.kind} cannot be compiled: {err}") from err
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(f"{constraint.kind} cannot be compiled: {_compile_error(constraint, messages[0])}")


class Matcher:
    """One sample's position in its constraint. `consume` returns False when the token is not allowed (the
    matcher is then in an error state, `error` says why). A matcher made while its compiled copy is still
    compiling (`compiling`, beside the run) waits for it at its first use, its first mask as a rule."""

    def __init__(self, inner: Any = None, compiling: Future | None = None) -> None:
        self._inner = inner
        self._compiling = compiling

    @property
    def inner(self) -> Any:
        """llguidance's matcher (only one thread at a time uses a sample's matcher: the first use resolves it)."""
        if self._inner is None:
            self._inner = self._compiling.result().deep_copy()
            self._compiling = None
        return self._inner

    def consume(self, token: int) -> bool:
        return self.inner.consume_token(token)

    def consume_forced(self, tokens: Sequence[int]) -> bool:
        return self.inner.consume_tokens(list(tokens))

    def forced_tokens(self) -> list[int]:
        """Tokens the constraint forces next, whatever the model says (a schema's keys and punctuation)."""
        return self.inner.compute_ff_tokens()

    @property
    def is_stopped(self) -> bool:
        """True once the constraint is complete and allows nothing but EOS."""
        return self.inner.is_stopped()

    @property
    def error(self) -> str:
        return self.inner.get_error()


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary size (the model's logits width, which may exceed the
    tokenizer's). Building the vocabulary's index takes seconds for a 128k vocabulary: an engine that may see
    constraints starts it beside its own start-up (`prepare_beside`), otherwise the first constrained request
    builds it."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        model_dir: str | None = None,
        threads: int = 0,
    ) -> None:
        """`tokenizer` None: an engine that does not detokenize has none; the first constrained request loads
        the one in `model_dir` (llguidance needs the tokens' bytes). `threads`: the library's threads for masks
        (0: `mask_threads`' default)."""
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.words = bitmask_words(vocab_size)
        self._lltokenizer = None
        self._executor = None
        self._consumer = None
        self._compiler: ThreadPoolExecutor | None = None  # compiles copies of shared constraints (`_Starts`)
        self._building = threading.Lock()  # one build of the vocabulary index, whichever thread asks first
        self._builder: threading.Thread | None = None
        # Per constraint: its grammar, its start-state matchers (each with a lexer of its own, up to `self.lexers`)
        # and how many matchers it has handed out.
        self._cache: OrderedDict[Constraint, _Starts] = OrderedDict()
        self.threads = mask_threads(threads)
        self.lexers = lexers_per_constraint(self.threads)
        self.compiled = 0  # distinct constraints compiled
        self.cache_hits = 0

    def prepare_beside(self, tokenizer: Future[Any] | None = None) -> None:
        """Build the vocabulary index in a background thread (with the tokenizer `tokenizer` resolves to, when
        given), so that the first constrained request does not wait for it."""

        def build() -> None:
            with self._building:
                if tokenizer is not None and self.tokenizer is None:
                    self.tokenizer = tokenizer.result()
            try:
                self._ensure_tokenizer()
            except Exception:  # noqa: BLE001 - the first constrained request builds it again and reports why
                return

        # Not a daemon: an interpreter that exits while the build runs inside the tokenizer libraries crashes.
        self._builder = threading.Thread(target=build, name="batchjob-grammar-vocab")
        self._builder.start()

    def close(self) -> None:
        """Wait for a vocabulary index still being built beside start-up, and for copies still compiling."""
        if self._builder is not None:
            self._builder.join()
            self._builder = None
        if self._compiler is not None:
            self._compiler.shutdown()
            self._compiler = None

    def _ensure_tokenizer(self):
        if self._lltokenizer is not None:
            return self._lltokenizer
        with self._building:
            if self._lltokenizer is None:
                if self.tokenizer is None:
                    self.tokenizer = load_tokenizer(self.model_dir)
                import llguidance

                # The index imports llguidance.hf, which imports transformers: after the tokenizer's load, which
                # imported it under the process's lock (transformers_import.py), it finds it imported.
                self._lltokenizer = vocabulary_index(self.tokenizer, self.vocab_size, self.eos_token_ids)
                self._executor = llguidance.LLExecutor(self.threads)
                self._consumer = llguidance.LLExecutor(min(self.threads, CONSUME_THREADS))
        return self._lltokenizer

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh matcher for `constraint`; raises `GrammarError` if it cannot compile, or if the vocabulary
        index cannot be built for this model (then every constrained request fails alike, each with the reason)."""
        from llguidance import LLMatcher

        starts = self._cache.get(constraint)
        if starts is not None:
            self._cache.move_to_end(constraint)
            self.cache_hits += 1
        else:
            try:
                lltokenizer = self._ensure_tokenizer()
            except ValueError as err:
                raise GrammarError(f"structured outputs cannot run with this model's tokenizer: {err}") from err
            try:
                grammar = grammar_text(constraint)
            except ValueError as err:
                raise GrammarError(f"{constraint.kind} cannot be compiled: {err}") from err
            start = LLMatcher(lltokenizer, grammar, log_level=0)
            if start.is_error():
                raise GrammarError(
                    f"{constraint.kind} cannot be compiled: {_compile_error(constraint, start.get_error())}"
                )
            self.compiled += 1
            starts = self._cache[constraint] = _Starts(grammar, [start])
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(self.threads, thread_name_prefix="batchjob-grammar-compile")
        return starts.next(self.lexers, self._lltokenizer, self._compiler)

    def fill_bitmasks(
        self,
        matchers: Sequence[tuple[Matcher, int]],
        bitmask: torch.Tensor,
        entering: Callable[[], None] | None = None,
    ) -> None:
        """Fill row `i` of the contiguous int32 CPU tensor `bitmask` for each `(matcher, i)`, in parallel threads.
        `entering` is called last before the library's call, which runs without the GIL."""
        if not matchers:
            if entering is not None:
                entering()
            return
        self._ensure_tokenizer()
        rows, words = bitmask.shape
        pairs = [(m.inner, i) for m, i in matchers]
        if entering is not None:
            entering()
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, rows)

    def advance(self, pairs: Sequence[tuple[Matcher, int]]) -> list[tuple[bool, bool, str]]:
        """`consume`, then for each matcher whether it accepted its token, whether its constraint is complete,
        and its error if it refused the token: all a step's processing needs of its matchers."""
        accepted = self.consume(pairs)
        return [(ok, m.is_stopped, "" if ok else m.error) for ok, (m, _) in zip(accepted, pairs, strict=True)]

    def consume(self, pairs: Sequence[tuple[Matcher, int]]) -> list[bool]:
        """Advance each matcher by its token; False where the token was not allowed. A token takes several
        microseconds with the GIL held (6.5 us a row on the benchmark's schema), so a step's rows go to
        llguidance's threads in one call, off the GIL: an executor of their own, since the masks' executor may be
        filling another step's rows (`engine.constrained_lag`) and a call would queue behind them."""
        if len(pairs) < PARALLEL_CONSUME_ROWS or self._consumer is None:
            return [m.inner.consume_token(t) for m, t in pairs]
        return self._consumer.consume_token_par([(m.inner, t) for m, t in pairs])


class _Starts:
    """A compiled constraint's matchers in their start state, each with a lexer of its own, handed out in turn; more
    are compiled (1.2-2.2 ms each for the benchmark's JSON schema) until there are as many as asked for. Whenever
    every copy has been handed out, as many again start compiling in `pool`'s threads (llguidance compiles
    without the GIL), so a constraint of a few rows stays a few compiles; a row given a copy still compiling
    gets a matcher that waits for it at its first use. A constraint that every row shares thus never holds up
    admission: its 49 copies were 50 ms of compiles in rounds before the first step, in the loop's thread; now
    they compile while the first steps run, which need the masks of only a few rows."""

    def __init__(self, grammar: str, matchers: list[Any]) -> None:
        self.grammar = grammar
        self.matchers: list[Any] = matchers  # compiled matchers, or futures of those still compiling
        self.handed = 0

    def next(self, count: int, lltokenizer: Any, pool: ThreadPoolExecutor) -> Matcher:
        k = self.handed % count
        self.handed += 1
        if k == len(self.matchers):
            self._grow(min(len(self.matchers), count - k), lltokenizer, pool)
        start = self.matchers[k]
        if isinstance(start, Future):
            if not start.done():
                return Matcher(compiling=start)
            start = self.matchers[k] = start.result()
        return Matcher(start.deep_copy())

    def _grow(self, n: int, lltokenizer: Any, pool: ThreadPoolExecutor) -> None:
        from llguidance import LLMatcher

        self.matchers.extend(pool.submit(LLMatcher, lltokenizer, self.grammar, log_level=0) for _ in range(n))
