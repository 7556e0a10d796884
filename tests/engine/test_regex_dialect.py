r"""The regex meaning users expect: `\d`, `\w`, `\s` and their negations are ASCII classes, inside and outside
character classes, in `sampling.regex` and in a JSON schema's patterns; escapes, comments and data are left
alone; a word boundary is refused naming where it is. On random regexes the translation compiled by llguidance
matches exactly the strings Python's `re.fullmatch(pattern, text, re.ASCII)` matches."""

from __future__ import annotations

import json
import random
import re

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from batchjob.engine.api import Constraint
from batchjob.engine.grammar import GrammarError, check_constraint
from batchjob.engine.regex_dialect import RegexDialectError, ascii_regex, ascii_schema_text
from batchjob.job.tiny_model import default_tiny_model

NON_ASCII_DIGITS = "۱١꩒𐴵٣߁"


SPACES = r"\t\n\x0B\x0C\r\x1C-\x20\x85\p{Zs}\x{2028}\x{2029}\x{FEFF}"  # Python's and JavaScript's


@pytest.mark.parametrize(
    ("pattern", "translated"),
    [
        (r"[A-Z]{2}-\d{3,5}", r"[A-Z]{2}-[0-9]{3,5}"),
        (r"\w+", r"[0-9A-Za-z_]+"),
        (r"a\sb", r"a[\t\n\x0B\x0C\r\x20]b"),
    ],
)
def test_a_shorthand_outside_a_class_allows_its_ascii_characters(pattern, translated):
    assert ascii_regex(pattern) == translated


@pytest.mark.parametrize(
    ("pattern", "translated"),
    [(r"\D", r"[^\p{Nd}]"), (r"\W", r"[^\p{L}\p{N}_]"), (r"\S*", rf"[^{SPACES}]*")],
)
def test_a_negated_shorthand_keeps_out_every_character_any_dialect_counts_in_it(pattern, translated):
    assert ascii_regex(pattern) == translated


@pytest.mark.parametrize(
    ("pattern", "translated"),
    [
        (r"[\d.]", r"[0-9.]"),
        (r"[\D_]", r"[[^\p{Nd}]_]"),  # a negated shorthand is a nested class: the union stays a union
        (r"[\s\S]", rf"[\t\n\x0B\x0C\r\x20[^{SPACES}]]"),
        (r"[]\d]", r"[]0-9]"),  # a `]` first in a class is a literal
        (r"[[:alpha:]\d]", r"[[:alpha:]0-9]"),
        (r"[\w&&[^_]]", r"[0-9A-Za-z_&&[^_]]"),
    ],
)
def test_a_shorthand_inside_a_class_becomes_its_set(pattern, translated):
    assert ascii_regex(pattern) == translated


@pytest.mark.parametrize(
    ("pattern", "translated"),
    [
        (r"[^\d]", r"[^\p{Nd}]"),  # digits taken out: all of them, as with \D
        (r"[^\D]", r"[^[^0-9]]"),  # what is left is digits: ASCII ones, as with \d
        (r"[^\W]", r"[^[^0-9A-Za-z_]]"),
        (r"[a[^\d]]", r"[a[^\p{Nd}]]"),
        (r"[^[^\d]]", r"[^[^0-9]]"),
        (r"[\w--\d]", r"[0-9A-Za-z_--\p{Nd}]"),  # the right side of a difference is taken out
        (r"[^\w--\d]", r"[^\p{L}\p{N}_--0-9]"),
    ],
)
def test_a_shorthand_a_class_takes_out_keeps_out_all_its_characters(pattern, translated):
    assert ascii_regex(pattern) == translated


@pytest.mark.parametrize(
    ("pattern", "translated"),
    [
        (r"\\d", r"\\d"),  # a backslash, then d
        (r"\\\d", r"\\[0-9]"),
        (r"\p{Nd}\P{L}\pN", r"\p{Nd}\P{L}\pN"),  # asked-for Unicode classes stay Unicode
        (r"\x{64}\u{73}\x41", r"\x{64}\u{73}\x41"),
        (r"[\x{5c}d]", r"[\x{5c}d]"),
        (r"\.\[\d\]", r"\.\[[0-9]\]"),
    ],
)
def test_escapes_other_than_the_shorthands_are_kept(pattern, translated):
    assert ascii_regex(pattern) == translated


