"""Tool calls in a chat completion's text, for OpenAI's ``tools`` (function calling).

The model sees the request's tools through its chat template and answers with calls in the markup the template
taught it; this module finds them. Three markups are known, each recognised from the template's text:

- ``Hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in the reply (Qwen2 and
  Qwen2.5 and the many templates that copied theirs);
- ``Llama3Json``: a reply that *is* the calls, JSON objects ``{"name": ..., "parameters": {...}}`` separated by
  ``;``, optionally after ``<|python_tag|>`` (Llama 3.1-3.3's JSON tool calling);
- ``DeepSeekV3``: ``<｜tool▁calls▁begin｜>`` then per call ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>name``, the
  arguments in a json code block, ``<｜tool▁call▁end｜>``, then ``<｜tool▁calls▁end｜>`` (DeepSeek-V3, the paper's
  model); DeepSeek-V3.1 writes ``<｜tool▁call▁begin｜>name<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>``. Both parse;
  a forced call is written in the template's own form.

``ToolCallSplitter`` is fed the completion's text as it streams and returns the content that can be shown at once;
from where calls may begin the text is held until the end, when ``finish`` parses it. Held text that is not valid
calls to the request's tools becomes content again: nothing the model wrote is lost, and no call is invented.
"""
from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from dualpath.errors import RequestError


class ToolMarkup(ABC):
    """How one family of chat templates writes tool calls. ``ToolCallSplitter`` calls these with the whole reply so
    far; they keep no state."""

    @abstractmethod
    def start(self, text: str) -> int:
        """Where calls begin in ``text``, or -1 while none has begun."""

    @abstractmethod
    def undecided(self, text: str) -> int:
        """How many trailing characters of ``text`` (with no call begun) may yet turn out to begin one."""

    @abstractmethod
    def parse(self, held: str, names: frozenset[str]) -> tuple[list[dict], str] | None:
        """The calls in ``held`` (the text from ``start`` on) and the text around them; None if it is not calls to
        ``names`` throughout."""

    @abstractmethod
    def forced(self, functions: list[dict]) -> tuple[str, dict, str]:
        """One call to one of ``functions`` (OpenAI function objects: name, parameters) as structured output: the
        text before the call's JSON object, the object's schema, the text after (``tool_choice`` "required" or
        named)."""


class Hermes(ToolMarkup):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)

    def start(self, text: str) -> int:
        return text.find(self.OPEN)

    def undecided(self, text: str) -> int:
        return partial_tag(text, self.OPEN)

    def parse(self, held: str, names: frozenset[str]) -> tuple[list[dict], str] | None:
        return _block_calls(held, self.BLOCK, lambda m: _call(m.group(1), names, "arguments"))

    def forced(self, functions: list[dict]) -> tuple[str, dict, str]:
        return self.OPEN + "\n", _call_schema(functions, "arguments"), "\n" + self.CLOSE


class Llama3Json(ToolMarkup):
    TAG = "<|python_tag|>"

    def start(self, text: str) -> int:
        return 0 if text.lstrip().startswith(("{", self.TAG)) else -1  # the calls are the whole reply

    def undecided(self, text: str) -> int:
        body = text.lstrip()
        return len(text) if self.TAG.startswith(body) else 0  # blank so far, or the tag's start

    def parse(self, held: str, names: frozenset[str]) -> tuple[list[dict], str] | None:
        body = held.strip().removeprefix(self.TAG)
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while True:
            pos = len(body) - len(body[pos:].lstrip(" \n\t;"))
            if pos == len(body):
                return (calls, "") if calls else None
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except ValueError:
                return None
            call = _call(obj, names, "parameters")
            if call is None:
                return None
            calls.append(call)

    def forced(self, functions: list[dict]) -> tuple[str, dict, str]:
        return "", _call_schema(functions, "parameters"), ""


class DeepSeekV3(ToolMarkup):
    CALLS, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    # V3: type SEP name, a json code block; V3.1: name SEP the arguments' JSON
    BLOCK = re.compile(re.escape(CALL) + r"(.*?)" + re.escape(SEP) + r"(.*?)" + re.escape(CALL_END), re.S)
    V3_BODY = re.compile(r"(\S+)\s*\n```(?:json)?\s*\n(.*?)\n?```\s*$", re.S)

    def __init__(self, code_block: bool = True):
        self.code_block = code_block  # the template's form: V3 (a json code block) or V3.1

    def start(self, text: str) -> int:
        hits = [i for i in (text.find(self.CALLS), text.find(self.CALL)) if i >= 0]
        return min(hits) if hits else -1

    def undecided(self, text: str) -> int:
        return partial_tag(text, self.CALLS, self.CALL)

    def parse(self, held: str, names: frozenset[str]) -> tuple[list[dict], str] | None:
        found = _block_calls(held, self.BLOCK, lambda m: self._one(m, names))
        if found is None:
            return None
        calls, text = found
        return calls, text.replace(self.CALLS, "").replace(self.CALLS_END, "")

    def _one(self, m: re.Match, names: frozenset[str]) -> dict | None:
        head, body = m.group(1).strip(), m.group(2).strip()
        v3 = self.V3_BODY.match(body) if head == "function" else None
        name, args = (v3.group(1), v3.group(2)) if v3 else (head, body)
        try:
            args = json.loads(args)
        except ValueError:
            return None
        return _call({"name": name, "arguments": args}, names, "arguments") if isinstance(args, dict) else None

    def forced(self, functions: list[dict]) -> tuple[str, dict, str]:
        if len(functions) != 1:  # the name precedes the JSON here: a grammar of one object cannot choose it
            raise RequestError("tool_choice 'required' with several tools is not supported for DeepSeek's call "
                               "markup (the name comes before the arguments); name one function", field="tool_choice")
        f = functions[0]
        schema = f.get("parameters") or {"type": "object", "properties": {}}
        if self.code_block:
            return (f"{self.CALLS}{self.CALL}function{self.SEP}{f['name']}\n```json\n", schema,
                    f"\n```{self.CALL_END}{self.CALLS_END}")
        return f"{self.CALLS}{self.CALL}{f['name']}{self.SEP}", schema, f"{self.CALL_END}{self.CALLS_END}"


