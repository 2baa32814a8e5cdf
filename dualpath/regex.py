"""Regular expressions as byte automata, for output that must match a pattern in full (vLLM's ``guided_regex``
and ``guided_choice``).

``Regex(pattern)`` parses the pattern into sets of code points, spells each set as the UTF-8 byte sequences of its
characters, and builds the position (Glushkov) automaton over bytes: one position per byte class, no empty moves,
so a configuration is a position and a state is a set of them (``dualpath.grammar`` follows every position at
once). Positions from which no accepting position can be reached are pruned at compile time, so every state a
generation can be in has a way to finish.

Syntax: Python's ``re`` for what a generation can be held to — literals and escapes (``\\n``, ``\\t``, ``\\xhh``,
``\\uhhhh``, ``\\.``, ...), ``.`` (any character but a newline), classes (``[a-z_]``, ``[^"\\\\]``), ``\\d \\w \\s``
and their negations with ASCII meanings (``[0-9]``, ``[A-Za-z0-9_]``, whitespace: ``re.ASCII``), groups
(``(...)``, ``(?:...)``, ``(?P<name>...)``), ``|``, the quantifiers ``* + ? {m} {m,} {,n} {m,n}`` (lazy ones
too: the language is the same), and ``^``/``\\A`` at the start and ``$``/``\\Z`` at the end (the output always
matches whole); ``(?<name>...)`` too, as JSON Schema's patterns (ECMA-262) write named groups; the inline flags
``i`` (ASCII letters in either case, as ``re.ASCII | re.IGNORECASE``), ``s`` (``.`` takes newlines), ``m`` and ``a``,
for the whole pattern (``(?i)`` at its start) or a group (``(?i:...)``, ``(?-i:...)``). What would need more than a
finite automaton or changes matching (back-references, look-arounds, ``\\b``, the flags ``x``, ``u`` and ``L``,
atomic groups, possessive quantifiers) is a ``RegexError``, never silently dropped.
"""
from __future__ import annotations

import re
from typing import Sequence

from dualpath.errors import RequestError

MAX_CHAR = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)  # not characters: UTF-8 never encodes them
MAX_PATTERN_CHARS = 65536
MAX_POSITIONS = 20000  # byte classes after expanding repeats: the compiled size (a {m,n} copies its body n times)
MAX_REPEAT = 1000
MAX_NESTING = 32  # groups inside groups (compiling recurses once per level)

DIGIT = ((0x30, 0x39),)
WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
SPACE = ((0x09, 0x0D), (0x20, 0x20))
ANY_BUT_NEWLINE = ((0, 0x09), (0x0B, MAX_CHAR))
CLASS_ESCAPES = {"d": DIGIT, "w": WORD, "s": SPACE}
CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a", "0": "\0"}
HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}


class RegexError(RequestError):
    """A pattern this automaton cannot enforce, or that is not a pattern."""

    def __init__(self, message: str, field: str = "regex"):
        super().__init__(f"regex: {message}", field=field)


# --- character sets: sorted, disjoint, non-adjacent (lo, hi) code point ranges ---------------------------------
def normalized(ranges) -> tuple:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def complement(ranges) -> tuple:
    out, at = [], 0
    for lo, hi in normalized(ranges):
        if lo > at:
            out.append((at, lo - 1))
        at = hi + 1
    if at <= MAX_CHAR:
        out.append((at, MAX_CHAR))
    return out


def without_surrogates(ranges) -> tuple:
    lo_s, hi_s = SURROGATES
    out = []
    for lo, hi in ranges:
        if lo < lo_s:
            out.append((lo, min(hi, lo_s - 1)))
        if hi > hi_s:
            out.append((max(lo, hi_s + 1), hi))
    return tuple(out)


# --- UTF-8: a range of code points as sequences of byte ranges ---------------------------------------------------
UTF8_LENGTH_ENDS = (0x7F, 0x7FF, 0xFFFF, MAX_CHAR)


def utf8_sequences(lo: int, hi: int) -> list[tuple]:
    """The byte sequences of the characters ``lo..hi`` (no surrogates), each a tuple of ``(first, last)`` byte
    ranges: every combination of bytes in the ranges is one of those characters, and each character is one
    combination."""
    out = []
    start = 0
    for end in UTF8_LENGTH_ENDS:  # one encoded length at a time
        a, b = max(lo, start), min(hi, end)
        if a <= b:
            _split(a, b, out)
        start = end + 1
    return out


