"""Structured output in the engines: at every step, only tokens that keep the output a prefix of what the request's
grammar accepts (``dualpath.grammar``: a JSON object, one valid against a schema, or text matching a pattern) may be
sampled.

A token is allowed in a state when the grammar's automaton accepts all of its bytes from there. Masks over the
vocabulary are cached per grammar and state key: a token can close at most ``depth - 1`` containers, so whether it
is allowed depends only on the innermost ``depth`` open containers (and on whether more lie below). The output ends
(``complete``) the moment the top-level object closes; the model's end-of-sequence token is never needed, and never
allowed before. A pattern may also end where it could read on (``\\d+``): there, and only there, the model's end
tokens are allowed too, and one ends it.

Who calls it: an engine asks its ``GuideSource`` for one ``Guide`` per constrained request, passes ``guide.mask()``
to the sampler and ``advance``s it with every token the request takes (``Sequence.append``).
"""
from __future__ import annotations

import json
import sys
import threading
from bisect import bisect_left
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from dualpath.errors import CheckpointError, DualPathError
from dualpath.grammar import CFG, CSTR, DONE, FREE, REGEX, THINK_CLOSE, THINKING, Grammar, State

if TYPE_CHECKING:
    from dualpath.sampling_params import SamplingParams
    from dualpath.tokenizer import Tokenizer


class GuideError(DualPathError):
    """A token the guide does not allow was appended (a bug: the sampler only draws allowed tokens)."""


class Vocabulary:
    """A model's tokens as bytes, indexed for mask building: ``width`` logits per row (the model's vocabulary, which
    may be wider than the tokenizer's; ids without bytes are never allowed)."""

    def __init__(self, token_bytes: Sequence[bytes | None], width: int, end_ids: Sequence[int] = ()):
        self.token_bytes, self.width = token_bytes, width
        self.end_set = frozenset(t for t in end_ids if 0 <= t < width)  # the model's end tokens
        self.end_ids = np.asarray(sorted(self.end_set), dtype=np.int64)
        tokens = [(i, t) for i, t in enumerate(token_bytes[:width]) if t]  # ids past the logits are never sampled
        missing = sorted(set(range(0x20, 0x7F)) - {t[0] for _, t in tokens if len(t) == 1})
        if missing:
            raise CheckpointError(f"structured output needs a one-byte token for every printable ASCII character; "
                                  f"this vocabulary lacks {bytes(missing)[:20]!r}")
        # a token of whole characters, none a quote, backslash or control, leaves a free string as it was: allowed
        # in one without reading it
        plain = [_plain(t) for _, t in tokens]
        self.plain = np.asarray([i for (i, _), p in zip(tokens, plain) if p], dtype=np.int64)
        self.plain_chars = np.asarray([len(t.decode()) for (_, t), p in zip(tokens, plain) if p], dtype=np.int64)
        self.in_string = [tok for tok, p in zip(tokens, plain) if not p]
        # tokens in byte order: those sharing a prefix are a range, so a walk reads each shared prefix once
        ordered = sorted(tokens, key=lambda tok: tok[1])
        self.sorted_ids = np.asarray([i for i, _ in ordered], dtype=np.int64)
        self.sorted_bytes = [t for _, t in ordered]
        self.depth = 1 + max(t.count(b"}") + t.count(b"]") for _, t in tokens)
        self._with_byte: dict = {}  # byte -> the tokens that have it (with_byte)
        lens = np.fromiter(map(len, self.sorted_bytes), dtype=np.int64, count=len(self.sorted_bytes))
        has = np.zeros((len(self.sorted_bytes), 256), dtype=bool)  # which bytes each token has (~10 ms for 49K)
        has[np.repeat(np.arange(len(lens)), lens), np.frombuffer(b"".join(self.sorted_bytes), np.uint8)] = True
        self._byte_sets = np.packbits(has, axis=1)

    def with_byte(self, b: int) -> list[tuple[int, bytes]]:
        """The tokens (id, bytes) that have byte ``b``: in free text only those can complete a tag ending in it."""
        if b not in self._with_byte:
            self._with_byte[b] = [(i, t) for i, t in zip(self.sorted_ids.tolist(), self.sorted_bytes) if b in t]
        return self._with_byte[b]

    def made_of(self, byte_set: int) -> np.ndarray:
        """Which byte-sorted tokens (in ``sorted_ids``' order) are made only of bytes in ``byte_set`` (256 bits)."""
        outside = np.packbits([not byte_set >> b & 1 for b in range(256)])
        return ~(self._byte_sets & outside).any(axis=1)

    def bytes_of(self, token: int) -> bytes | None:
        return self.token_bytes[token] if 0 <= token < len(self.token_bytes) else None


