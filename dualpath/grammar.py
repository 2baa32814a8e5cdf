"""What structured output may emit: JSON objects, optionally valid against a JSON schema, text a regular
expression matches whole (``Grammar.pattern``: its positions, from ``dualpath.regex``, are configurations in mode
``REGEX``), or a sentence of a context-free grammar (``Grammar.ebnf``: its stacks of positions, from
``dualpath.ebnf``, are configurations in mode ``CFG``), read one byte at a time.

A ``Grammar`` is a compiled schema: a table of nodes (any value, object, array, string, number, integer, boolean,
null, a set of literal values, a choice of nodes). Its automaton reads bytes: a *configuration* is
``(mode, node, stack, ws)`` — what the next byte may be, the schema node of the value being read (for modes that
start or spell a value), the open containers (frames, innermost last) and the whitespace bytes just read. A choice
(``anyOf``) is followed down every branch at once, so a *state* is a frozenset of configurations; a byte no
configuration accepts is refused. JSON's syntax is deterministic, so every configuration of a state has open
containers of the same shape: the state closes its top-level object (``DONE``) in all of them at once.

The accepted texts are strict JSON (no NaN, no raw control characters in strings, whole UTF-8 characters, at most
``MAX_WS`` whitespace bytes in a row) with one object at the top level, ending at its closing brace; a grammar may
also fix text before and after the object (a forced tool call's markup), and let a reasoning model think first:
free text up to ``</think>`` ("open": the prompt opened the block) or an optional ``<think> ... </think>`` block the
reply opens itself ("optional"), then whitespace, then the output (vLLM constrains only after the reasoning ends).

Schema subset (OpenAI's structured outputs and what pydantic emits): ``type`` (one or a list), ``properties``,
``required``, ``additionalProperties`` (false, true or a schema; true by default), ``items``, ``minItems``,
``maxItems``, ``enum``, ``const``, for strings ``pattern`` (matched whole: anchors optional; a subset of what JSON
Schema's search semantics accept), ``minLength`` and ``maxLength`` (characters, escapes decoded; a ``StringRule``),
``anyOf``, ``allOf`` of one schema, ``$ref`` into ``$defs``/``definitions`` (recursion allowed), and annotations
(``title``, ``description``, ``default``, ``examples``, ``format`` — an annotation in JSON Schema 2020-12). A keyword
that would constrain what cannot be enforced here (``minimum``, ``oneOf``, ``uniqueItems``, ...) is a
``SchemaError``, never silently dropped. Properties may come in any order; integers are written without a fraction
or exponent; a value of an ``enum`` is written as ``json.dumps`` writes it (``ensure_ascii=False``); in a string
with a rule, ``\\u`` escapes spell characters of the Basic Multilingual Plane (others are written as themselves).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from dualpath.ebnf import Cfg
from dualpath.errors import RequestError
from dualpath.regex import Regex, RegexError, byte_mask, utf8_sequences, without_surrogates

MAX_WS = 32  # whitespace bytes in a row between structural tokens: a model that loops on newlines stops there
WS = frozenset(b" \t\n\r")
HEX = frozenset(b"0123456789abcdefABCDEF")
DIGITS = frozenset(b"0123456789")
ESCAPES = frozenset(b'"\\/bfnrt')

# modes (ints); LIT's node slot holds the literal suffixes still possible
(VALUE, VALUE_OR_CLOSE, KEY_OR_CLOSE, KEY, COLON, AFTER, DONE, STR, STR_ESC, KEY_STR, KEY_ESC, KEY_NAME, LIT,
 NUM_MINUS, NUM_ZERO, NUM_INT, NUM_DOT, NUM_FRAC, NUM_E, NUM_SIGN, NUM_EXP, INT_MINUS, INT_ZERO, INT_DIGITS,
 PREFIX, SUFFIX, OPENING, THINKING, LEAD, REGEX, CSTR, CSTR_ESC, CSTR_U, CFG, FREE, TAG) = range(36)
# PREFIX / SUFFIX / OPENING: fixed text (around the object; the <think> tag), the bytes still due in node;
# THINKING: free text, node = bytes of </think> matched; LEAD: whitespace between the thinking and the output;
# REGEX: a pattern's position (dualpath.regex) in place of the object; CFG: a grammar's stack of positions
# (dualpath.ebnf) in place of the object; FREE: free text around triggered objects, node = trigger bytes matched;
# TAG: a branch's text before its object, node = (the bytes still due, the branch's root node);
# CSTR (_ESC, _U): a string value under a StringRule, node = (its node, rule position, characters counted) and, while
# reading \uXXXX, the value so far and the hex digits still due
U_STR, U_KEY = 100, 200  # + hex digits still due after \u, in a value string or a key
UTF8_STR, UTF8_KEY = 300, 400  # + 10 x continuation bytes due + which range the next one must be in
NEXT_RANGE = ((0x80, 0xBF), (0xA0, 0xBF), (0x80, 0x9F), (0x90, 0xBF), (0x80, 0x8F))  # no overlong or surrogate
SPACED = frozenset({VALUE, VALUE_OR_CLOSE, KEY_OR_CLOSE, KEY, COLON, AFTER})  # whitespace may come here
NUM_MAY_END = frozenset({NUM_ZERO, NUM_INT, NUM_FRAC, NUM_EXP, INT_ZERO, INT_DIGITS})
PLAIN_MODES = frozenset({STR, KEY_STR})  # a string with no constraint on its content
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # a reasoning model's thinking (dualpath.serving.reasoning)
THINKING_MODES = ("", "optional", "open")
_CLOSE = THINK_CLOSE.encode()
assert _CLOSE.count(_CLOSE[0]) == 1  # a mismatch restarts the match at this byte or at none (no border)

ANY_TEXT = r"[\s\S]*"  # every character: a string's rule when only its length is bounded
SHORT_ESCAPES = {ord(k): v for k, v in zip('"\\/bfnrt', '"\\/\b\f\n\r\t')}  # \x in a JSON string -> character
MAX_CFG_CONFIGS = 256  # a grammar's parses one state keeps (``_fewer``)
MAX_RULE_PAIRS = 200_000  # (pattern position, count) pairs a string with both a pattern and length bounds may have
LEAD_BYTES = byte_mask(0, 0x7F) | byte_mask(0xC0, 0xFF)  # bytes that start a character

# node ids every grammar has
ANY, ANY_OBJECT, ANY_ARRAY = 0, 1, 2
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "format", "$schema", "$id", "$comment",
                         "deprecated", "readOnly", "writeOnly", "$defs", "definitions"})
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")

Config = tuple  # (mode, node, stack: tuple of frames, whitespace run)
State = frozenset  # of configurations
# frames: ("o", object node, names given: frozenset, the key being read as written: bytes, or None where the object
# needs no names kept) or ("a", array node, items begun: counted only as far as the node's bounds need)


class SchemaError(RequestError):
    """A schema this grammar cannot enforce (or that no value satisfies)."""

    def __init__(self, message: str):
        super().__init__(f"json_schema: {message}", field="response_format")


@dataclass(frozen=True, eq=False)
class ObjectNode:
    """An object's schema: its properties' nodes, the names it requires, what other keys may hold."""

    props: dict  # property name -> node
    required: frozenset  # of names
    extra: int | None  # node of other keys' values; None: no other keys
    spelled: dict = field(init=False)  # name -> as json.dumps writes it between the quotes (bytes)

    def __post_init__(self):
        object.__setattr__(self, "spelled", {k: _key_bytes(k) for k in self.props})

    @property
    def tracked(self) -> bool:
        """Whether keys must be remembered (to look up their values' nodes, or to know the required are there)."""
        return bool(self.props or self.required)

    def remaining(self, done: frozenset) -> list[bytes]:
        """The properties not given yet, each as ``json.dumps`` writes it between the quotes."""
        return [w for k, w in self.spelled.items() if k not in done]


@dataclass(frozen=True, eq=False)
class StringRule:
    """A string value's ``pattern``, ``minLength`` and ``maxLength``: its characters, decoded from JSON's escapes, are
    read by ``regex`` (which the whole string must match; every text when no pattern is given) and counted up to what
    the bounds tell apart. ``pairs``: the (position, count) pairs from which an allowed end is reachable, where a
    pattern and bounds together make that a question of both; otherwise every pair within the bounds is."""

    regex: Regex
    least: int
    most: int | None
    bounded_text: bool  # no pattern: the characters are free, only their count is bounded
    pairs: frozenset | None = None

    def counted(self, count: int) -> int | None:
        """The count after one more character (None: past maxLength)."""
        if self.most is None:
            return min(count + 1, self.least)
        return count + 1 if count < self.most else None

    def alive(self, position: int, count: int) -> bool:
        if self.pairs is not None:
            return (position, count) in self.pairs
        return self.most is None or count <= self.most

    def closes(self, position: int, count: int) -> bool:
        return position in self.regex.accepting and count >= self.least

    def matches(self, text: str) -> bool:
        """Whether a whole value satisfies the rule (for enum and const values)."""
        n = len(text)
        return n >= self.least and (self.most is None or n <= self.most) and self.regex.fullmatch(text.encode())


def string_rule(s: dict, where: str) -> StringRule:
    pattern, least, most = s.get("pattern"), s.get("minLength", 0), s.get("maxLength")
    if pattern is not None and not isinstance(pattern, str):
        raise SchemaError(f"{where}: pattern must be a string")
    if not _count(least) or not (most is None or _count(most) and most >= least):
        raise SchemaError(f"{where}: minLength and maxLength must be counts, minLength <= maxLength")
    try:
        regex = Regex(ANY_TEXT if pattern is None else pattern)
    except RegexError as e:
        raise SchemaError(f"{where}: pattern: {str(e).removeprefix('regex: ')}") from None
    rule = StringRule(regex, least, most, pattern is None)
    if pattern is not None and (least or most is not None):
        rule = StringRule(regex, least, most, False, _live_pairs(rule, where))
    if not rule.alive(0, 0):
        raise SchemaError(f"{where}: no string satisfies its pattern, minLength and maxLength")
    return rule


def _live_pairs(rule: StringRule, where: str) -> frozenset:
    """The (position, count) pairs reachable from the start from which the string can end within its bounds."""
    rx = rule.regex
    if len(rx.masks) * ((rule.most if rule.most is not None else rule.least) + 1) > MAX_RULE_PAIRS:
        raise SchemaError(f"{where}: this pattern with these length bounds is too large to enforce")
    lead = [bool(m & LEAD_BYTES) for m in rx.masks]
    before: dict = {(0, 0): []}
    todo = [(0, 0)]
    while todo:
        p, c = pair = todo.pop()
        for q in rx.follow[p]:
            n = rule.counted(c) if lead[q] else c
            if n is None:
                continue
            if (q, n) not in before:
                before[(q, n)] = []
                todo.append((q, n))
            before[(q, n)].append(pair)
    live = {pair for pair in before if rule.closes(*pair)}
    todo = list(live)
    while todo:
        for pair in before[todo.pop()]:
            if pair not in live:
                live.add(pair)
                todo.append(pair)
    return frozenset(live)


class Grammar:
    """A compiled schema (``compile``) or JSON mode's any-object (``json_object``), optionally with fixed text
    before and after the object (``prefix``, ``suffix``: a forced tool call's markup around its JSON) and thinking
    before all of it (``thinking``, one of ``THINKING_MODES``). With ``trigger`` the output is free text instead,
    in which each ``prefix`` begins an object (then the ``suffix``, then free text again): tool calls a model may
    make or not (OpenAI's strict function calling with ``tool_choice`` "auto"); it may end wherever the text is
    free. With ``branches`` (``compile``: texts, one per alternative of the schema's top-level ``anyOf``) the
    object is one alternative's, after its text: a call whose function's name comes before its arguments."""

    def __init__(self, prefix: bytes = b"", suffix: bytes = b"", thinking: str = "", trigger: bool = False):
        if thinking not in THINKING_MODES:
            raise ValueError(f"thinking must be one of {THINKING_MODES}, got {thinking!r}")
        if trigger and (not prefix or prefix.count(prefix[:1]) != 1):
            raise ValueError("a trigger is a prefix whose first byte occurs once in it (a mismatch restarts the "
                             "match there or nowhere)")
        self.nodes: list = [("any",), ("object", ObjectNode({}, frozenset(), ANY)), ("array", ANY, 0, None)]
        self.root = ANY_OBJECT
        self.regex: Regex | None = None  # the output is text matching this pattern instead of a JSON object
        self.cfg: Cfg | None = None  # the output is a sentence of this grammar instead of a JSON object
        self.prefix, self.suffix, self.thinking, self.trigger = prefix, suffix, thinking, trigger
        self.branches: tuple = ()  # (text, root node) per alternative (compile's branches)

    @classmethod
    def json_object(cls, prefix: bytes = b"", suffix: bytes = b"", thinking: str = "",
                    trigger: bool = False) -> "Grammar":
        return cls(prefix, suffix, thinking, trigger)

    @classmethod
    def compile(cls, schema, prefix: bytes = b"", suffix: bytes = b"", thinking: str = "",
                trigger: bool = False, branches: tuple[bytes, ...] = ()) -> "Grammar":
        g = cls(prefix, suffix, thinking, trigger)
        g.root = _Compiler(g, schema).node(schema, "#")
        if branches:
            kind = g.nodes[g.root]
            if kind[0] != "anyof" or len(kind[1]) != len(branches) or "anyOf" not in schema:
                raise SchemaError(f"{len(branches)} branches need a top-level anyOf of as many schemas")
            g.branches = tuple(zip(branches, kind[1]))
        for n in range(len(g.nodes)):
            g.alternatives(n)  # refuses $ref cycles now, not mid-generation
        if not all(g.nodes[n][0] == "object" for n in g.alternatives(g.root)):
            raise SchemaError("the top level must be an object")
        return g

    @classmethod
    def pattern(cls, pattern: str, prefix: bytes = b"", suffix: bytes = b"", thinking: str = "") -> "Grammar":
        """Text matching ``pattern`` in full (``dualpath.regex``) in place of the object. Unlike an object's, a
        pattern's end may be reached with more text possible (``\\d+``): such a state ``may_end`` and the engines
        let the model's end token finish it; ``complete`` is when nothing can follow."""
        g = cls(prefix, suffix, thinking)
        g.regex = Regex(pattern)
        if not g.regex.follow[0]:
            raise RegexError("the pattern matches only the empty string")
        return g

    @classmethod
    def ebnf(cls, text: str, prefix: bytes = b"", suffix: bytes = b"", thinking: str = "") -> "Grammar":
        """A sentence of the GBNF grammar ``text`` (``dualpath.ebnf``) in place of the object; like a pattern's, its
        end may come where more could follow."""
        g = cls(prefix, suffix, thinking)
        g.cfg = Cfg(text)
        return g

    @property
    def automaton(self) -> Regex | None:
        """The output's own automaton where it is a pattern or a grammar (its byte classes step it alike)."""
        return self.regex if self.regex is not None else self.cfg

    @property
    def start(self) -> State:
        if self.thinking == "open":
            return frozenset({(THINKING, 0, (), 0)})
        if self.thinking == "optional":
            return frozenset({(OPENING, THINK_OPEN.encode(), (), 0), (LEAD, 0, (), 0)})
        return self._output

    @property
    def _output(self) -> State:
        """Where the output (prefix, object, suffix; or the free text around them) starts."""
        if self.trigger:
            return frozenset({(FREE, 0, (), 0)})
        return frozenset([(PREFIX, self.prefix, (), 0)] if self.prefix else self._begin(()))

    def _begin(self, stack: tuple) -> list[Config]:
        """The output's first configurations (after its prefix)."""
        if self.branches:
            return [(TAG, (text, root), stack, 0) if text else (VALUE, root, stack, 0) for text, root in self.branches]
        if self.cfg is not None:
            return self._frames([self.cfg.start()], stack)
        if self.regex is None:
            return [(VALUE, self.root, stack, 0)]
        return self._positions((0,), stack)

    def _frames(self, configs: list[tuple], stack: tuple) -> list[Config]:
        """A grammar's configurations: those that read on, and where one may end, what follows."""
        out, end = [], False
        for frames in configs:
            moves, may_end = self.cfg.moves(frames)
            if moves:
                out.append((CFG, frames, stack, 0))
            end |= may_end
        return out + [self._after(stack)] if end else out

    def _positions(self, positions, stack: tuple) -> list[Config]:
        """A pattern's positions as configurations: those that read on, and where it may end, what follows."""
        follow = self.regex.follow
        out = [(REGEX, p, stack, 0) for p in positions if follow[p]]
        if not self.regex.accepting.isdisjoint(positions):
            out.append(self._after(stack))
        return out

    def _after(self, stack: tuple) -> Config:
        """What follows the output: the suffix, or its end."""
        return (SUFFIX, self.suffix, stack, 0) if self.suffix else self._end(stack)

    def _end(self, stack: tuple) -> Config:
        """The end of the output: nothing may follow, or (with a trigger) free text again."""
        return (FREE, 0, (), 0) if self.trigger else (DONE, 0, stack, 0)

    def alternatives(self, node: int, seen: frozenset = frozenset()) -> list[int]:
        """The concrete nodes a node may be (a choice expands, recursively)."""
        kind = self.nodes[node]
        if kind[0] != "anyof":
            return [node]
        if node in seen:
            raise SchemaError("a $ref cycle that never reaches a value")
        return [n for alt in kind[1] for n in self.alternatives(alt, seen | {node})]

    # --- the automaton ----------------------------------------------------------------------------------------
    def step(self, state: State, b: int) -> State | None:
        out = set()
        for config in state:
            out.update(self._step(config, b))
        if self.cfg is not None and len(out) > MAX_CFG_CONFIGS:
            out = _fewer(out)
        return frozenset(out) if out else None

    def run(self, state: State | None, data: bytes) -> State | None:
        for b in data:
            if state is None:
                return None
            state = self.step(state, b)
        return state

    @staticmethod
    def complete(state: State) -> bool:
        """Whether the output has ended and nothing may follow (an object's close; a pattern's last byte)."""
        return all(c[0] == DONE for c in state)

    @staticmethod
    def may_end(state: State) -> bool:
        """Whether the output may end here (complete, a pattern that could also read on, or free text)."""
        return any(c[0] == DONE or c[0] == FREE for c in state)

    def _step(self, config: Config, b: int) -> list[Config]:
        mode, node, stack, ws = config
        if b in WS and mode in SPACED:
            return [(mode, node, stack, ws + 1)] if ws < MAX_WS else []
        if mode >= UTF8_STR:
            return _continuation(mode, stack, b)
        if mode >= U_STR:
            return _hex(mode, stack, b)
        if mode <= DONE:
            return self._structure(mode, node, stack, b)
        if mode == STR or mode == KEY_STR:
            return self._string(mode, stack, b)
        if mode == STR_ESC or mode == KEY_ESC:
            string = STR if mode == STR_ESC else KEY_STR
            key = string == KEY_STR
            if b in ESCAPES:
                return [(string, 0, _keyed(stack, b, key), 0)]
            return [((U_KEY if key else U_STR) + 4, 0, _keyed(stack, b, key), 0)] if b == 0x75 else []
        if mode == KEY_NAME:
            return self._spell_key(stack, b)
        if mode == LIT:
            return self._literal(node, stack, b)
        if mode == REGEX:
            return self._positions(self.regex.next(node, b), stack)
        if mode == CFG:
            return self._frames(self.cfg.step(node, b), stack)
        if mode == TAG:
            text, root = node
            if b != text[0]:
                return []
            return [(TAG, (text[1:], root), stack, 0)] if len(text) > 1 else [(VALUE, root, stack, 0)]
        if mode == FREE:  # free text: anything, until the trigger (the prefix) is spelled and an object begins
            if b == self.prefix[node]:
                return [(FREE, node + 1, (), 0)] if node + 1 < len(self.prefix) else self._begin(())
            return [(FREE, int(b == self.prefix[0]), (), 0)]
        if mode >= CSTR:
            return self._ruled(mode, node, stack, b)
        if mode >= OPENING:
            return self._think(mode, node, ws, b)
        if mode >= PREFIX:
            if b != node[0]:
                return []
            if len(node) > 1:
                return [(mode, node[1:], stack, 0)]
            return self._begin(stack) if mode == PREFIX else [self._end(stack)]
        return self._number(mode, stack, b)

    def _think(self, mode: int, node, ws: int, b: int) -> list[Config]:
        """The thinking before the output: its tag opening (optional), its free text, the whitespace after it."""
        if mode == THINKING:  # anything, until the close tag is spelled
            if b == _CLOSE[node]:
                return [(THINKING, node + 1, (), 0)] if node + 1 < len(_CLOSE) else [(LEAD, 0, (), 0)]
            return [(THINKING, int(b == _CLOSE[0]), (), 0)]
        if b in WS and (mode == LEAD or node == THINK_OPEN.encode()):
            return [(mode, node, (), ws + 1)] if ws < MAX_WS else []
        if mode == LEAD:
            return [c for config in self._output for c in self._step(config, b)]
        if b != node[0]:
            return []
        return [(OPENING, node[1:], (), 0)] if len(node) > 1 else [(THINKING, 0, (), 0)]

    def _structure(self, mode: int, node: int, stack: tuple, b: int) -> list[Config]:
        if mode == VALUE:
            return self._value(node, stack, b)
        if mode == VALUE_OR_CLOSE:  # just after "[": the first item or the end
            if b == 0x5D:
                return self._close(stack, b)
            return self._value(node, self._counted(stack), b) if self._room(stack[-1]) else []
        if mode == KEY_OR_CLOSE or mode == KEY:
            if b == 0x22:
                return self._open_key(stack)
            return self._close(stack, b) if b == 0x7D and mode == KEY_OR_CLOSE else []
        if mode == COLON:
            return self._colon(stack) if b == 0x3A else []
        if mode == AFTER:
            if b != 0x2C:
                return self._close(stack, b)
            top = stack[-1]
            if top[0] == "a":
                return [(VALUE, self.nodes[top[1]][1], self._counted(stack), 0)] if self._room(top) else []
            obj = self.nodes[top[1]][1]
            return [(KEY, 0, stack, 0)] if obj.extra is not None or obj.remaining(top[2]) else []
        return []  # DONE: nothing follows the object

    def _value(self, node: int, stack: tuple, b: int) -> list[Config]:
        out = []
        for n in self.alternatives(node):
            out += self._start(n, stack, b)
        return out

    def _start(self, node: int, stack: tuple, b: int) -> list[Config]:
        kind = self.nodes[node]
        name = kind[0]
        if name == "any":
            if b == 0x7B or b == 0x5B:
                return self._start(ANY_OBJECT if b == 0x7B else ANY_ARRAY, stack, b)
            if b == 0x22:
                return [(STR, 0, stack, 0)]
            if b in DIGITS or b == 0x2D:
                return _number_start(NUM_MINUS, b, stack)
            lit = {0x74: b"rue", 0x66: b"alse", 0x6E: b"ull"}.get(b)
            return [(LIT, frozenset({lit}), stack, 0)] if lit else []
        if name == "object":
            if b != 0x7B:
                return []
            return [(KEY_OR_CLOSE, 0, stack + (("o", node, frozenset(), _no_key(kind[1])),), 0)]
        if name == "array":
            return [(VALUE_OR_CLOSE, kind[1], stack + (("a", node, 0),), 0)] if b == 0x5B else []
        if name == "string":
            if b != 0x22:
                return []
            return [(STR, 0, stack, 0)] if len(kind) == 1 else [(CSTR, (node, 0, 0), stack, 0)]
        if name == "number":
            return _number_start(NUM_MINUS, b, stack)
        if name == "integer":
            return _number_start(INT_MINUS, b, stack)
        if name == "literals":
            rest = frozenset(v[1:] for v in kind[1] if v[0] == b)
            return _literal_config(rest, stack) if rest else []
        raise AssertionError(kind)

    def _close(self, stack: tuple, b: int) -> list[Config]:
        if not stack:
            return []
        top = stack[-1]
        if top[0] == "a":
            if b != 0x5D or top[2] < self.nodes[top[1]][2]:  # fewer items than minItems
                return []
        elif b != 0x7D or not self.nodes[top[1]][1].required <= top[2]:
            return []
        rest = stack[:-1]
        if rest:
            return [(AFTER, 0, rest, 0)]
        return [self._after(rest)]

    def _room(self, frame: tuple) -> bool:
        """Whether an array may take another item (maxItems)."""
        most = self.nodes[frame[1]][3]
        return most is None or frame[2] < most

    def _counted(self, stack: tuple) -> tuple:
        """``stack`` with one more item begun in its innermost array, counted up to what the bounds distinguish
        (an array without bounds always counts 0, so its states stay shared)."""
        _, node, n = stack[-1]
        _, _, least, most = self.nodes[node]
        return stack[:-1] + (("a", node, min(n + 1, most if most is not None else least)),)

    def _open_key(self, stack: tuple) -> list[Config]:
        top = stack[-1]
        obj = self.nodes[top[1]][1]
        if obj.extra is None:
            return [(KEY_NAME, 0, stack, 0)] if obj.remaining(top[2]) else []
        return [(KEY_STR, 0, stack, 0)]

    def _spell_key(self, stack: tuple, b: int) -> list[Config]:
        """A key of an object without other keys: only what spells a property not yet given."""
        top = stack[-1]
        names = self.nodes[top[1]][1].remaining(top[2])
        if b == 0x22:
            return [(COLON, 0, stack, 0)] if top[3] in names else []
        key = top[3] + bytes([b])
        if not any(n.startswith(key) for n in names):
            return []
        return [(KEY_NAME, 0, stack[:-1] + (top[:3] + (key,),), 0)]

    def _string(self, mode: int, stack: tuple, b: int) -> list[Config]:
        if b == 0x22:  # the closing quote
            if mode == STR:
                return [(AFTER, 0, stack, 0)]
            top = stack[-1]
            if top[3] is not None and _key_name(top[3]) in top[2]:
                return []  # a key given twice is refused
            return [(COLON, 0, stack, 0)]
        key = mode == KEY_STR
        if b == 0x5C:
            return [(STR_ESC if mode == STR else KEY_ESC, 0, _keyed(stack, b, key), 0)]
        if b >= 0x80:
            return _lead(mode, stack, b)
        return [] if b < 0x20 else [(mode, 0, _keyed(stack, b, key), 0)]

    def _ruled(self, mode: int, node: tuple, stack: tuple, b: int) -> list[Config]:
        """A byte of a string value under a ``StringRule``: raw characters and escapes decoded into the rule's
        pattern and count; an escape is begun only where some character it can spell is allowed, so no state is
        a dead end."""
        rid, p, c = node[:3]
        rule = self.nodes[rid][1]
        if mode == CSTR:
            if b == 0x22:
                return [(AFTER, 0, stack, 0)] if rule.closes(p, c) else []
            if b == 0x5C:
                return [(CSTR_ESC, node, stack, 0)] if _spellable(rule, p, c, 0, 0xFFFF) else []
            return [] if b < 0x20 else _read(rule, node, bytes([b]), b < 0x80 or b >= 0xC0, stack)
        if mode == CSTR_ESC:
            if b == 0x75:  # \uXXXX: any character of the Basic Multilingual Plane but a surrogate
                return [(CSTR_U, (rid, p, c, 0, 4), stack, 0)]
            char = SHORT_ESCAPES.get(b)
            return [] if char is None else _read(rule, node, char.encode(), True, stack)
        if b not in HEX:
            return []
        value, due = node[3] * 16 + int(chr(b), 16), node[4] - 1
        if not _spellable(rule, p, c, value << (4 * due), ((value + 1) << (4 * due)) - 1):
            return []
        if due:
            return [(CSTR_U, (rid, p, c, value, due), stack, 0)]
        return _read(rule, node, chr(value).encode(), True, stack)

    def plain_room(self, state: State) -> int | None:
        """How many characters of plain text (no quote, backslash or control character) may come next in
        ``state``, where all such text up to that many is allowed: inside a string without a rule (any number) or
        one whose rule bounds only its length, between characters. None if a configuration is anything else."""
        rooms = [self._text_room(config) for config in state]
        return None if None in rooms else max(rooms)

    def _text_room(self, config: Config) -> int | None:
        mode, node = config[0], config[1]
        if mode in PLAIN_MODES:
            return sys.maxsize
        if mode != CSTR:
            return None
        rule = self.nodes[node[0]][1]
        if not rule.bounded_text or node[1] not in rule.regex.accepting:  # a pattern, or mid-character
            return None
        return sys.maxsize if rule.most is None else rule.most - node[2]

    def _colon(self, stack: tuple) -> list[Config]:
        top = stack[-1]
        obj = self.nodes[top[1]][1]
        name = _key_name(top[3]) if obj.tracked else None  # escapes decoded: "\\u0061" is property "a"
        value = obj.props.get(name, obj.extra) if obj.tracked else obj.extra
        done = top[2] | {name} if obj.tracked else top[2]
        return [(VALUE, value, stack[:-1] + (("o", top[1], done, _no_key(obj)),), 0)]

    def _literal(self, rest: frozenset, stack: tuple, b: int) -> list[Config]:
        out = []
        nxt = frozenset(s[1:] for s in rest if s and s[0] == b)
        if nxt:
            out += _literal_config(nxt, stack)
        if b"" in rest:  # the literal may have ended (a number among longer ones): this byte follows it
            out += self._step((AFTER, 0, stack, 0), b)
        return out

    def _number(self, mode: int, stack: tuple, b: int) -> list[Config]:
        digit = b in DIGITS
        if mode in (NUM_MINUS, INT_MINUS):
            return _number_start(mode, b, stack) if digit else []
        if mode == NUM_DOT:
            return [(NUM_FRAC, 0, stack, 0)] if digit else []
        if mode == NUM_E:
            return [(NUM_EXP if digit else NUM_SIGN, 0, stack, 0)] if digit or b in (0x2B, 0x2D) else []
        if mode == NUM_SIGN:
            return [(NUM_EXP, 0, stack, 0)] if digit else []
        if digit and mode not in (NUM_ZERO, INT_ZERO):
            return [(mode, 0, stack, 0)]
        if b == 0x2E and mode in (NUM_ZERO, NUM_INT):
            return [(NUM_DOT, 0, stack, 0)]
        if b in (0x65, 0x45) and mode in (NUM_ZERO, NUM_INT, NUM_FRAC):
            return [(NUM_E, 0, stack, 0)]
        if mode not in NUM_MAY_END:
            return []
        # the number ended; this byte is what follows it (the top level is an object, so a container is open)
        return self._step((AFTER, 0, stack, 0), b)


def _fewer(configs: set) -> set:
    """An ambiguous grammar's parses can double with every byte (``"(" x ")" | "(" x? ")"``): past
    ``MAX_CFG_CONFIGS`` only the shallowest stacks are kept. Each one left is a parse of the text so far that can
    still finish, so the output stays a sentence; only some continuations the dropped ones allowed are lost."""
    parses = sorted((c for c in configs if c[0] == CFG), key=lambda c: (len(c[1]), c[1]))
    return {c for c in configs if c[0] != CFG} | set(parses[:MAX_CFG_CONFIGS])


def _number_start(minus_mode: int, b: int, stack: tuple) -> list[Config]:
    """The first byte of a number (``minus_mode`` NUM_MINUS or INT_MINUS) or the first digit after its minus."""
    integer = minus_mode == INT_MINUS
    if b == 0x2D:
        return [(minus_mode, 0, stack, 0)]
    if b == 0x30:
        return [(INT_ZERO if integer else NUM_ZERO, 0, stack, 0)]
    return [(INT_DIGITS if integer else NUM_INT, 0, stack, 0)] if b in DIGITS else []


def _read(rule: StringRule, node: tuple, data: bytes, new_char: bool, stack: tuple) -> list[Config]:
    """A string's rule after ``data`` (bytes of its decoded text; ``new_char``: they begin a character)."""
    count = rule.counted(node[2]) if new_char else node[2]
    if count is None:
        return []
    positions = (node[1],)
    for b in data:
        positions = {q for p in positions for q in rule.regex.next(p, b)}
    return [(CSTR, (node[0], q, count), stack, 0) for q in positions if rule.alive(q, count)]


def _spellable(rule: StringRule, position: int, count: int, lo: int, hi: int) -> bool:
    """Whether some character in ``lo..hi`` (escapes spell them) may come next: a path of the rule's positions
    whose bytes meet each byte range of one of the characters' UTF-8 sequences (every byte combination of a
    sequence is such a character)."""
    after = rule.counted(count)
    if after is None:
        return False
    rx = rule.regex
    for a, z in without_surrogates([(lo, min(hi, 0xFFFF))]):
        for seq in utf8_sequences(a, z):
            positions = {position}
            for r in seq:
                m = byte_mask(*r)
                positions = {q for p in positions for q in rx.follow[p] if rx.masks[q] & m}
            if any(rule.alive(q, after) for q in positions):
                return True
    return False


def _literal_config(rest: frozenset, stack: tuple) -> list[Config]:
    # a literal spelled out to its end is a finished value: AFTER, so that equal states compare equal
    return [(AFTER, 0, stack, 0)] if rest == {b""} else [(LIT, rest, stack, 0)]


def _no_key(obj: ObjectNode) -> bytes | None:
    """The key slot of a fresh object frame: empty bytes to read a key into, None when keys need not be kept."""
    return b"" if obj.tracked else None


def _key_name(written: bytes) -> str:
    return json.loads(b'"' + written + b'"')


def _keyed(stack: tuple, b: int, key: bool) -> tuple:
    """``stack`` with ``b`` added to the key being read (``key``: the byte is part of a key), if its object keeps
    keys."""
    if not key or stack[-1][3] is None:
        return stack
    top = stack[-1]
    return stack[:-1] + (top[:3] + (top[3] + bytes([b]),),)


def _lead(string: int, stack: tuple, b: int) -> list[Config]:
    """The first byte of a multi-byte UTF-8 character in a string (RFC 3629: what Python's decoder accepts)."""
    if 0xC2 <= b <= 0xDF:
        due, first = 1, 0
    elif 0xE0 <= b <= 0xEF:
        due, first = 2, 1 if b == 0xE0 else 2 if b == 0xED else 0
    elif 0xF0 <= b <= 0xF4:
        due, first = 3, 3 if b == 0xF0 else 4 if b == 0xF4 else 0
    else:
        return []
    base = UTF8_STR if string == STR else UTF8_KEY
    return [(base + 10 * due + first, 0, _keyed(stack, b, base == UTF8_KEY), 0)]


def _continuation(mode: int, stack: tuple, b: int) -> list[Config]:
    base = UTF8_KEY if mode >= UTF8_KEY else UTF8_STR
    due, first = divmod(mode - base, 10)
    lo, hi = NEXT_RANGE[first]
    if not lo <= b <= hi:
        return []
    stack = _keyed(stack, b, base == UTF8_KEY)
    if due > 1:
        return [(base + 10 * (due - 1), 0, stack, 0)]
    return [(KEY_STR if base == UTF8_KEY else STR, 0, stack, 0)]


def _hex(mode: int, stack: tuple, b: int) -> list[Config]:
    if b not in HEX:
        return []
    base = U_KEY if mode >= U_KEY else U_STR
    left = mode - base
    stack = _keyed(stack, b, base == U_KEY)
    if left > 1:
        return [(base + left - 1, 0, stack, 0)]
    return [(KEY_STR if base == U_KEY else STR, 0, stack, 0)]


KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
                      "enum", "const", "anyOf", "allOf", "$ref", "pattern", "minLength", "maxLength"})
