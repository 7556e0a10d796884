r"""Regular expressions of constraints (`sampling.regex`, a JSON schema's `pattern`s) in the meaning their users
give them, rewritten into the grammar library's dialect before it compiles them.

llguidance reads a regex as Rust's `regex` crate does: `\d`, `\w` and `\s` are Unicode classes (`\d` allows
'۱' and '꩒', `\s` a no-break space), of a newer Unicode than Python's. Users mean `[0-9]`, `[0-9A-Za-z_]` and
`[\t\n\v\f\r ]`, as Python's `re` with `re.ASCII` and JSON Schema's ECMA-262 (for `\d` and `\w`) do. So:

- `\d`, `\w` and `\s` allow those ASCII characters only;
- `\D`, `\W` and `\S` allow no character that any of those dialects counts as a digit, word character or
  whitespace: Python's `re` without re.ASCII (Unicode's Nd; letters and numbers; Python's and JavaScript's
  spaces), so that `\D` never writes '۱' nor `\S` a no-break space.

An output then matches its pattern with Python's `re`, with re.ASCII or without, and under ECMA-262; on ASCII text
the translation accepts exactly what `re.fullmatch(pattern, text, re.ASCII)` does. Inside a character class a
shorthand counts by what it does to the class's characters: in `[^\d]` the digits are taken out, as with `\D`,
so all of Unicode's are; in `[^\D]` they are what is left, ASCII ones. A negated shorthand in a class is a nested
class (`[\D_]` -> `[[^\p{Nd}]_]`).

Under case-insensitive matching (`(?i)`) llguidance folds letters as Unicode does (the Kelvin sign K with k, the
long s ſ with s): `\w` there becomes `(?-i:[0-9A-Za-z_])`; where the ASCII word class would stand inside a
character class no such group can be written, and the construct is refused, as is a shorthand in a class with the
crate's symmetric difference `~~` (both inside and outside what it allows).

Other readings that differ from Python's and JSON Schema's: `[\b]` (a backspace there) becomes `\x08`, which the
crate refuses; a hyphen beside a shorthand inside a class (`[\w-.]`) is a literal hyphen, as in JavaScript
(the crate refuses it as a range). A word boundary (`\b`, `\B`, `\<`, `\>`) cannot be enforced, llguidance
having no look-around: it is refused naming its position. Everything else (`\p{..}` classes, which stay
Unicode, flags, repetitions, the class operators `&&` and `--`) passes through unchanged, so an error in it is
still the library's to report.

A scanner of escapes, character classes and groups (with their `i` and `x` flags), not a full parser: it only
has to know, at each backslash, whether it stands inside a class, on which side of its negations, and under which
flags. llguidance's own `regex_to_lark(regex, "dws")` spells the shorthands ASCII both ways, and knows nothing of
the case folding, `[\b]`, the hyphens or the `x` flag's comments.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

# What each shorthand's letter allows (\x0B and \x0C for \v and \f; \x20 for the space, which a class under the
# `x` flag would ignore), and what its negation keeps out: all that Python's re (Unicode 14 in Python 3.11; the
# crate's Unicode is newer, its classes larger) or ECMA-262 counts in it.
ASCII_SETS = {"d": "0-9", "w": "0-9A-Za-z_", "s": r"\t\n\x0B\x0C\r\x20"}
UNICODE_SETS = {
    "d": r"\p{Nd}",
    "w": r"\p{L}\p{N}_",
    "s": r"\t\n\x0B\x0C\r\x1C-\x20\x85\p{Zs}\x{2028}\x{2029}\x{FEFF}",
}
WORD_BOUNDARIES = "bB<>"
# Escapes that may take a braced argument: \p{Greek}, \x{10FFFF}, \u{1F600}.
BRACED_ESCAPES = "pPxuU"
_ASCII_CLASS = re.compile(r"\[:\^?[a-z]+:\]")
_FLAGS = re.compile(r"\?([imsUuxR]*)(?:-([imsUuxR]*))?([:)])")


class RegexDialectError(ValueError):
    """A regex construct whose meaning the grammar library cannot give (a word boundary, `\\w` in a class under
    case-insensitive matching)."""


@functools.lru_cache(maxsize=256)
def ascii_regex(pattern: str) -> str:
    r"""`pattern` with `\d \D \w \W \s \S` spelt as explicit classes for llguidance, ASCII where they allow
    characters; raises `RegexDialectError` naming a construct it cannot enforce."""
    return _Translation(pattern).text()


class _Translation:
    """One pass over a pattern: `out` collects the translated text; `flags` holds the case-insensitive (`i`) and
    whitespace-ignoring (`x`) flags of each open group, innermost last."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.at = 0
        self.out: list[str] = []
        self.flags: list[frozenset[str]] = [frozenset()]

    def text(self) -> str:
        p = self.pattern
        while self.at < len(p):
            c = p[self.at]
            if c == "\\":
                self._escape()
            elif c == "[":
                self._class(negative=False)
            elif c == "(":
                self._open_group()
            elif c == ")":
                if len(self.flags) > 1:
                    self.flags.pop()
                self._take(1)
            elif c == "#" and "x" in self.flags[-1]:
                self._comment()
            else:
                self._take(1)
        return "".join(self.out)

    def _take(self, n: int) -> str:
        taken = self.pattern[self.at : self.at + n]
        self.out.append(taken)
        self.at += n
        return taken

    def _escape_length(self) -> int:
        """Characters of the escape at `self.at`: two, or through the closing brace of `\\p{...}`-like ones."""
        p, at = self.pattern, self.at
        if p[at + 1 : at + 2] in tuple(BRACED_ESCAPES) and p[at + 2 : at + 3] == "{":
            end = p.find("}", at + 3)
            return len(p) - at if end < 0 else end + 1 - at
        return min(2, len(p) - at)

    def _refuse(self, what: str, fix: str) -> None:
        shown = f"'{self.pattern}'" if self.pattern.isprintable() else repr(self.pattern)
        raise RegexDialectError(f"{what} at position {self.at} of {shown} {fix}")

    def _escape(self) -> None:
        letter = self.pattern[self.at + 1 : self.at + 2]
        if letter and letter in WORD_BOUNDARIES:
            self._refuse(
                f"\\{letter} (a word boundary)",
                "is not supported: the grammar library has no look-around; remove it, or match the characters on "
                "either side of it (a word character [0-9A-Za-z_] beside a non-word one)",
            )
        if letter and letter.lower() in ASCII_SETS:
            chars, ascii_word = self._shorthand_set(letter, negative=False)
            spelt = f"[{chars}]" if letter.islower() else f"[^{chars}]"
            if ascii_word and "i" in self.flags[-1]:
                # Case folding would add the Kelvin sign and the long s to the class's k and s.
                spelt = f"(?-i:{spelt})"
            self.out.append(spelt)
            self.at += 2
            return
        self._take(self._escape_length())

    @staticmethod
    def _shorthand_set(letter: str, negative: bool) -> tuple[str, bool]:
        """The characters spelling shorthand `letter` where its set takes characters out of what the regex allows
        (`negative`: inside a negated class) or not, and whether they are the ASCII word class. The ASCII set
        where the shorthand ends up allowing its characters (`\\d` allowing, or `\\D` taking out, digits), else
        the Unicode one."""
        kind = letter.lower()
        if letter.islower() != negative:
            return ASCII_SETS[kind], kind == "w"
        return UNICODE_SETS[kind], False

    def _comment(self) -> None:
        end = self.pattern.find("\n", self.at)
        self._take((len(self.pattern) if end < 0 else end + 1) - self.at)

    def _open_group(self) -> None:
        flags = self.flags[-1]
        found = _FLAGS.match(self.pattern, self.at + 1)
        if found is None:
            self.flags.append(flags)
            self._take(1)
            return
        on, off, end = found.groups()
        changed = (flags | set(on)) - set(off or "")
        if end == ")":
            self.flags[-1] = frozenset(changed)  # till the end of the enclosing group
        else:
            self.flags.append(frozenset(changed))
        self._take(found.end() - self.at)

    def _class(self, negative: bool | None) -> bool:
        """A character class from its `[` through its `]`, nested classes included; True if it holds a shorthand.
        `negative`: whether the class's own characters are taken out of what the regex allows (it stands inside
        an odd number of negations), None where that is both (an operand of `~~`). `last` is what the class
        holds so far: "start", "item", "operator" (`&&`, `--`, `~~`) or "hyphen" (a `-` after an item, which
        makes a range of it and the next item)."""
        p = self.pattern
        self._take(1)
        if p.startswith("^", self.at):
            self._take(1)
            negative = None if negative is None else not negative
        if p.startswith("]", self.at):
            self._take(1)  # a `]` first is a literal
        last = "item" if self.out[-1] == "]" else "start"
        items_negative = negative  # after a difference `--`, its right side's characters are taken out
        hyphen_at = -1
        shorthands = False
        while self.at < len(p):
            c = p[self.at]
            if "x" in self.flags[-1] and c.isspace():
                self._take(1)
            elif "x" in self.flags[-1] and c == "#":
                self._comment()
            elif c == "]":
                self._take(1)
                return shorthands
            elif c == "[":
                found = _ASCII_CLASS.match(p, self.at)
                if found is None:
                    shorthands |= self._class(items_negative)
                else:
                    self._take(found.end() - self.at)
                last = "item"
            elif c == "\\":
                letter = p[self.at + 1 : self.at + 2]
                if letter and letter.lower() in ASCII_SETS:
                    if last == "hyphen":
                        self.out[hyphen_at] = "\\-"  # a range cannot end at a class: a literal hyphen
                    self._shorthand_in_class(letter, items_negative)
                    shorthands = True
                elif letter == "b":
                    self.out.append("\\x08")  # a backspace, as in Python and JSON Schema
                    self.at += 2
                else:
                    self._take(self._escape_length())
                last = "item"
            elif p.startswith(("&&", "--", "~~"), self.at):
                if p.startswith("~~", self.at):
                    if shorthands:
                        self._refuse_symmetric_difference()
                    items_negative = None
                elif p.startswith("--", self.at) and items_negative is not None:
                    items_negative = not negative
                self._take(2)
                last = "operator"
            elif c == "-" and last == "item":
                hyphen_at = len(self.out)
                self._take(1)
                last = "hyphen"
            else:
                self._take(1)
                last = "item"
        return shorthands

    def _refuse_symmetric_difference(self) -> None:
        self._refuse(
            "a shorthand (\\d, \\w, \\s) in a character class with a symmetric difference (~~)",
            "cannot keep to ASCII: its characters are both allowed and taken out; write the class without ~~",
        )

    def _shorthand_in_class(self, letter: str, negative: bool | None) -> None:
        if negative is None:
            self._refuse_symmetric_difference()
        chars, ascii_word = self._shorthand_set(letter, negative)
        if ascii_word and "i" in self.flags[-1]:
            self._refuse(
                f"\\{letter} inside a character class under case-insensitive matching ((?i))",
                "cannot keep to ASCII: the grammar library's case folding would add the Kelvin sign and the long "
                "s; write the class as an alternation outside it, e.g. (?:\\w|[.-]) for [\\w.-]",
            )
        self.out.append(chars if letter.islower() else f"[^{chars}]")
        self.at += 2
        p = self.pattern
        if p.startswith("-", self.at) and not p.startswith(("--", "-]"), self.at):
            self.out.append("\\-")  # a range cannot start at a class: a literal hyphen
            self.at += 1