def _plain(t: bytes) -> bool:
    if b'"' in t or b"\\" in t or min(t) < 0x20:
        return False
    try:
        t.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class Recent:
    """The ``size`` most recently used values, each built on first use (thread-safe). An engine keeps its masks in
    one (512, whatever their grammar: a mask is a vocabulary's width of bytes on the device, 49 KB for SmolLM2,
    152 KB for Qwen2.5, so the budget is one for all grammars) and its compiled grammars in another."""

    def __init__(self, size: int = 512):
        self.size = size
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key, build: Callable[[], object]):
        with self._lock:
            found = self._items.get(key)
            if found is None:
                found = self._items[key] = build()
                if len(self._items) > self.size:
                    self._items.popitem(last=False)
            else:
                self._items.move_to_end(key)
            return found


BROAD_BYTES = 16  # a pattern state reading more next bytes than this has its mask built from class sequences
JSON_STRING_BYTES = (1 << 0x22, 1 << 0x5C, (1 << 0x20) - 1)  # a quote, a backslash, control bytes: not text


class GrammarMasks:
    """One grammar's masks over a vocabulary: boolean tensors on ``device``, kept in ``cache`` (shared by an engine's
    grammars, each under its own ``name``: the schema and text around it; by default an identity of its own)."""

    def __init__(self, grammar: Grammar, vocab: Vocabulary, device: torch.device | str, cache: Recent | None = None,
                 name=None):
        self.grammar, self.vocab, self.device = grammar, vocab, torch.device(device)
        self.cache = cache if cache is not None else Recent()
        self.name = name if name is not None else object()  # an object() equals only itself
        self._classes: dict = {}  # pattern (-1: the grammar's, else a string rule's node) -> its byte classes
        self._sequences: dict = {}  # pattern -> the tokens it may read as class sequences (ClassSequences)
        self._loops: dict = {}  # bytes into a loop (256 bits) -> the tokens made of them, the rest and its bytes
        self._bits: list[int] | None = None  # the bytes of each of the grammar's own byte classes

    def guide(self) -> "Guide":
        return Guide(self)

    def mask(self, state: State) -> torch.Tensor:
        """Which tokens may come next in ``state``: a ``[width]`` boolean tensor (shared; do not modify)."""
        d = self.vocab.depth
        key = frozenset((m, n, s[-d:], len(s) > d, w) for m, n, s, w in state)
        cut = frozenset((m, n, s[-d:], w) for m, n, s, w in state)
        return self.cache.get((self.name, key), lambda: torch.from_numpy(self._allowed(cut)).to(self.device))

    def _allowed(self, state: State) -> np.ndarray:
        allowed = self._text(state)
        if Grammar.may_end(state) and not Grammar.complete(state):
            allowed[self.vocab.end_ids] = True
        return allowed

    def _text(self, state: State) -> np.ndarray:
        """The tokens whose bytes the grammar accepts from ``state``."""
        g, v = self.grammar, self.vocab
        allowed = np.zeros(v.width, dtype=bool)
        modes = {c[0] for c in state}
        if modes == {THINKING} or modes == {FREE}:  # free text: only a token with the tag's last byte may end it
            allowed[v.sorted_ids] = True
            for i, t in v.with_byte(THINK_CLOSE.encode()[-1] if THINKING in modes else g.prefix[-1]):
                allowed[i] = g.run(state, t) is not None
            return allowed
        room = g.plain_room(state)
        if room is not None:  # inside a string: text tokens up to the room are allowed, the rest read
            allowed[v.plain if room == sys.maxsize else v.plain[v.plain_chars <= room]] = True
            return self._in_string(state, allowed)
        source = self._pattern_of(state)
        if source is not None and self._broad(state, source):
            classes = self._class_sequences(source)  # tokens of one class sequence step alike
            if source < 0 and (looped := self._looped(state, len(classes.seqs))) is not None:
                return looped
            reps = classes.reps
            taken = accepted(lambda st, k: g.step(st, reps[k]), classes.seqs, state)
            allowed[classes.ids[taken[classes.seq_of]]] = True
            return allowed if source < 0 else self._in_string(state, allowed)
        allowed[v.sorted_ids[accepted(g.step, v.sorted_bytes, state)]] = True
        return allowed

    def _in_string(self, state: State, allowed: np.ndarray) -> np.ndarray:
        """``allowed`` with the tokens that are not plain text (a quote, a backslash, a control byte, part of a
        character), each read from ``state``."""
        for i, t in self.vocab.in_string:
            if self.grammar.run(state, t) is not None:
                allowed[i] = True
        return allowed

    def _pattern_of(self, state: State) -> int | None:
        """Which pattern every configuration of ``state`` is reading: -1 the grammar's own (``Grammar.pattern``,
        or ``Grammar.ebnf``'s positions), a node id a string's rule; None if they read anything else."""
        if self.grammar.automaton is not None and all(c[0] in (REGEX, CFG, DONE) for c in state):
            return -1
        rules = {c[1][0] for c in state if c[0] == CSTR}
        if len(rules) == 1 and all(c[0] == CSTR for c in state):
            (rid,) = rules
            return rid if not self.grammar.nodes[rid][1].bounded_text else None
        return None

    def _broad(self, state: State, source: int) -> bool:
        """Whether more than ``BROAD_BYTES`` bytes may come next in a pattern's state: there a walk over the tokens
        visits most of them, and one over their class sequences pays (its index costs ~15 ms once per pattern);
        a narrow state's walk stops after a byte or two."""
        table, reps = self._byte_classes(source)
        fan = sum(table.count(k) for k in range(len(reps)) if self.grammar.step(state, reps[k]) is not None)
        return fan > BROAD_BYTES

    def _looped(self, state: State, sequences: int) -> np.ndarray | None:
        """The mask of a state from which many bytes lead into a loop over them (a free-text loop, ``[^\\n]*``, a
        grammar's string; or the state before one: an opening quote): a token of those bytes only reads into the
        loop and round it, so it is allowed without a walk; the others are walked. None where at most
        ``BROAD_BYTES`` bytes do, or where more tokens are left to walk than the grammar has class ``sequences`` (a
        walk over those is then shorter: a sentence's ``[a-z]*`` leaves most tokens out)."""
        into, entry = self._most_taken(state)
        if entry.bit_count() <= BROAD_BYTES or (into != state and entry & ~self._loop_bytes(into)):
            return None
        if entry not in self._loops:  # None: more tokens left than class sequences (each byte set decided once)
            inside = self.vocab.made_of(entry)
            rest = np.flatnonzero(~inside)
            self._loops[entry] = None if len(rest) > sequences else \
                (np.flatnonzero(inside), rest, [self.vocab.sorted_bytes[i] for i in rest])
        if self._loops[entry] is None:
            return None
        inside, rest, rest_bytes = self._loops[entry]
        allowed = np.zeros(self.vocab.width, dtype=bool)
        allowed[self.vocab.sorted_ids[inside]] = True
        allowed[self.vocab.sorted_ids[rest[accepted(self.grammar.step, rest_bytes, state)]]] = True
        return allowed

    def _most_taken(self, state: State) -> tuple[State | None, int]:
        """The state most bytes lead to from ``state``, and those bytes (256 bits)."""
        _, reps = self._byte_classes(-1)
        into: dict = {}
        for k, bits in enumerate(self._class_bits()):
            after = self.grammar.step(state, reps[k])
            if after is not None:
                into[after] = into.get(after, 0) | bits
        return max(into.items(), key=lambda kv: kv[1].bit_count(), default=(None, 0))

    def _loop_bytes(self, state: State) -> int:
        """The bytes that lead ``state`` back to itself."""
        _, reps = self._byte_classes(-1)
        return sum(bits for k, bits in enumerate(self._class_bits()) if self.grammar.step(state, reps[k]) == state)

    def _class_bits(self) -> list[int]:
        """The bytes of each of the grammar's own byte classes (256-bit sets)."""
        if self._bits is None:
            table, reps = self._byte_classes(-1)
            self._bits = [sum(1 << b for b in range(256) if table[b] == k) for k in range(len(reps))]
        return self._bits

    def _byte_classes(self, source: int) -> tuple[bytes, bytes]:
        """The pattern's byte classes (``Regex.byte_classes``); in a string, JSON's quote, backslash and control
        bytes apart too (so a class's representative is plain text where its bytes are)."""
        if source not in self._classes:
            regex = self.grammar.automaton if source < 0 else self.grammar.nodes[source][1].regex
            self._classes[source] = regex.byte_classes(() if source < 0 else JSON_STRING_BYTES)
        classes = self._classes[source]
        return classes[:256], classes[256:]

    def _class_sequences(self, source: int) -> "ClassSequences":
        """The tokens a pattern's state may take as class sequences: every token for the grammar's own pattern,
        the plain-text ones in a string (the others are read one by one)."""
        if source not in self._sequences:
            v = self.vocab
            if source < 0:
                tokens, ids = v.sorted_bytes, v.sorted_ids
            else:
                tokens, ids = [v.token_bytes[i] for i in v.plain], v.plain
            self._sequences[source] = ClassSequences(tokens, ids, self._byte_classes(source))
        return self._sequences[source]


