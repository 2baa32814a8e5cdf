"""Context-free grammars in GBNF (llama.cpp's and xgrammar's EBNF, what vLLM's ``guided_grammar`` takes) as byte
pushdown automata, for output that must be a sentence of the grammar.

Each rule's right-hand side is built as a position (Glushkov) automaton over bytes exactly as a pattern is
(``dualpath.regex``: a character set spelled as UTF-8 byte ranges, no empty moves), with one more kind of position:
a reference to a rule. All rules share one table of positions. A configuration is a stack of positions: the last
is the position just read (or a rule's start), the ones below it the references being expanded, each returned to
when its rule may end. Reading a byte enters referenced rules and leaves finished ones as needed, then takes every
position that reads the byte; a state (``dualpath.grammar``) holds every configuration at once, as for a pattern.
At compile time rules that derive no text, and positions that cannot reach their rule's end, are pruned (so every
state a generation can be in has a way to finish), and left recursion is refused (it would expand forever). A
reference that ends its rule is a tail call: its rule's frame is not kept, so right-recursive lists stay shallow.

Syntax: ``name ::= expression`` rules (names of letters, digits, ``-`` and ``_``; a rule runs until the next
``name ::=``), the start rule ``root``; ``"literals"`` (escapes ``\\n \\r \\t \\\\ \\" \\' \\[ \\] \\xhh \\uhhhh
\\Uhhhhhhhh``), classes ``[a-z0-9_]``, ``[^"\\\\]``, ``.`` (any character), references, ``( )``, ``|``, and the
quantifiers ``* + ? {m} {m,} {,n} {m,n}``; ``#`` starts a comment. What this automaton cannot hold a generation to
(left recursion, a rule named but not defined, a grammar that matches nothing or only "") is an ``EbnfError``.
"""
from __future__ import annotations

from dualpath.errors import RequestError
from dualpath.regex import MAX_CHAR, MAX_PATTERN_CHARS, MAX_POSITIONS, MAX_REPEAT, Regex, RegexError, complement, \
    normalized

