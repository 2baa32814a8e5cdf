"""Structured output's grammars: what a constrained reply may be, written for llguidance (the structured-output
engine vLLM and SGLang ship; https://github.com/guidance-ai/llguidance), which compiles it and masks the vocabulary
(``dualpath.engines.guided``).

A request's ``SamplingParams`` fields are one ``Constraint``: its *answer* is a JSON value (JSON mode's any object,
or one valid against a JSON schema: llguidance's JSON Schema coverage), text a regular expression matches whole
(Rust ``regex`` syntax, with ``\\d \\w \\s`` in their ASCII meanings as Python's ``re.ASCII`` has them), or a
sentence of a context-free grammar (GBNF, llama.cpp's EBNF, or llguidance's Lark syntax). Around it the constraint
may fix text: a ``prefix`` and ``suffix`` (a forced tool call's markup), per-alternative ``branches`` (a function's
name before its arguments: one text per alternative of the schema's top-level ``anyOf``), a ``trigger`` (free text in
which each ``prefix`` begins an answer, then its ``suffix``, then free text again: strict tool calls), and thinking
first (free text up to ``</think>``: "open" when the prompt opened the block, "optional" when the reply may open one).

``grammar`` writes that as llguidance's grammar (a Lark grammar for the frame, the answer a named sub-grammar);
``check`` (the frontend's, in a checker process that can be stopped) and ``compile`` (the engines', a matcher over
their vocabulary) refuse, within a time limit, what llguidance cannot compile, does not come back from, or what
matches nothing or only the empty string, with a ``GrammarError`` naming the field and the reason. A JSON answer may
start with whitespace and has at most ``MAX_WS`` whitespace bytes between its tokens (a model cannot loop on
newlines); it ends as its value closes where nothing can follow (an object's brace): the matcher stops there. A
pattern or a grammar may end where more could follow (``\\d+``): there the model's end token is allowed too.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import re
import resource
import select
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dualpath.core.errors import RequestError
from dualpath.core.sampling_params import THINKING_MODES, SamplingParams

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # a reasoning model's thinking (dualpath.serving.reasoning)
KINDS = ("json", "regex", "grammar")
MAX_WS = 32  # whitespace bytes in a row before and inside a JSON answer, and after the thinking
COMPILE_SECONDS = 5.0  # a constraint that takes longer to compile (and check) is refused
MAX_REASON_CHARS = 2000  # of llguidance's error message, in a refusal
WS_RX = f"[ \\t\\n\\r]{{0,{MAX_WS}}}"  # up to MAX_WS whitespace bytes
WS = f"/{WS_RX}/"  # the same as a Lark terminal
JSON_OPTIONS = {
    "whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{1,{MAX_WS}}}",  # llguidance's JSON compile options
    "json_allow_general_unicode_escapes": True,
}  # \u00e9 as json.dumps writes it by default
_FIELDS = {"json": "response_format", "regex": "regex", "grammar": "grammar"}


class GrammarError(RequestError):
    """A constraint llguidance cannot compile, that takes too long to, or that matches nothing (or only "")."""

    def __init__(self, message: str, field: str):
        super().__init__(message, field=field)


@dataclass(frozen=True)
class Constraint:
    """What a constrained reply may be (the module's docstring): ``kind`` one of ``KINDS``; ``source`` the schema
    as JSON text (None: any object), the pattern, or the grammar's text."""

    kind: str
    source: str | None = None
    prefix: str = ""
    suffix: str = ""
    thinking: str = ""
    trigger: bool = False
    branches: tuple[str, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS or self.thinking not in THINKING_MODES:
            raise ValueError(f"kind is one of {KINDS} and thinking one of {THINKING_MODES}")
        if (self.trigger or self.branches) and self.kind != "json":
            raise ValueError("a trigger and branches hold JSON answers")
        if self.trigger and not self.prefix:
            raise ValueError("a trigger is a prefix: free text until it, then the answer")

    @classmethod
    def of(cls, params: "SamplingParams") -> "Constraint | None":
        """The constraint of a request's sampling parameters (None: unconstrained)."""
        if not params.structured:
            return None
        kind, source = (
            ("regex", params.regex)
            if params.regex is not None
            else ("grammar", params.grammar)
            if params.grammar is not None
            else ("json", params.json_schema)
        )
        return cls(
            kind,
            source,
            params.json_prefix,
            params.json_suffix,
            params.json_thinking,
            params.json_trigger,
            params.json_branches,
        )

    @property
    def field(self) -> str:
        """The request field a refusal names."""
        return "tools" if self.trigger or self.branches else _FIELDS[self.kind]


def choice_pattern(choices) -> str:
    """A pattern that matches exactly one of ``choices`` (vLLM's ``guided_choice``)."""
    if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarError("guided_choice: a choice needs a non-empty list of strings", field="guided_choice")
    return "(?:" + "|".join(re.escape(c) for c in choices) + ")"


# --- the grammar ---------------------------------------------------------------------------------------------------
def grammar(c: Constraint) -> str:
    """llguidance's grammar for ``c`` (its JSON form: a Lark grammar for the frame first, then the answer's
    grammars, which the frame names ``@a0``, ``@a1``, ...). Raises GrammarError for a source that cannot be read."""
    answers = _answers(c)
    rules = ["start: " + _start(c), *_reply(c)]
    grammars = [{"lark_grammar": "\n".join(rules) + "\n"}]
    grammars += [{"name": f"a{i}", **g} for i, g in enumerate(answers)]
    return json.dumps({"grammars": grammars})


def _start(c: Constraint) -> str:
    """The reply: the thinking (if any), then the answer."""
    bare_json = c.kind == "json" and not (c.prefix or c.branches)  # (the answer's own whitespace leads it)
    lead = "" if bare_json or c.trigger else f" {WS}"  # whitespace after the thinking
    if c.thinking == "open":
        return f"thought{lead} reply\nthought[lazy]: {_text_rx('(?s:.*)', THINK_CLOSE)}"
    if c.thinking == "optional":
        return (
            f"(opening thought)?{lead} reply\nopening: {_text_rx(WS_RX, THINK_OPEN)}\n"
            f"thought[lazy]: {_text_rx('(?s:.*)', THINK_CLOSE)}"
        )
    return "reply"


def _reply(c: Constraint) -> list[str]:
    """The reply's rules: the answer inside its fixed text, or free text with triggered answers."""
    lead = f"{WS} " if c.kind == "json" else ""
    if c.branches:
        body = " | ".join(f"{_literal(b)} {lead}@a{i}".strip() for i, b in enumerate(c.branches))
    else:
        body = f"{lead}@a0"
    rules = [f"body: {body}"]
    if not c.trigger:
        return [f"reply: {_literal(c.prefix)} body {_literal(c.suffix)}".replace("  ", " ")] + rules
    trigger = _text_rx("", c.prefix)[1:-1]  # the prefix as a regex, without its slashes
    return [
        "reply: call* free",
        f"call: head body {_literal(c.suffix)}".rstrip(),
        f"head[lazy]: /(?s:.*){trigger}/",
        "free: FREE",
        f"FREE: /(?s:.*)/ & ~/(?s:.*){trigger}(?s:.*)/",
    ] + rules  # no trigger outside a call


def _answers(c: Constraint) -> list[dict]:
    """The answer's grammars: one, or (with branches) one per alternative of the schema's top-level anyOf."""
    if c.kind == "regex":
        from llguidance import regex_to_lark

        return [{"lark_grammar": f"start: /{regex_to_lark(c.source, 'dws')}/\n"}]  # \d \w \s in ASCII (re.ASCII)
    if c.kind == "grammar":
        return [{"lark_grammar": _lark(c.source)}]
    schema = {"type": "object"} if c.source is None else _schema(c.source)
    if not c.branches:
        return [{"json_schema": _with_options(schema)}]
    alts = schema.get("anyOf") if isinstance(schema, dict) else None
    if not isinstance(alts, list) or len(alts) != len(c.branches):
        raise GrammarError(
            f"json_schema: {len(c.branches)} branches need a top-level anyOf of as many schemas", field="tools"
        )
    # alternative i as the only one left of the anyOf, so that "#/anyOf/i/..." references still resolve
    return [
        {"json_schema": _with_options({**schema, "anyOf": [a if j == i else False for j, a in enumerate(alts)]})}
        for i in range(len(alts))
    ]


def _schema(source: str) -> Any:
    try:
        return json.loads(source)
    except ValueError as e:
        raise GrammarError(f"json_schema: not JSON ({e})", field="response_format") from None


def _with_options(schema: Any) -> Any:
    """``schema`` with the JSON options (whitespace cap, escapes) where it gives none of its own."""
    if not isinstance(schema, dict) or "x-guidance" in schema:
        return schema  # (a boolean schema, or the caller's own options)
    return {"x-guidance": JSON_OPTIONS, **schema}


def _lark(text: str) -> str:
    """A GBNF grammar as Lark (a Lark grammar as it is)."""
    from llguidance import gbnf_to_lark as converter

    if not isinstance(text, str):
        raise GrammarError("grammar: a grammar is a string", field="grammar")
    # llguidance 1.9's converter writes a repetition of a repetition without parentheses ("a"** for (("a")*)*),
    # which its own Lark reader refuses: a repetition is no atom (the one place the converter asks)
    converter.RepetitionNode.is_atomic = lambda self: False
    try:
        return text if converter.is_lark_syntax(text) else converter.gbnf_to_lark(_unicode_escapes(text))
    except Exception as e:  # noqa: BLE001 - the converter raises plain exceptions for every malformed grammar
        raise GrammarError(f"grammar: {e}", field="grammar") from None


_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|.)", re.DOTALL)


def _unicode_escapes(gbnf: str) -> str:
    """GBNF's ``\\uXXXX`` and ``\\UXXXXXXXX`` escapes spelled as the converter keeps them: the character itself
    past ASCII (never GBNF syntax), ``\\xXX`` below (llguidance 1.9's converter writes ``\\u00e9`` as ``\\ue9``,
    which its Lark reader refuses). Other escapes, an escaped backslash's included, stay as they are."""

    def spelled(m: re.Match) -> str:
        code = m.group(1) or m.group(2)
        if code is None:
            return m.group(0)
        cp = int(code, 16)
        if cp < 0x80:
            return f"\\x{cp:02x}"
        return chr(cp) if cp <= 0x10FFFF and not 0xD800 <= cp < 0xE000 else m.group(0)  # (else: refused later)

    return _ESCAPE.sub(spelled, gbnf)


def _literal(text: str) -> str:
    """Fixed text as a Lark terminal ("" for none)."""
    return _text_rx("", text) if text else ""


def _text_rx(head: str, text: str) -> str:
    """A Lark regex terminal: the regex ``head``, then ``text`` spelled exactly (each character as ``\\x{..}``
    unless it is a letter or digit, so no character is read as syntax)."""
    spelled = "".join(ch if ch.isascii() and ch.isalnum() else f"\\x{{{ord(ch):x}}}" for ch in text)
    return f"/{head}{spelled}/"


# --- compiling -------------------------------------------------------------------------------------------------
_byte_tokenizer: list = []  # llguidance's one-byte-per-token tokenizer (built on first use)
_lock = threading.Lock()


def compile(
    c: Constraint,
    tokenizer: "LLTokenizer | None" = None,  # noqa: A001 - what it does
    seconds: float | None = None,
) -> "LLMatcher":
    """A fresh llguidance matcher of ``c`` over ``tokenizer`` (default: one token per byte), its first mask
    computed. Compiled on a thread of its own (llguidance lets go of Python's lock while it works) and given up after
    ``seconds`` (default ``COMPILE_SECONDS``; the thread runs on, and nobody waits for it); raises GrammarError for a
    constraint that does not compile in time, or that matches only the empty string. The engines call it for
    constraints ``check`` passed."""
    return _compiled(
        grammar(c),
        tokenizer if tokenizer is not None else byte_tokenizer(),
        c.field,
        COMPILE_SECONDS if seconds is None else seconds,
    )


def _compiled(text: str, tok: "LLTokenizer", field: str, seconds: float) -> "LLMatcher":
    done: list = []

    def run():
        try:
            done.append(_matcher(tok, text))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            done.append(e)

    worker = threading.Thread(target=run, daemon=True, name="grammar-compile")
    worker.start()
    worker.join(seconds)
    if not done:
        raise GrammarError(f"{field}: took longer than {seconds:g} s to compile", field=field)
    if isinstance(done[0], BaseException):
        raise done[0]
    matcher, first = done[0]
    reason = _refusal(matcher, first, tok)
    if reason:
        raise GrammarError(f"{field}: {reason}", field=field)
    return matcher


def _matcher(tok: "LLTokenizer", text: str) -> tuple["LLMatcher", bytes]:
    """A matcher of ``text`` over ``tok`` and its first mask (a grammar that derives nothing is an error only once
    the matcher looks for a first token)."""
    from llguidance import LLMatcher, LLParserLimits

    matcher = LLMatcher(tok, text, log_level=0, limits=LLParserLimits(verbose_errors=False))
    return matcher, b"" if matcher.is_error() else matcher.compute_bitmask()


def _refusal(matcher: "LLMatcher", first: bytes, tok: "LLTokenizer") -> str | None:
    """Why a matcher with its first mask ``first`` is refused (None: it is not)."""
    if matcher.is_error():
        return _reason(matcher.get_error())
    if not _any_but(first, tok.eos_tokens):
        return "matches only the empty string (a reply needs a token)"
    return None


def _any_but(bitmask: bytes, tokens) -> bool:
    """Whether ``bitmask`` (llguidance's: bit ``t % 8`` of byte ``t // 8``) allows a token not among ``tokens``."""
    mask = bytearray(bitmask)
    for t in tokens:
        if t // 8 < len(mask):
            mask[t // 8] &= ~(1 << t % 8) & 0xFF
    return any(mask)


def byte_tokenizer() -> "LLTokenizer":
    """llguidance's tokenizer of one token per byte (and an end token, 256 + 5)."""
    with _lock:
        if not _byte_tokenizer:
            from llguidance import LLTokenizer

            _byte_tokenizer.append(LLTokenizer("byte"))
        return _byte_tokenizer[0]


# --- checking, in a process of its own ---------------------------------------------------------------------------
CHECK_WALKS, CHECK_STEPS = 4, 48  # random walks over a constraint's masks a check takes, bytes per walk
CHECK_MEMORY = 4 << 30  # bytes of address space a checker process may take
MAX_CHECKERS = 4  # checker processes at once (a check waits for one, within its time limit)


def check(c: Constraint) -> None:
    """Raise GrammarError where ``c`` does not compile, matches nothing or only "", or where llguidance does not come
    back from compiling it or from the masks of a few random walks over it within ``COMPILE_SECONDS``: what the
    frontend runs before any engine sees a request. It runs in a checker process (``_Checker``): llguidance 1.9 loops
    on some grammars, taking memory as it goes (``root ::= r r`` with ``r ::= "a"+``: its first mask never returns),
    and only a process can be stopped."""
    texts = [grammar(c)] + [json.dumps({"grammars": [a]}) for a in _answers(c)]  # (the answer alone: a schema no
    reason = _checkers.run(texts, COMPILE_SECONDS)  # value satisfies matches nothing)
    if reason:
        raise GrammarError(f"{c.field}: {reason}", field=c.field)


def _check_texts(texts: list[str]) -> str | None:
    """In a checker: why the grammars ``texts`` (a constraint's, then its answers' alone) are refused, or None."""
    tok = byte_tokenizer()
    matcher, first = _matcher(tok, texts[0])
    reason = _refusal(matcher, first, tok)
    for text in texts[1:]:
        alone, _ = _matcher(tok, text)
        reason = reason or (_reason(alone.get_error()) if alone.is_error() else None)
    if reason:
        return reason
    rng = random.Random(zlib.crc32(texts[0].encode()))  # the same walks for the same constraint
    for _ in range(CHECK_WALKS):
        matcher.reset()
        for _ in range(CHECK_STEPS):
            mask = matcher.compute_bitmask()
            nexts = [b for b in range(256) if mask[b // 8] >> (b % 8) & 1]
            if not nexts or not matcher.consume_token(rng.choice(nexts)):
                break
    return _reason(matcher.get_error()) if matcher.is_error() else None


class _Checker:
    """A checker process (``python -m dualpath.core.structured``): grammars in, one JSON line each way, its address space
    capped at ``CHECK_MEMORY``. One that does not answer in time is killed."""

    def __init__(self):
        root = str(Path(__file__).resolve().parents[2])  # where this dualpath is, whatever the caller's sys.path
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dualpath.core.structured"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            env=env,
        )

    def ask(self, texts: list[str], seconds: float) -> str | None:
        """The checker's answer (``_check_texts``'); raises TimeoutError past ``seconds`` and EOFError where the
        checker died (its memory cap)."""
        self.proc.stdin.write(json.dumps(texts) + "\n")
        self.proc.stdin.flush()
        if not select.select([self.proc.stdout], [], [], seconds)[0]:
            raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError
        return json.loads(line)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class _Checkers:
    """Checker processes: up to ``MAX_CHECKERS``, started on first use, one check each at a time, kept for the next
    when they answered (a killed one is started again when needed)."""

    def __init__(self):
        self._idle: list[_Checker] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CHECKERS)

    def run(self, texts: list[str], seconds: float) -> str | None:
        start = time.monotonic()
        if not self._slots.acquire(timeout=seconds):
            return f"took longer than {seconds:g} s to compile and check (the server is busy checking others)"
        try:
            with self._lock:
                checker = self._idle.pop() if self._idle else None
            checker = checker or _Checker()
            try:
                reason = checker.ask(texts, max(0.0, seconds - (time.monotonic() - start)))
            except TimeoutError:
                checker.kill()
                return f"took longer than {seconds:g} s to compile and check"
            except (EOFError, OSError, ValueError):
                checker.kill()
                return "ran out of memory (or failed) compiling"
            with self._lock:
                self._idle.append(checker)
            return reason
        finally:
            self._slots.release()

    def close(self) -> None:
        """Stop the idle checkers (at exit)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for checker in idle:
            checker.kill()


_checkers = _Checkers()
atexit.register(_checkers.close)


def _serve_checks() -> None:
    """A checker process's loop (``_Checker``): a JSON list of grammars in, why they are refused (or null) out. It
    ends with its parent (the end of its input may not come while other children hold the pipe)."""
    resource.setrlimit(resource.RLIMIT_AS, (CHECK_MEMORY, CHECK_MEMORY))
    parent = os.getppid()

    def orphaned():
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(0)

    threading.Thread(target=orphaned, daemon=True).start()
    for line in sys.stdin:
        try:
            reason = _check_texts(json.loads(line))
        except Exception as e:  # noqa: BLE001 - a reason for the request, not the checker's end
            reason = f"does not compile ({e})"
        print(json.dumps(reason), flush=True)


def _reason(error: str) -> str:
    """llguidance's error message, shortened: without the listing of the grammar it compiled (the frame's, not the
    request's), and without its state dump."""
    lines = []
    for line in error.splitlines():
        if re.match(r"\s+\d+ \| ", line) or line.startswith("<"):  # a listing, <state>, <non-verbose/>
            break
        lines.append(line.rstrip())
    reason = "\n".join(lines).strip() or "does not compile"
    if reason.startswith("NoExtension"):  # the first mask found no way on: nothing matches
        reason = "matches nothing"
    return reason[:MAX_REASON_CHARS]


if __name__ == "__main__":
    _serve_checks()
