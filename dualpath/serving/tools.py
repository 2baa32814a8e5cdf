"""Tool calls in a chat completion's text, for OpenAI's ``tools`` (function calling).

The model sees the request's tools through its chat template and answers with calls in the template's own markup;
this module finds them. One markup is known: Hermes-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks (Qwen2/Qwen2.5 and the many templates that copied them), recognised by the template mentioning the tag.

``ToolCallSplitter`` is fed the completion's text as it streams and returns the content that can be shown at once:
everything before the first ``<tool_call>`` (holding back a tail that may be the tag's start); from the tag on, the
text is held until the end, when ``finish`` parses it. A block that is not valid JSON naming one of the request's
tools makes the held text content again: nothing the model wrote is lost, and no call is invented.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)


def tool_markup(template: str | None) -> str | None:
    """The tool-call markup a chat template teaches its model ("hermes"), or None where it renders no tools."""
    return "hermes" if template and OPEN in template else None


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
    """Content and tool calls of one completion. ``names``: the request's tool names (a call to any other is not
    one); ``parallel``: False keeps only the first call (the OpenAI field ``parallel_tool_calls``)."""

    names: frozenset[str]
    parallel: bool = True
    _text: str = ""
    _shown: int = 0
    _held_from: int = -1  # where the first tag begins, once seen
    calls: list[dict] = field(default_factory=list)

    def feed(self, delta: str) -> str:
        """Add ``delta``; return the content that can be shown now."""
        self._text += delta
        if self._held_from < 0:
            at = self._text.find(OPEN, max(0, self._shown - len(OPEN) + 1))
            if at >= 0:
                self._held_from = at
        end = self._held_from if self._held_from >= 0 else len(self._text) - _partial_tag(self._text)
        return self._show(end)

    def finish(self) -> str:
        """The completion ended: parse what was held; return the content not shown yet (all of it if the held text
        holds no valid call). ``calls`` then holds the OpenAI tool calls."""
        if self._held_from >= 0:
            calls, rest = _parse(self._text[self._held_from:], self.names)
            if calls:
                self.calls = calls if self.parallel else calls[:1]
                return self._show(self._held_from) + (rest if rest.strip() else "")
        return self._show(len(self._text))

    def _show(self, end: int) -> str:
        out = self._text[self._shown:end] if end > self._shown else ""
        self._shown = max(self._shown, end)
        return out


def _partial_tag(text: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of the opening tag."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def _parse(held: str, names: frozenset[str]) -> tuple[list[dict], str]:
    """The calls in ``held`` (text from the first tag on) and the text around them; no calls if any block is not a
    call to one of ``names``."""
    calls, rest, pos = [], [], 0
    for m in _BLOCK.finditer(held):
        call = _call(m.group(1), names)
        if call is None:
            return [], held
        calls.append(call)
        rest.append(held[pos:m.start()])
        pos = m.end()
    rest.append(held[pos:])
    return calls, "".join(rest)


def _call(body: str, names: frozenset[str]) -> dict | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, (dict, str)):
        return None
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": text}}