STRING_KEYWORDS = frozenset({"pattern", "minLength", "maxLength"})
_PYTHON_TYPES = {"object": dict, "array": list, "string": str, "number": (int, float), "integer": int,
                 "boolean": bool, "null": type(None)}


def _key_bytes(name: str) -> bytes:
    """A property name as written between its quotes."""
    return json.dumps(name, ensure_ascii=False)[1:-1].encode()


def _type_names(types, where: str) -> list[str]:
    """A schema's ``type`` (a name or a list of names) as a list of known names; anything else is a SchemaError."""
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not types or any(not isinstance(t, str) or t not in TYPES for t in types):
        raise SchemaError(f"{where}: type must be one or a list of {', '.join(TYPES)}")
    return types


def _literal_bytes(value, where: str) -> bytes:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    except ValueError:
        raise SchemaError(f"{where}: enum/const values must be finite JSON") from None


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_type(value, t: str) -> bool:
    if isinstance(value, bool) and t not in ("boolean",):
        return False
    return isinstance(value, _PYTHON_TYPES[t])


class _Compiler:
    """Schema -> nodes. ``$ref`` targets are compiled once (a placeholder choice first, so recursion ends)."""

    def __init__(self, grammar: Grammar, root):
        self.g, self.root, self.refs = grammar, root, {}

    def add(self, node) -> int:
        self.g.nodes.append(node)
        return len(self.g.nodes) - 1

    def node(self, s, where: str) -> int:
        if s is True:
            return ANY
        if not isinstance(s, dict):
            raise SchemaError(f"{where}: a schema must be an object or true")
        unknown = set(s) - KEYWORDS - ANNOTATIONS
        if unknown:
            raise SchemaError(f"{where}: {', '.join(sorted(unknown))} cannot be enforced by this server")
        constraints = set(s) & KEYWORDS
        if "$ref" in s or "allOf" in s or "anyOf" in s:
            if len(constraints) > 1:
                raise SchemaError(f"{where}: combine $ref, allOf or anyOf with no other keyword")
            return self._combined(s, where)
        if "const" in s or "enum" in s:
            return self._literals(s, where)
        types = s.get("type")
        if types is None:
            types = "object" if constraints & {"properties", "required", "additionalProperties"} else \
                "array" if "items" in s else "string" if constraints & STRING_KEYWORDS else None
        if types is None:
            return ANY
        nodes = [self._typed(t, s, where) for t in dict.fromkeys(_type_names(types, where))]
        return nodes[0] if len(nodes) == 1 else self.add(("anyof", tuple(nodes)))

    def _combined(self, s: dict, where: str) -> int:
        if "$ref" in s:
            return self._ref(s["$ref"], where)
        if "allOf" in s:
            if not isinstance(s["allOf"], list) or len(s["allOf"]) != 1:
                raise SchemaError(f"{where}: allOf of more than one schema cannot be enforced")
            return self.node(s["allOf"][0], f"{where}/allOf/0")
        alts = s["anyOf"]
        if not isinstance(alts, list) or not alts:
            raise SchemaError(f"{where}: anyOf needs a list of schemas")
        return self.add(("anyof", tuple(self.node(a, f"{where}/anyOf/{i}") for i, a in enumerate(alts))))

    def _ref(self, ref, where: str) -> int:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise SchemaError(f"{where}: only local $refs ('#/$defs/...') are supported, got {ref!r}")
        if ref in self.refs:
            return self.refs[ref]
        target = self.root
        for part in ref[2:].split("/") if ref != "#" else ():
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]  # into an anyOf's list
                continue
            if not isinstance(target, dict) or part not in target:
                raise SchemaError(f"{where}: $ref {ref!r} points nowhere")
            target = target[part]
        slot = self.refs[ref] = self.add(("anyof", ()))
        self.g.nodes[slot] = ("anyof", (self.node(target, ref),))
        return slot

    def _literals(self, s: dict, where: str) -> int:
        values = [s["const"]] if "const" in s else s["enum"]
        if not isinstance(values, list):
            raise SchemaError(f"{where}: enum must be a list")
        if s.get("type") is not None:
            types = _type_names(s["type"], where)
            values = [v for v in values if any(_is_type(v, t) for t in types if t in _PYTHON_TYPES)]
        if set(s) & STRING_KEYWORDS:
            rule = string_rule(s, where)
            values = [v for v in values if not isinstance(v, str) or rule.matches(v)]
        if not values:
            raise SchemaError(f"{where}: no value satisfies this enum/const")
        return self.add(("literals", frozenset(_literal_bytes(v, where) for v in values)))

    def _typed(self, t: str, s: dict, where: str) -> int:
        if t == "object":
            return self._object(s, where)
        if t == "array":
            least, most = s.get("minItems", 0), s.get("maxItems")
            if not _count(least) or not (most is None or _count(most) and most >= least):
                raise SchemaError(f"{where}: minItems and maxItems must be counts, minItems <= maxItems")
            return self.add(("array", self.node(s.get("items", True), f"{where}/items"), least, most))
        if t == "boolean":
            return self.add(("literals", frozenset({b"true", b"false"})))
        if t == "null":
            return self.add(("literals", frozenset({b"null"})))
        if t == "string" and set(s) & STRING_KEYWORDS:
            return self.add(("string", string_rule(s, where)))
        return self.add((t,))

    def _object(self, s: dict, where: str) -> int:
        props, required = s.get("properties", {}), s.get("required", [])
        if not isinstance(props, dict) or not isinstance(required, list) or \
                not all(isinstance(r, str) for r in required):
            raise SchemaError(f"{where}: properties must be an object and required a list of names")
        slot = self.add(None)  # an object's own id before its properties (which may refer back to it)
        nodes = {k: self.node(v, f"{where}/properties/{k}") for k, v in props.items()}
        extra = s.get("additionalProperties", True)
        extra = None if extra is False else self.node(extra, f"{where}/additionalProperties")
        req = frozenset(required)
        if extra is None and not req <= nodes.keys():
            raise SchemaError(f"{where}: required {sorted(req - nodes.keys())} not in "
                              f"properties, and no other properties are allowed")
        self.g.nodes[slot] = ("object", ObjectNode(nodes, req, extra))
        return slot