JSON_GBNF = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null")
object ::= "{" ws ( string ws ":" ws value ws ( "," ws string ws ":" ws value ws )* )? "}"
array  ::= "[" ws ( value ws ( "," ws value ws )* )? "]"
string ::= "\"" ( [^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\""
number ::= "-"? ( "0" | [1-9] [0-9]* ) ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )?
ws     ::= [ \t\n]*
"""  # JSON (an object at the top) in GBNF: an example of the syntax, and what tests and the bench compare
ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "'": "'", "[": "[", "]": "]", "-": "-", "/": "/",
           "^": "^"}
HEX_DIGITS = {"x": 2, "u": 4, "U": 8}
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")
MAX_NESTING = 32  # groups inside groups (parsing and compiling recurse once per level)
MAX_MEMO = 100_000  # configurations whose moves a grammar remembers (then it forgets them all)


class EbnfError(RequestError):
    """A grammar this automaton cannot enforce, or that is not a grammar."""

    def __init__(self, message: str):
        super().__init__(f"grammar: {message}", field="grammar")


class _Parser:
    """GBNF text to ``{name: tree}``, trees as ``dualpath.regex`` builds them plus ``("ref", name)``."""

    def __init__(self, text: str):
        self.s, self.i, self.depth = text, 0, 0

    def rules(self) -> dict:
        out: dict = {}
        self.blank()
        while self.i < len(self.s):
            at, name = self.i, self.name()
            self.blank()
            if not self.s.startswith("::=", self.i):
                raise EbnfError(f"expected '::=' after the rule name {name!r} at position {at}")
            self.i += 3
            if name in out:
                raise EbnfError(f"rule {name!r} is defined twice")
            out[name] = self.alternation()
        return out

    def blank(self) -> None:
        """Skip whitespace and comments (``#`` to the end of the line)."""
        while self.i < len(self.s):
            c = self.s[self.i]
            if c == "#":
                end = self.s.find("\n", self.i)
                self.i = len(self.s) if end < 0 else end
            elif c.isspace():
                self.i += 1
            else:
                return

    def name(self) -> str:
        start = self.i
        while self.i < len(self.s) and self.s[self.i] in NAME_CHARS:
            self.i += 1
        if self.i == start:
            raise EbnfError(f"expected a rule name at position {start}, found {self.s[start:start + 10]!r}")
        return self.s[start:self.i]

    def rule_starts_here(self) -> bool:
        """Whether a new rule (``name ::=``) begins at the current position."""
        j = self.i
        while j < len(self.s) and self.s[j] in NAME_CHARS:
            j += 1
        if j == self.i:
            return False
        while j < len(self.s) and self.s[j].isspace():
            j += 1
        return self.s.startswith("::=", j)

    def alternation(self):
        branches = [self.sequence()]
        while self.i < len(self.s) and self.s[self.i] == "|":
            self.i += 1
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else ("alt", tuple(branches))

    def sequence(self):
        items = []
        while True:
            self.blank()
            if self.i >= len(self.s) or self.s[self.i] in "|)" or self.rule_starts_here():
                return items[0] if len(items) == 1 else ("cat", tuple(items))
            items.append(self.quantified(self.atom()))

    def atom(self):
        at, c = self.i, self.s[self.i]
        if c == '"':
            self.i += 1
            return ("cat", tuple(("set", ((ch, ch),)) for ch in self.literal()))
        if c == "[":
            self.i += 1
            return ("set", self.char_class())
        if c == ".":
            self.i += 1
            return ("set", ((0, MAX_CHAR),))
        if c == "(":
            self.depth += 1
            if self.depth > MAX_NESTING:
                raise EbnfError(f"groups nest deeper than {MAX_NESTING}")
            self.i += 1
            tree = self.alternation()
            self.blank()
            if self.i >= len(self.s) or self.s[self.i] != ")":
                raise EbnfError(f"unclosed '(' at position {at}")
            self.i += 1
            self.depth -= 1
            return tree
        if c in NAME_CHARS:
            return ("ref", self.name())
        raise EbnfError(f"unexpected {c!r} at position {at}")

    def literal(self) -> list[int]:
        out = []
        while True:
            if self.i >= len(self.s):
                raise EbnfError("a string literal is not closed")
            c = self.s[self.i]
            self.i += 1
            if c == '"':
                return out
            out.append(self.escape() if c == "\\" else ord(c))

    def escape(self) -> int:
        at = self.i
        c = self.s[self.i:self.i + 1]
        self.i += 1
        if c in ESCAPES:
            return ord(ESCAPES[c])
        if c in HEX_DIGITS:
            digits = self.s[self.i:self.i + HEX_DIGITS[c]]
            self.i += HEX_DIGITS[c]
            try:
                value = int(digits, 16)
            except ValueError:
                value = -1
            if len(digits) == HEX_DIGITS[c] and 0 <= value <= MAX_CHAR:
                return value
        raise EbnfError(f"bad escape at position {at - 1}")

    def char_class(self) -> tuple:
        negated = self.s.startswith("^", self.i)
        self.i += negated
        ranges = []
        while True:
            if self.i >= len(self.s):
                raise EbnfError("a character class is not closed")
            if self.s[self.i] == "]":
                self.i += 1
                break
            lo = self.class_char()
            if self.s.startswith("-", self.i) and not self.s.startswith("-]", self.i):
                self.i += 1
                hi = self.class_char()
                if hi < lo:
                    raise EbnfError(f"bad range {chr(lo)!r}-{chr(hi)!r} at position {self.i}")
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))
        return tuple(complement(ranges)) if negated else normalized(ranges)

    def class_char(self) -> int:
        if self.i >= len(self.s):
            raise EbnfError("a character class is not closed")
        c = self.s[self.i]
        self.i += 1
        return self.escape() if c == "\\" else ord(c)

    def quantified(self, atom):
        while self.i < len(self.s) and self.s[self.i] in "*+?{":
            c = self.s[self.i]
            if c == "{":
                close = self.s.find("}", self.i)
                lo, comma, hi = self.s[self.i + 1:close if close >= 0 else self.i].partition(",")
                lo, hi = lo.strip(), hi.strip()
                if close < 0 or not (lo.isdigit() or (comma and not lo)) or (hi and not hi.isdigit()):
                    raise EbnfError(f"bad repetition at position {self.i}")
                least, most = int(lo or 0), (int(hi) if hi else None) if comma else int(lo)
                self.i = close + 1
            else:
                self.i += 1
                least, most = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            if most is not None and least > most or max(least, most or 0) > MAX_REPEAT:
                raise EbnfError(f"bad repetition counts {{{least},{most}}} (at most {MAX_REPEAT})")
            atom = ("repeat", atom, least, most)
        return atom