# Where a JSON schema holds schemas: keywords whose value is a schema or a list of them, and keywords whose value
# is an object of them by name. Other values (`const`, `enum`, `default`, `examples`) are data, never translated.
SUBSCHEMA_KEYWORDS = frozenset(
    (
        "additionalProperties", "additionalItems", "items", "prefixItems", "contains", "propertyNames", "not",
        "if", "then", "else", "allOf", "anyOf", "oneOf", "unevaluatedItems", "unevaluatedProperties",
    )
)  # fmt: skip
SCHEMA_MAP_KEYWORDS = frozenset(
    ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
)
# llguidance's options that are regexes (the schema's top-level "x-guidance" object).
GUIDANCE_REGEX_OPTIONS = ("item_separator", "key_separator", "whitespace_pattern")


@functools.lru_cache(maxsize=64)
def ascii_schema_text(text: str) -> str:
    """The JSON schema `text` with every `pattern`, `patternProperties` name and llguidance regex option
    translated by `ascii_regex` (values in `const`, `enum`, `default` and `examples` are data, kept as they are);
    `text` itself when nothing changes. Raises `RegexDialectError` naming the pattern's place in the schema."""
    schema = json.loads(text)
    translated = _ascii_schema(schema, "")
    if isinstance(translated, dict) and isinstance(translated.get("x-guidance"), dict):
        options = translated["x-guidance"] = dict(translated["x-guidance"])
        for key in GUIDANCE_REGEX_OPTIONS:
            if isinstance(options.get(key), str):
                options[key] = _ascii_at(options[key], f"/x-guidance/{key}")
    return text if translated == schema else json.dumps(translated, ensure_ascii=False, separators=(",", ":"))


def _ascii_at(pattern: str, where: str) -> str:
    try:
        return ascii_regex(pattern)
    except RegexDialectError as err:
        raise RegexDialectError(f"the pattern at {where or '/'}: {err}") from None


def _ascii_schema(schema: Any, where: str) -> Any:
    if isinstance(schema, list):  # `items` of the drafts before 2020-12 may be a list of schemas
        return [_ascii_schema(s, f"{where}/{i}") for i, s in enumerate(schema)]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("pattern"), str):
        out["pattern"] = _ascii_at(out["pattern"], f"{where}/pattern")
    for key in SUBSCHEMA_KEYWORDS.intersection(out):
        out[key] = _ascii_schema(out[key], f"{where}/{key}")
    for key in SCHEMA_MAP_KEYWORDS.intersection(out):
        if isinstance(out[key], dict):
            place = f"{where}/{key}"
            out[key] = {_name(key, n, place): _ascii_schema(s, f"{place}/{n}") for n, s in out[key].items()}
    return out


def _name(keyword: str, name: str, place: str) -> str:
    """A property name of `keyword`'s object: a regex for `patternProperties`, else a plain name."""
    return _ascii_at(name, f"{place} (the name {name!r})") if keyword == "patternProperties" else name