def test_a_hyphen_beside_a_shorthand_in_a_class_is_a_literal_hyphen():
    # `[\w-.]`, common in e-mail patterns: JavaScript reads the hyphen as itself (a range cannot end at a class).
    assert ascii_regex(r"[\w-.]") == r"[0-9A-Za-z_\-.]"
    assert ascii_regex(r"[.-\d]") == r"[.\-0-9]"
    assert ascii_regex(r"[\d-]") == r"[0-9-]"
    assert ascii_regex(r"[a-z\d]") == r"[a-z0-9]"  # a range before it is untouched


def test_a_backspace_class_stays_a_backspace():
    assert ascii_regex(r"[\b]") == r"[\x08]"


def test_under_case_insensitive_matching_a_word_class_keeps_to_ascii():
    # llguidance folds k with the Kelvin sign and s with the long s: \w must not take them in.
    assert ascii_regex(r"(?i)\w") == r"(?i)(?-i:[0-9A-Za-z_])"
    assert ascii_regex(r"(?i:a\w)\w") == r"(?i:a(?-i:[0-9A-Za-z_]))[0-9A-Za-z_]"
    assert ascii_regex(r"(?i)a(?-i)\w") == r"(?i)a(?-i)[0-9A-Za-z_]"
    assert ascii_regex(r"(?i)\W[^\w][\d.]") == r"(?i)[^\p{L}\p{N}_][^\p{L}\p{N}_][0-9.]"  # nothing to fold


def test_the_ascii_word_class_inside_a_class_under_case_insensitive_matching_is_refused_with_the_fix():
    with pytest.raises(RegexDialectError, match=r"\\w inside a character class under case-insensitive .* position 5"):
        ascii_regex(r"(?i)[\w.]")
    with pytest.raises(RegexDialectError, match=r"e\.g\. \(\?:\\w\|\[\.-\]\)"):
        ascii_regex(r"(?i:[^\W])")


def test_a_shorthand_in_a_class_with_a_symmetric_difference_is_refused():
    for pattern in (r"[\d~~5]", r"[5~~\d]", r"[a~~[^\s]]"):
        with pytest.raises(RegexDialectError, match=r"symmetric difference \(~~\)"):
            ascii_regex(pattern)


def test_comments_under_the_x_flag_hide_brackets_and_shorthands():
    # A `[` in a comment opens no class; a `#` inside a class under x opens a comment there too, as the crate reads it.
    assert ascii_regex("(?x) a # [ not a class\n \\d") == "(?x) a # [ not a class\n [0-9]"
    assert ascii_regex("(?x)[a #]\n\\d]") == "(?x)[a #]\n0-9]"
    assert ascii_regex("a#[\\d]") == "a#[0-9]"  # without x, # is a character


@pytest.mark.parametrize(("pattern", "position"), [(r"\bfoo", 0), (r"foo\b", 3), (r"a\Bb", 1), (r"(x\<y)", 2)])
def test_a_word_boundary_is_refused_naming_its_position(pattern, position):
    with pytest.raises(RegexDialectError, match=rf"a word boundary\) at position {position} .* no look-around"):
        ascii_regex(pattern)


def test_a_word_boundary_in_sampling_regex_fails_the_check_before_any_model_loads():
    with pytest.raises(GrammarError, match=r"regex cannot be compiled: \\b \(a word boundary\) at position 6"):
        check_constraint(Constraint("regex", r"[a-z]+\b"))


def test_a_syntax_error_is_reported_in_the_users_own_spelling():
    with pytest.raises(GrammarError, match=r"\\d\{3") as raised:
        check_constraint(Constraint("regex", r"\d{3"))
    assert "[0-9]" not in str(raised.value)