class Cfg(Regex):
    """A compiled grammar. Positions as in ``Regex`` (0 unused), plus ``refs``: position -> the rule it references;
    ``starts[r]`` is rule r's start position (it reads nothing), ``ends[r]`` the positions it may end on."""

    def __init__(self, text: str, root: str = "root"):
        if not isinstance(text, str):
            raise EbnfError("the grammar must be a string")
        if len(text) > MAX_PATTERN_CHARS:
            raise EbnfError(f"grammars are limited to {MAX_PATTERN_CHARS} characters")
        rules = _Parser(text).rules()
        if root not in rules:
            raise EbnfError(f"no rule {root!r} (the start rule)")
        self.pattern, self.names = text, list(rules)
        self.index = {name: r for r, name in enumerate(self.names)}
        self.masks, self._follow, self.refs = [0], [set()], {}
        self.starts, self.ends, self.rule_of = [], [], [-1]
        for r, tree in enumerate(rules.values()):
            start = self._position(0)
            first, last, nullable = self._build(tree)
            self._follow[start] |= first
            self.starts.append(start)
            self.ends.append(frozenset(last | ({start} if nullable else set())))
            self.rule_of += [r] * (len(self.masks) - len(self.rule_of))
        self.root = self.index[root]
        self.accepting = frozenset().union(*self.ends)
        self.follow = self._pruned()
        self._refuse_left_recursion()
        self._moves: dict = {}
        if not self.moves(self.start())[0]:
            raise EbnfError("the grammar matches only the empty string")

    def _position(self, mask: int) -> int:
        try:
            return super()._position(mask)
        except RegexError:
            raise EbnfError(f"the grammar is too large (over {MAX_POSITIONS} byte classes once its repeats are "
                            f"expanded)") from None

    def _build(self, tree) -> tuple[set, set, bool]:
        if tree[0] != "ref":
            return super()._build(tree)
        if tree[1] not in self.index:
            raise EbnfError(f"rule {tree[1]!r} is used but not defined")
        p = self._position(0)
        self.refs[p] = self.index[tree[1]]
        return {p}, {p}, False

    # --- compile-time analysis ------------------------------------------------------------------------------
    def _rules_that(self, can_pass) -> set:
        """The rules that can get from their start to an end passing only positions ``can_pass(p, found)``
        allows (``found``: the rules known so far; a fixpoint)."""
        found: set = set()
        while True:
            more = {r for r in range(len(self.names)) if r not in found and self._reaches_end(r, can_pass, found)}
            if not more:
                return found
            found |= more

    def _reaches_end(self, r: int, can_pass, found: set) -> bool:
        seen, todo = {self.starts[r]}, [self.starts[r]]
        while todo:
            p = todo.pop()
            if p in self.ends[r]:
                return True
            for q in self._follow[p]:
                if q not in seen and can_pass(q, found):
                    seen.add(q)
                    todo.append(q)
        return False

    def _pruned(self) -> list[tuple]:
        """``follow`` keeping only positions that read a byte or reference a rule that derives text, and that can
        reach their rule's end (``Regex._pruned`` with ``_passable`` below); a root that derives nothing is
        refused."""
        self.productive = self._rules_that(lambda q, found: self.masks[q] != 0 or self.refs.get(q) in found)
        if self.root not in self.productive:
            raise EbnfError(f"the rule {self.names[self.root]!r} matches nothing")
        return super()._pruned()

    def _passable(self, q: int) -> bool:
        return self.masks[q] != 0 or self.refs.get(q) in self.productive

    def _nullable(self) -> set:
        return self._rules_that(lambda q, found: self.refs.get(q) in found)

    def _refuse_left_recursion(self) -> None:
        """A rule that can reach itself before reading a byte would expand without end: refused, naming it."""
        nullable = self._nullable()
        leads: list[set] = []  # rules each rule may enter before reading a byte
        for r in range(len(self.names)):
            seen, todo, out = {self.starts[r]}, [self.starts[r]], set()
            while todo:
                for q in self.follow[todo.pop()]:
                    if q in self.refs:
                        out.add(self.refs[q])
                        if self.refs[q] in nullable and q not in seen:
                            seen.add(q)
                            todo.append(q)
            leads.append(out)
        for r in range(len(self.names)):
            seen, todo = set(), list(leads[r])
            while todo:
                s = todo.pop()
                if s == r:
                    raise EbnfError(f"rule {self.names[r]!r} is left-recursive (it can reach itself before "
                                    f"reading a character); rewrite it with repetition, as in 'x ::= y (op y)*'")
                if s not in seen:
                    seen.add(s)
                    todo.extend(leads[s])

    # --- the automaton --------------------------------------------------------------------------------------
    def moves(self, frames: tuple) -> tuple[tuple, bool]:
        """From ``frames`` (positions, the last just read): every (frames below, position reading the next byte)
        reachable by entering referenced rules and leaving ended ones, and whether the whole output may end here.
        Remembered per configuration."""
        found = self._moves.get(frames)
        if found is None:
            if len(self._moves) > MAX_MEMO:
                self._moves.clear()
            found = self._moves[frames] = self._closure(frames)
        return found

    def _closure(self, frames: tuple) -> tuple[tuple, bool]:
        out, can_end, seen, todo = [], False, {frames}, [frames]
        while todo:
            f = todo.pop()
            p, below = f[-1], f[:-1]
            for q in self.follow[p]:
                r = self.refs.get(q)
                if r is None:
                    out.append((below, q))
                    continue
                tail = not self.follow[q] and q in self.ends[self.rule_of[q]]  # nothing after it in its rule
                nxt = below + ((self.starts[r],) if tail else (q, self.starts[r]))
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
            if p in self.ends[self.rule_of[p]]:
                if not below:
                    can_end = True  # the bottom rule is the root, or one the root tail-called
                elif below not in seen:
                    seen.add(below)
                    todo.append(below)
        return tuple(out), can_end

    def step(self, frames: tuple, b: int) -> list[tuple]:
        """The configurations after reading byte ``b`` (empty: refused)."""
        moves, _ = self.moves(frames)
        return [below + (q,) for below, q in moves if self.masks[q] >> b & 1]

    def start(self) -> tuple:
        return (self.starts[self.root],)

    def fullmatch(self, data: bytes) -> bool:
        """Whether ``data`` is a sentence of the grammar (for tests and checks; generation steps ``step``)."""
        states = {self.start()}
        for b in data:
            states = {f for s in states for f in self.step(s, b)}
            if not states:
                return False
        return any(self.moves(s)[1] for s in states)