def _split(a: int, b: int, out: list) -> None:
    """Cut ``a..b`` (one encoded length) until each piece's continuation bytes each run over a whole range."""
    n = len(chr(a).encode("utf-8"))
    for i in range(1, n):
        m = (1 << (6 * i)) - 1  # the low bits that i continuation bytes carry
        if a & ~m != b & ~m:
            if a & m:
                _split(a, a | m, out)
                _split((a | m) + 1, b, out)
                return
            if b & m != m:
                _split(a, (b & ~m) - 1, out)
                _split(b & ~m, b, out)
                return
    out.append(tuple(zip(chr(a).encode("utf-8"), chr(b).encode("utf-8"))))


def byte_mask(lo: int, hi: int) -> int:
    return ((1 << (hi + 1)) - 1) ^ ((1 << lo) - 1)


# --- parsing: pattern -> tree over character sets ------------------------------------------------------------
# ("set", ranges) | ("cat", items: empty for the empty string) | ("alt", branches) | ("repeat", body, least, most)


class _Parser:
    def __init__(self, pattern: str):
        self.p, self.i, self.depth = pattern, 0, 0
        self.flags = frozenset()  # inline flags in force: "i" (ASCII letters either case), "s" (. takes newlines)
        self.start = 0  # where the pattern proper begins (after global flags): where ^ may stand

    def parse(self):
        tree = self.alternation()
        if self.i < len(self.p):
            raise RegexError(f"unbalanced parenthesis at position {self.i}")
        return tree

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def take(self) -> str:
        if self.i >= len(self.p):
            raise RegexError("the pattern ends early")
        c = self.p[self.i]
        self.i += 1
        return c

    def alternation(self):
        branches = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else ("alt", tuple(branches))

    def sequence(self):
        items = []
        while self.peek() not in (None, "|", ")"):
            at = self.i
            atom = self.atom()
            if atom is not None:
                items.append(self.quantified(atom))
            elif self.peek() in ("*", "+", "?"):
                raise RegexError(f"nothing to repeat at position {at}")
        return items[0] if len(items) == 1 else ("cat", tuple(items))

    def atom(self):
        """The next atom, or None for an anchor (the output matches whole: only at the pattern's ends)."""
        at, c = self.i, self.take()
        if c == "(":
            return self.group()
        if c == "[":
            return ("set", self.char_class())
        if c == ".":
            return ("set", ((0, MAX_CHAR),) if "s" in self.flags else ANY_BUT_NEWLINE)
        if c in "^$":
            self.anchor(c, at)
            return None
        if c in "*+?":
            raise RegexError(f"nothing to repeat at position {at}")
        if c == "{" and self.bounds_ahead(at):
            raise RegexError(f"nothing to repeat at position {at}")
        if c == "\\":
            return self.escape(at)
        return ("set", self.cased(((ord(c), ord(c)),)))

    def anchor(self, c: str, at: int) -> None:
        end = at + (1 if c in "^$" else 2)
        if (c in "^A" and at == self.start) or (c in "$Z" and end == len(self.p)):
            return
        raise RegexError(f"'{self.p[at:end]}' only at the pattern's {'start' if c in '^A' else 'end'} (the output "
                         f"matches the pattern whole)")

    def group(self):
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise RegexError(f"groups are nested more than {MAX_NESTING} deep")
        if self.p.startswith("?:", self.i):
            self.i += 2
        elif self.p.startswith("?P<", self.i) or (self.p.startswith("?<", self.i) and
                                                   self.p[self.i + 2:self.i + 3] not in ("=", "!")):
            start = self.i + (3 if self.p[self.i + 1] == "P" else 2)  # (?<name>...): JSON Schema's (ECMA) form
            close = self.p.find(">", self.i)
            if close < 0 or not self.p[start:close].isidentifier():
                raise RegexError(f"bad group name at position {self.i}")
            self.i = close + 1
        elif self.p.startswith("?#", self.i):
            close = self.p.find(")", self.i)
            if close < 0:
                raise RegexError("unterminated comment")
            self.i = close + 1
            self.depth -= 1
            return None
        elif self.peek() == "?" and self.p[self.i + 1:self.i + 2] in set("aiLmsux-"):
            return self.inline_flags(self.i - 1)
        elif self.peek() == "?":
            kinds = {"?=": "look-ahead", "?!": "look-ahead", "?<": "look-behind", "?P=": "back-reference",
                     "?>": "atomic group", "?(": "conditional"}
            kind = next((k for s, k in kinds.items() if self.p.startswith(s, self.i)), "inline flags")
            raise RegexError(f"{kind} at position {self.i - 1} is not supported (a finite automaton cannot "
                             f"follow it, or it changes matching)")
        tree = self.alternation()
        if self.peek() != ")":
            raise RegexError("missing ), unterminated group")
        self.i += 1
        self.depth -= 1
        return tree

    def quantified(self, atom):
        c = self.peek()
        if c is None or c not in "*+?{":
            return atom
        at = self.i
        if c == "{":
            if not self.bounds_ahead(at):
                return atom  # a literal brace, as in Python
            least, most = self.bounds()
        else:
            self.i += 1
            least, most = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        if self.peek() == "?":
            self.i += 1  # lazy: the same language
        elif self.peek() == "+":
            raise RegexError(f"possessive quantifier at position {self.i} is not supported")
        if self.peek() is not None and (self.peek() in "*+?" or (self.peek() == "{" and self.bounds_ahead(self.i))):
            raise RegexError(f"multiple repeat at position {self.i}")
        if most is not None and least > most:
            raise RegexError(f"min repeat greater than max repeat at position {at}")
        if max(least, most or 0) > MAX_REPEAT:
            raise RegexError(f"repeat counts above {MAX_REPEAT} are not supported (position {at})")
        return ("repeat", atom, least, most)

    def bounds_ahead(self, at: int) -> bool:
        close = self.p.find("}", at)
        if close < 0:
            return False
        body = self.p[at + 1:close]
        lo, comma, hi = body.partition(",")
        return (lo.isdigit() or (comma and not lo)) and (not hi or hi.isdigit()) and body not in ("", ",") \
            and body.isascii()

    def bounds(self) -> tuple[int, int | None]:
        close = self.p.find("}", self.i)
        lo, comma, hi = self.p[self.i + 1:close].partition(",")
        self.i = close + 1
        least = int(lo) if lo else 0
        return least, (int(hi) if hi else None) if comma else least

    def escape(self, at: int):
        c = self.take()
        if c in "AZ":
            self.anchor(c, at)
            return None
        return ("set", self.cased(self.class_escape(c, at)))

    def class_escape(self, c: str, at: int, in_class: bool = False) -> tuple:
        """The code points of ``\\c`` (its backslash at ``at``)."""
        if c.lower() in CLASS_ESCAPES:
            ranges = CLASS_ESCAPES[c.lower()]
            return normalized(complement(ranges)) if c.isupper() else ranges
        return ((self.char_escape(c, at, in_class),) * 2,)

    def char_escape(self, c: str, at: int, in_class: bool) -> int:
        if c in HEX_ESCAPES:
            digits = self.p[self.i:self.i + HEX_ESCAPES[c]]
            if len(digits) != HEX_ESCAPES[c] or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise RegexError(f"bad escape \\{c} at position {at}")
            self.i += len(digits)
            value = int(digits, 16)
            if value > MAX_CHAR:
                raise RegexError(f"bad escape \\{c}{digits} at position {at}")
            return value
        if c == "b" and in_class:
            return 0x08
        if c in CHAR_ESCAPES and not (c == "0" and self.peek() is not None and self.peek().isdigit()):
            return ord(CHAR_ESCAPES[c])
        if c.isdigit():
            raise RegexError(f"back-reference or octal escape \\{c} at position {at} is not supported")
        if c.isascii() and c.isalpha():
            what = "word boundaries" if c in "bB" else "this escape"
            raise RegexError(f"\\{c} at position {at}: {what} not supported")
        return ord(c)

    def char_class(self) -> tuple:
        start = self.i - 1
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        ranges, first = [], True
        while True:
            if self.peek() is None:
                raise RegexError(f"unterminated character set at position {start}")
            if self.peek() == "]" and not first:
                self.i += 1
                break
            first = False
            lo = self.class_item()
            if self.peek() == "-" and self.p[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self.class_item()
                if len(lo) != 1 or len(hi) != 1 or lo[0][0] != lo[0][1] or hi[0][0] != hi[0][1]:
                    raise RegexError(f"bad character range at position {self.i}")
                if hi[0][0] < lo[0][0]:
                    raise RegexError(f"bad character range {chr(lo[0][0])}-{chr(hi[0][0])}")
                ranges.append((lo[0][0], hi[0][0]))
            else:
                ranges.extend(lo)
        ranges = self.cased(ranges)  # before the negation, as Python: (?i)[^a] takes neither a nor A
        return normalized(complement(ranges) if negate else ranges)

    def cased(self, ranges) -> tuple:
        """``ranges`` with the other case of their ASCII letters under the ``i`` flag (ASCII semantics, as
        ``re.ASCII | re.IGNORECASE``)."""
        if "i" not in self.flags:
            return tuple(ranges)
        out = list(ranges)
        for lo, hi in ranges:
            for first, last, shift in ((0x41, 0x5A, 32), (0x61, 0x7A, -32)):
                a, z = max(lo, first), min(hi, last)
                if a <= z:
                    out.append((a + shift, z + shift))
        return normalized(out)

    def inline_flags(self, at: int):
        """``(?flags)`` at the pattern's start (for all of it) or ``(?flags-flags:...)`` (for the group); the
        flags that keep a finite automaton's meaning: i, s, m (anchors are only at the ends), a (already)."""
        end = self.i + 1
        while end < len(self.p) and self.p[end] not in ":)":
            end += 1
        on, _, off = self.p[self.i + 1:end].partition("-")
        if end >= len(self.p) or not (on + off).isalpha():
            raise RegexError(f"bad inline flags at position {at}")
        unknown = set(on + off) - set("isma")
        if unknown:
            raise RegexError(f"inline flag {''.join(sorted(unknown))} at position {at} is not supported (i, s, m "
                             f"and a are)")
        self.i = end + 1
        if self.p[end] == ")":
            if at != self.start or off:
                raise RegexError(f"global flags only at the pattern's start, at position {at}")
            self.flags |= set(on)
            self.start = self.i
            self.depth -= 1
            return None
        outer, self.flags = self.flags, (self.flags | set(on)) - set(off)
        tree = self.alternation()
        self.flags = outer
        if self.peek() != ")":
            raise RegexError("missing ), unterminated group")
        self.i += 1
        self.depth -= 1
        return tree

    def class_item(self) -> tuple:
        at, c = self.i, self.take()
        if c != "\\":
            return ((ord(c), ord(c)),)
        return self.class_escape(self.take(), at, in_class=True)


# --- the automaton -----------------------------------------------------------------------------------------
class Regex:
    """A compiled pattern. Position 0 is the start (it reads nothing); position p > 0 reads one byte of
    ``masks[p]`` (a 256-bit set). ``follow[p]`` are the positions that may read the byte after p's; an output
    matches when it ends on a position of ``accepting``."""

    def __init__(self, pattern: str):
        if not isinstance(pattern, str):
            raise RegexError("the pattern must be a string")
        if len(pattern) > MAX_PATTERN_CHARS:
            raise RegexError(f"patterns are limited to {MAX_PATTERN_CHARS} characters")
        self.pattern = pattern
        self.masks: list[int] = [0]
        self._follow: list[set] = [set()]
        first, last, nullable = self._build(_Parser(pattern).parse())
        self._follow[0] |= first
        self.accepting = frozenset(last | ({0} if nullable else set()))
        self.follow = self._pruned()
        if not self.follow[0] and 0 not in self.accepting:
            raise RegexError("the pattern matches nothing")
        self._next: dict = {}

    def next(self, position: int, b: int) -> tuple:
        """The positions reading byte ``b`` after ``position`` (empty: refused)."""
        key = (position, b)
        found = self._next.get(key)
        if found is None:
            found = self._next[key] = tuple(q for q in self.follow[position] if self.masks[q] >> b & 1)
        return found

    def byte_classes(self, apart: Sequence[int] = ()) -> bytes:
        """Bytes grouped by the positions that read them (equal bits in every mask: they step every state alike),
        as 256 class ids (a ``bytes.translate`` table) then one byte of each class; ``apart``: more byte sets
        (masks) whose bytes differ from the others to the caller."""
        keys: list[tuple] = [() for _ in range(256)]
        for m in sorted(set(self.masks) | set(apart)):
            keys = [k + (m >> b & 1,) for b, k in enumerate(keys)]
        ids: dict = {}
        table = bytes(ids.setdefault(k, len(ids)) for k in keys)
        reps = bytes(table.index(i) for i in range(len(ids)))
        return table + reps

    def fullmatch(self, data: bytes) -> bool:
        """Whether ``data`` matches the pattern whole (for tests and checks; generation steps ``next``)."""
        states = {0}
        for b in data:
            states = {q for p in states for q in self.next(p, b)}
            if not states:
                return False
        return bool(states & self.accepting)

    # --- construction ------------------------------------------------------------------------------------
    def _position(self, mask: int) -> int:
        if len(self.masks) > MAX_POSITIONS:
            raise RegexError(f"the pattern is too large (over {MAX_POSITIONS} byte classes once its repeats are "
                             f"expanded)")
        self.masks.append(mask)
        self._follow.append(set())
        return len(self.masks) - 1

    def _build(self, tree) -> tuple[set, set, bool]:
        """(first positions, last positions, whether it matches empty) of ``tree``, adding its positions and the
        follow links inside it."""
        kind = tree[0]
        if kind == "set":
            return self._chars(tree[1])
        if kind == "alt":
            first, last, nullable = set(), set(), False
            for branch in tree[1]:
                f, la, n = self._build(branch)
                first |= f
                last |= la
                nullable |= n
            return first, last, nullable
        if kind == "cat":
            return self._chain([lambda item=item: self._build(item) for item in tree[1]])
        return self._repeat(*tree[1:])

    def _chain(self, parts) -> tuple[set, set, bool]:
        """One after another (each part a thunk building it)."""
        first, last, nullable = set(), set(), True
        for build in parts:
            f, la, n = build()
            for p in last:
                self._follow[p] |= f
            if nullable:
                first |= f
            last = (last | la) if n else la
            nullable &= n
        return first, last, nullable

    def _repeat(self, body, least: int, most: int | None) -> tuple[set, set, bool]:
        copies = [lambda: self._build(body)] * least
        if most is None:
            copies.append(lambda: self._star(body))
        else:
            copies.append(lambda: self._optional_chain(body, most - least))
        return self._chain(copies)

    def _star(self, body) -> tuple[set, set, bool]:
        first, last, _ = self._build(body)
        for p in last:
            self._follow[p] |= first
        return first, last, True

    def _optional_chain(self, body, count: int) -> tuple[set, set, bool]:
        """(body (body (...)?)?)? ``count`` deep: after each copy the output may stop or take the next (so a
        state knows how many copies it has read)."""
        first, last = set(), set()
        for _ in range(count):  # innermost first
            f, la, n = self._build(body)
            for p in la:
                self._follow[p] |= first
            last |= la
            first = f | (first if n else set())
        return first, last, True

    def _chars(self, ranges) -> tuple[set, set, bool]:
        """A character set: its UTF-8 sequences sharing a position where they share their leading byte ranges."""
        trie: dict = {}
        for lo, hi in without_surrogates(ranges):
            for seq in utf8_sequences(lo, hi):
                node = trie
                for r in seq:
                    node = node.setdefault(r, {})
        single = [r for r, child in trie.items() if not child]  # one-byte characters: one position for them all
        first, last = set(), set()
        if single:
            p = self._position(sum(byte_mask(*r) for r in single))
            first.add(p)
            last.add(p)
        for r, child in trie.items():
            if child:
                self._spell(r, child, first, last)
        return first, last, False

    def _spell(self, r: tuple, child: dict, into: set, last: set) -> None:
        p = self._position(byte_mask(*r))
        into.add(p)
        if not child:
            last.add(p)
        for r2, grand in child.items():
            self._spell(r2, grand, self._follow[p], last)

    def _pruned(self) -> list[tuple]:
        """``follow`` without positions that cannot reach an accepting one (a set with no characters leaves
        some), so every live state has a way to finish."""
        before: list[list[int]] = [[] for _ in self._follow]
        for p, nxt in enumerate(self._follow):
            for q in nxt:
                if self._passable(q):
                    before[q].append(p)
        live, todo = set(self.accepting), list(self.accepting)
        while todo:
            for p in before[todo.pop()]:
                if p not in live:
                    live.add(p)
                    todo.append(p)
        return [tuple(sorted(q for q in nxt if q in live and self._passable(q))) for nxt in self._follow]

    def _passable(self, q: int) -> bool:
        """Whether position ``q`` can be read (a byte class with bytes in it)."""
        return self.masks[q] != 0


def choice_pattern(choices) -> str:
    """A pattern that matches exactly one of ``choices`` (vLLM's ``guided_choice``)."""
    if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) for c in choices):
        raise RegexError("choice needs a non-empty list of strings", field="guided_choice")
    return "(?:" + "|".join(re.escape(c) for c in choices) + ")"