def test_every_pattern_of_a_schema_is_translated_and_its_data_is_not():
    schema = {
        "type": "object",
        "properties": {
            # A property named "pattern" is a name, its value a schema.
            "pattern": {"type": "string", "pattern": r"^\d+$"},
            "tags": {"type": "array", "items": {"type": "string", "pattern": r"^\w{2}$"}},
            "pair": {"type": "array", "prefixItems": [{"pattern": r"\s"}, {"anyOf": [{"pattern": r"\S"}]}]},
        },
        "patternProperties": {r"^x-\w+$": {"const": {"pattern": r"\d"}}},
        "$defs": {"code": {"pattern": r"^[\d-]+$", "enum": [r"\d"], "default": r"\w", "examples": [r"\s"]}},
        "x-guidance": {"key_separator": r"\s*:"},
    }
    translated = json.loads(ascii_schema_text(json.dumps(schema)))
    assert translated["properties"]["pattern"]["pattern"] == r"^[0-9]+$"
    assert translated["properties"]["tags"]["items"]["pattern"] == r"^[0-9A-Za-z_]{2}$"
    assert translated["properties"]["pair"]["prefixItems"][0]["pattern"] == r"[\t\n\x0B\x0C\r\x20]"
    assert translated["properties"]["pair"]["prefixItems"][1]["anyOf"][0]["pattern"] == rf"[^{SPACES}]"
    assert translated["patternProperties"] == {r"^x-[0-9A-Za-z_]+$": {"const": {"pattern": r"\d"}}}
    assert translated["$defs"]["code"] == {**schema["$defs"]["code"], "pattern": r"^[0-9-]+$"}
    assert translated["x-guidance"] == {"key_separator": r"[\t\n\x0B\x0C\r\x20]*:"}
    assert list(translated["properties"]) == ["pattern", "tags", "pair"]  # the order generation follows


def test_a_schema_without_shorthands_is_compiled_from_its_own_text():
    text = json.dumps({"type": "string", "pattern": "^[a-z]+$", "enum": ["a"]})
    assert ascii_schema_text(text) is text


def test_a_word_boundary_in_a_schema_is_refused_naming_the_patterns_place():
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": r"\bAda"}}}
    with pytest.raises(GrammarError, match=r"the pattern at /properties/name/pattern: \\b \(a word boundary\)"):
        check_constraint(Constraint("json_schema", json.dumps(schema)))


# Random regexes against Python's `re`. Strings are drawn from ASCII and from non-ASCII digits, letters and
# spaces (no Kelvin sign nor long s: under (?i) llguidance folds them with the regex's own k and s, Python's
# re.ASCII does not; what this checks is the shorthands).
ALPHABET = "aAbkKsSzZ059_-. \t\n\x0b\x0c\r\x1c\\dDwW" + NON_ASCII_DIGITS + "é\u00a0\u2028\x85\ufeffß"
# The one ASCII where Python's two modes differ: \x1c-\x1f are whitespace to its Unicode \s, so \S keeps them out.
SEPARATORS = set("\x1c\x1d\x1e\x1f")
LITERALS = ["a", "K", "s", "0", "5", "_", "-", " ", r"\.", r"\\", r"\\d", r"\\w", r"\\s"]
SHORTHANDS = [r"\d", r"\D", r"\w", r"\W", r"\s", r"\S"]
CLASS_ITEMS = ["a", "K", "0", "_", ".", " ", "a-f", "0-4", "A-Z", r"\\", r"\-"]