def accepted(step: Callable, toks: Sequence[bytes], state: State) -> np.ndarray:
    """Which of ``toks`` (sorted) ``step`` reads whole from ``state``, walking them as a trie: each next byte is
    stepped once for all tokens that share the prefix before it, and each (state, byte) once per walk (different
    prefixes often reach one state: any character of a class)."""
    taken = np.zeros(len(toks), dtype=bool)
    steps: dict = {}

    def walk(state: State, lo: int, hi: int, depth: int) -> None:
        i = lo
        while i < hi and len(toks[i]) == depth:  # these tokens end here: all their bytes were read
            taken[i] = True
            i += 1
        while i < hi:
            b = toks[i][depth]
            j = bisect_left(toks, toks[i][:depth] + bytes([b + 1]), i, hi) if b < 255 else hi
            key = (state, b)
            nxt = steps[key] if key in steps else steps.setdefault(key, step(state, b))
            if nxt is not None:
                walk(nxt, i, j, depth + 1)
            i = j

    walk(state, 0, len(toks), 0)
    return taken


class ClassSequences:
    """Tokens seen through a pattern's byte classes (``Regex.byte_classes``): each as the sequence of its bytes'
    classes. In a pattern's states bytes of one class step alike, so a mask needs one walk over the distinct
    sequences (a few thousand, where a broad class makes most of 49K tokens alike) instead of the tokens."""

    def __init__(self, tokens: Sequence[bytes], ids: np.ndarray, classes: tuple[bytes, bytes]):
        table, self.reps = classes  # byte -> class; class -> a byte of it
        of_tokens = [t.translate(table) for t in tokens]
        self.seqs = sorted(set(of_tokens))
        index = {seq: i for i, seq in enumerate(self.seqs)}
        self.seq_of = np.asarray([index[seq] for seq in of_tokens], dtype=np.int32)  # per token
        self.ids = ids