def partial_tag(text: str, *tags: str) -> int:
    """How many trailing characters of ``text`` are the start of one of ``tags`` (0: none)."""
    return next((n for n in range(min(max(map(len, tags)) - 1, len(text)), 0, -1)
                 if any(t.startswith(text[-n:]) for t in tags)), 0)


def _block_calls(held: str, block: re.Pattern, call_of) -> tuple[list[dict], str] | None:
    """The calls in ``held``'s ``block`` matches (``call_of``: a match's call, None if it is not one) and the text
    between them; None if any match is not a call, or none is found."""
    calls, rest, pos = [], [], 0
    for m in block.finditer(held):
        call = call_of(m)
        if call is None:
            return None
        calls.append(call)
        rest.append(held[pos:m.start()])
        pos = m.end()
    return (calls, "".join(rest) + held[pos:]) if calls else None


def _call_schema(functions: list[dict], arguments: str) -> dict:
    """A call object's schema: the function's name and its arguments under ``arguments`` (the markup's key)."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", arguments],
              "properties": {"name": {"const": f["name"]},
                             arguments: f.get("parameters") or {"type": "object", "properties": {}}}}
             for f in functions]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def tool_markup(template: str | None) -> ToolMarkup | None:
    """The tool-call markup a chat template teaches its model, or None where it renders no tools we can parse."""
    if not template:
        return None
    if Hermes.OPEN in template:
        return Hermes()
    if '"parameters": dictionary of argument name and its value' in template:  # Llama 3.1-3.3's instruction
        return Llama3Json()
    if DeepSeekV3.SEP in template:
        return DeepSeekV3(code_block="```json" in template)
    return None


def template_arguments(arguments: str):
    """A call's ``arguments`` as a chat template renders them: OpenAI sends a JSON string, templates ``tojson`` an
    object (a string that is not a JSON object stays a string)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


@dataclass
class ToolCallSplitter:
    """Content and tool calls of one completion in ``markup``. ``names``: the request's tool names (a call to any
    other is not one); ``parallel``: False keeps only the first call (the OpenAI field ``parallel_tool_calls``)."""

    markup: ToolMarkup
    names: frozenset[str]
    parallel: bool = True
    _text: str = ""
    _shown: int = 0
    _held_from: int = -1  # where calls begin, once seen
    calls: list[dict] = field(default_factory=list)

    def feed(self, delta: str) -> str:
        """Add ``delta``; return the content that can be shown now."""
        self._text += delta
        if self._held_from < 0:
            self._held_from = self.markup.start(self._text)
        end = self._held_from if self._held_from >= 0 else len(self._text) - self.markup.undecided(self._text)
        return self._show(end)

    def finish(self) -> str:
        """The completion ended: parse what was held; return the content not shown yet (all of it if the held text
        holds no valid call). ``calls`` then holds the OpenAI tool calls."""
        found = self.markup.parse(self._text[self._held_from:], self.names) if self._held_from >= 0 else None
        if found is None:
            return self._show(len(self._text))
        calls, rest = found
        self.calls = calls if self.parallel else calls[:1]
        return self._show(self._held_from) + (rest if rest.strip() else "")

    def _show(self, end: int) -> str:
        out = self._text[self._shown:end] if end > self._shown else ""
        self._shown = max(self._shown, end)
        return out


def _call(body: str | dict, names: frozenset[str], args_key: str) -> dict | None:
    """An OpenAI tool call from a call object (or its JSON text) naming one of ``names``; its arguments under
    ``args_key`` (or the other of "arguments" and "parameters"), an object or a JSON string."""
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            return None
    if not isinstance(body, dict) or body.get("name") not in names:
        return None
    args = body.get(args_key, body.get("parameters" if args_key == "arguments" else "arguments", {}))
    if not isinstance(args, (dict, str)):
        return None
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": body["name"], "arguments": text}}