class RandomRegex:
    """A random regex in the syntax Python's `re` and llguidance share, with a sampler of strings it matches."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def atom(self, icase: bool) -> tuple[str, object]:
        kind = self.rng.choice(["literal", "shorthand", "class", "class", "dot"])
        if kind == "literal":
            text = self.rng.choice(LITERALS)
        elif kind == "shorthand":
            text = self.rng.choice(SHORTHANDS)
        elif kind == "dot":
            text = "."
        else:
            shorthands = [s for s in SHORTHANDS if not (icase and s[1] in "wW")]
            items = self.rng.choices(CLASS_ITEMS + shorthands * 2, k=self.rng.randint(1, 3))
            text = "[" + ("^" if self.rng.random() < 0.3 else "") + "".join(items) + "]"
        flags = re.IGNORECASE if icase else 0
        both = [c for c in ALPHABET if re.fullmatch(text, c, flags) and re.fullmatch(text, c, flags | re.ASCII)]
        members = both or list(ALPHABET)
        if text.startswith(r"\\"):  # two characters: a backslash and a letter
            return text, lambda: "\\" + (text[2:].swapcase() if icase and self.rng.random() < 0.5 else text[2:])
        return text, lambda: self.rng.choice(members)

    def node(self, depth: int, icase: bool) -> tuple[str, object]:
        roll = self.rng.random()
        if depth > 0 and roll < 0.3:
            opener = self.rng.choice(["(", "(?:", "(?i:"])
            inner_icase = icase or opener == "(?i:"
            branches = [self.sequence(depth - 1, inner_icase) for _ in range(self.rng.randint(1, 3))]
            text = opener + "|".join(b[0] for b in branches) + ")"
            # Bounded repetitions of groups only: Python's backtracking takes exponential time on `(a*)*`.
            return self.quantified(text, lambda: self.rng.choice(branches)[1](), unbounded=False)
        return self.quantified(*self.atom(icase))

    def quantified(self, text: str, sample, unbounded: bool = True) -> tuple[str, object]:
        choices = [(1, 1, ""), (0, 1, "?"), (2, 3, "{2,3}")] + ([(0, 3, "*"), (1, 3, "+")] if unbounded else [])
        low, high, suffix = self.rng.choice(choices)
        return text + suffix, lambda: "".join(sample() for _ in range(self.rng.randint(low, high)))

    def sequence(self, depth: int, icase: bool) -> tuple[str, object]:
        parts = [self.node(depth, icase) for _ in range(self.rng.randint(1, 4))]
        return "".join(p[0] for p in parts), lambda: "".join(p[1]() for p in parts)

    def strings(self, sample, n: int) -> list[str]:
        drawn = [sample() for _ in range(n)]
        mutated = []
        for s in drawn:
            chars = list(s)
            at = self.rng.randint(0, len(chars))
            if chars and self.rng.random() < 0.5:
                chars[min(at, len(chars) - 1)] = self.rng.choice(ALPHABET)
            else:
                chars.insert(at, self.rng.choice(ALPHABET))
            mutated.append("".join(chars))
        noise = ["".join(self.rng.choices(ALPHABET, k=self.rng.randint(0, 6))) for _ in range(n // 2)]
        return drawn + mutated + noise


@pytest.fixture(scope="module")
def accepts():
    tokenizer = AutoTokenizer.from_pretrained(default_tiny_model())
    index = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))

    def accepts(pattern: str):
        start = llguidance.LLMatcher(index, llguidance.grammar_from("regex", pattern), log_level=0)
        assert not start.is_error(), start.get_error()

        def matches(text: str) -> bool:
            matcher = start.deep_copy()
            return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

        return matches

    return accepts


@pytest.mark.parametrize("seed", range(6))
def test_translated_random_regexes_match_only_what_re_matches_in_both_modes_and_on_ascii_all_re_ascii_does(
    accepts, seed
):
    gen = RandomRegex(seed)
    compared = matched = other_matched = 0
    for _ in range(60):
        icase = gen.rng.random() < 0.15
        pattern, sample = gen.sequence(1, icase)
        pattern = "(?i)" + pattern if icase else pattern
        matches = accepts(ascii_regex(pattern))
        for text in gen.strings(sample, 8):
            got = matches(text)
            in_ascii = re.fullmatch(pattern, text, re.ASCII) is not None
            # What the translation accepts, Python's re accepts in both modes: no dialect rejects an output.
            assert not got or (in_ascii and re.fullmatch(pattern, text)), (pattern, ascii_regex(pattern), text)
            if text.isascii() and not SEPARATORS.intersection(text):
                assert got == in_ascii, (pattern, ascii_regex(pattern), text)
            other_matched += got and not text.isascii()
            compared += 1
            matched += got
    assert matched > compared / 5  # the sampled strings match often enough that both answers are tested
    assert other_matched > 0


def test_without_the_translation_llguidance_takes_non_ascii_digits(accepts):
    # What the translation is for: llguidance's own \d is Unicode's.
    assert all(accepts(r"\d")(d) for d in NON_ASCII_DIGITS)
    assert not any(accepts(ascii_regex(r"\d"))(d) for d in NON_ASCII_DIGITS)


def _counted(shorthand: str) -> list[str]:
    """Every character Python's re (Unicode classes) counts in `shorthand`'s class; JavaScript's spaces add the
    byte order mark; of Python's 133,548 word characters, every one below U+0800 and a sample of the rest."""
    chars = [chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000 and re.fullmatch(shorthand, chr(c))]
    if shorthand == r"\s":
        chars.append("\ufeff")
    if shorthand == r"\w":
        chars = [c for i, c in enumerate(chars) if ord(c) < 0x800 or i % 61 == 0]
    return chars


@pytest.mark.parametrize(
    ("shorthand", "negations"),
    [(r"\d", (r"\D", r"[^\d]", r"[^\d.]")), (r"\s", (r"\S", r"[^\s]")), (r"\w", (r"\W", r"[^\w]"))],
)
def test_a_negation_allows_no_character_python_or_javascript_counts_in_the_class(accepts, shorthand, negations):
    counted = _counted(shorthand)
    for negation in negations:
        matches = accepts(ascii_regex(negation))
        assert [c for c in counted if matches(c)] == [], negation