class Guide:
    """One request's place in its grammar."""

    def __init__(self, masks: GrammarMasks):
        self.masks = masks
        self.state: State = masks.grammar.start

    def mask(self) -> torch.Tensor:
        return self.masks.mask(self.state)

    def advance(self, token: int) -> None:
        vocab = self.masks.vocab
        if token in vocab.end_set and Grammar.may_end(self.state):  # the set first: this runs every token
            self.state = frozenset({(DONE, 0, (), 0)})  # an end token ends a pattern that could read on
            return
        data = vocab.bytes_of(token)
        after = self.masks.grammar.run(self.state, data) if data else None
        if after is None:
            raise GuideError(f"token {token} ({data!r}) cannot continue the structured output")
        self.state = after

    @property
    def complete(self) -> bool:
        return Grammar.complete(self.state)


class GuideSource:
    """An engine's guides. The vocabulary is indexed on the first constrained request (a tokenizer load and a pass
    over it, ~0.4 s for 49K tokens), so engines that never see one pay nothing; an engine loop checks ``ready`` and
    has ``warm`` run on a helper thread first, so that pass never stalls the requests it is running. Compiled
    schemas and their masks are kept for the ``schemas`` most recent schemas (agents send the same few again and
    again), their masks in one cache for all."""

    def __init__(self, tokenizer: Callable[[], "Tokenizer"], width: int, device: torch.device | str,
                 end_ids: Sequence[int] = (), schemas: int = 32):
        self._tokenizer, self._width, self._device, self._end_ids = tokenizer, width, device, tuple(end_ids)
        self._vocab: Vocabulary | None = None
        self._error: Exception | None = None  # the vocabulary pass failed: every guide_for raises it
        self._compiled = Recent(schemas)  # by compile_grammar's arguments (JSON mode's schema is None)
        self._masks = Recent()
        self._lock = threading.Lock()

    def ready(self, params: "SamplingParams") -> bool:
        """Whether ``guide_for(params)`` needs no vocabulary pass first (it answers at once, or raises why the
        pass failed)."""
        return not params.structured or self._vocab is not None or self._error is not None

    def warm(self) -> None:
        """Index the vocabulary (once; callers wait for a pass in progress). Raises what ``guide_for`` would; a
        failed pass is not tried again."""
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._vocab is None:
                try:
                    self._vocab = Vocabulary(self._tokenizer().token_bytes, self._width, self._end_ids)
                except Exception as e:
                    self._error = e
                    raise

    def guide_for(self, params: "SamplingParams", read: Sequence[int] = ()) -> Guide | None:
        """A guide for ``params``' structured output (None if it has none) that has read the tokens ``read`` (a
        resumed reply's own: ``Sequence.resumed``); a token its grammar refuses raises ``GuideError``."""
        if not params.structured:
            return None
        self.warm()
        key = (params.json_schema, params.json_prefix.encode(), params.json_suffix.encode(), params.json_thinking,
               params.regex, params.grammar, params.json_trigger, tuple(b.encode() for b in params.json_branches))
        build = lambda: GrammarMasks(compile_grammar(*key), self._vocab, self._device, self._masks, key)  # noqa: E731
        guide = self._compiled.get(key, build).guide()
        for token in read:
            guide.advance(token)
        return guide


def compile_grammar(schema: str | None, prefix: bytes, suffix: bytes, thinking: str,
                    regex: str | None = None, grammar: str | None = None, trigger: bool = False,
                    branches: tuple[bytes, ...] = ()) -> Grammar:
    if grammar is not None:
        return Grammar.ebnf(grammar, prefix, suffix, thinking)
    if regex is not None:
        return Grammar.pattern(regex, prefix, suffix, thinking)
    if schema is None:
        return Grammar.json_object(prefix, suffix, thinking, trigger)
    return Grammar.compile(json.loads(schema), prefix, suffix, thinking, trigger, branches)

