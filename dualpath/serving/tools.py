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

Each markup (``dualpath.serving.tool_markups``) reads the text from where calls begin into ``CallDraft``s
(``dualpath.serving.tool_json``): the calls as far as they are written, each call's arguments as the model's own
JSON text. ``ToolCallSplitter`` is fed the completion's text as it streams and returns the content that can be
shown at once; from where calls may begin the text is held, and ``call_deltas`` streams each call once its name is
one of the request's tools: the name, then its arguments as they are written (OpenAI's streamed form). At the end
``finish`` checks the calls whole. Held text that is not valid calls to the request's tools becomes content again,
where no call of it was streamed: nothing the model wrote is lost, and no call is invented. A call already streamed
cannot be taken back: if the reply then breaks the markup (or ends inside a call, cut by ``max_tokens``), the calls
begun are delivered as written and what follows the last of them is content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, replace

from dualpath.serving.tool_json import CallDraft, OpenValue
from dualpath.serving.tool_markups import DeepSeekV3, Hermes, Llama3Json, Qwen3Xml, ToolMarkup


TOOL_PARSERS = {
    "hermes": Hermes,
    "qwen3_coder": Qwen3Xml,
    "llama3_json": Llama3Json,
    "deepseek_v3": lambda: DeepSeekV3(code_block=True),
    "deepseek_v31": lambda: DeepSeekV3(code_block=False),
}  # --tool-call-parser's names (vLLM's)


def tool_markup(template: str | None, parser: str = "auto") -> ToolMarkup | None:
    """The tool-call markup a chat template teaches its model, or None where it renders no tools we can parse;
    ``parser`` names one instead (``TOOL_PARSERS``; "none": no tool calling)."""
    if parser != "auto":
        return TOOL_PARSERS[parser]() if parser != "none" else None
    if not template:
        return None
    if Qwen3Xml.FUNCTION in template and Qwen3Xml.PARAMETER in template:  # before Hermes: the same <tool_call>
        return Qwen3Xml()
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
    other is not one); ``parallel``: False keeps only the first call (the OpenAI field ``parallel_tool_calls``).
    ``feed`` and ``finish`` return content; ``call_deltas`` (streaming) the calls' deltas so far; after ``finish``
    ``calls`` holds the calls whole and ``whole`` says whether each of them is complete and valid (False only where
    calls were streamed before the reply broke the markup or ended inside one)."""

    markup: ToolMarkup
    names: frozenset[str]
    parallel: bool = True
    _text: str = ""
    _shown: int = 0
    _held_from: int = -1  # where calls begin, once seen
    _sent: list[list] = field(default_factory=list)  # per call streamed: [its id, characters of arguments sent]
    _left: list[dict] | None = None  # after finish: the deltas that complete the calls
    _open: tuple | None = None  # while the last draft's arguments are open: (drafts, where they begin, OpenValue)
    calls: list[dict] = field(default_factory=list)
    whole: bool = True

    def feed(self, delta: str) -> str:
        """Add ``delta``; return the content that can be shown now."""
        seen, self._text = len(self._text), self._text + delta
        if self._held_from < 0:
            self._held_from = self.markup.start(self._text, seen)
        end = self._held_from if self._held_from >= 0 else len(self._text) - self.markup.undecided(self._text)
        return self._show(end)

    def call_deltas(self) -> list[dict]:
        """The calls' deltas since the last time (OpenAI's streamed form: a call's first delta has its index, id and
        name, later ones add to its arguments). A call streams once its name is one of the tools; its arguments
        while they are an object being written (a JSON string's are decoded at the end). After ``finish``: the
        deltas that complete the calls."""
        if self._left is not None:
            out, self._left = self._left, []
            return out
        if self._held_from < 0:
            return []
        streamable = []
        drafts = self._drafts()
        for d in drafts if self.parallel else drafts[:1]:
            if d.name not in self.names:
                break  # a later call waits: calls stream in order
            streamable.append((d.name, d.args if d.args.startswith("{") else ""))
        return self._advance(streamable)

    def _drafts(self) -> list[CallDraft]:
        """The markup's drafts of the held text. While the last call's arguments are open, new text can only extend
        them until the value ends, so only the new text is scanned: a long call costs linear time, not quadratic."""
        held = self._text[self._held_from :]
        if self._open is not None:
            drafts, begin, value = self._open
            if value.feed(held, begin) < 0:
                return drafts[:-1] + [replace(drafts[-1], args=held[begin:])]
        drafts, _ = self.markup.drafts(held)
        last = drafts[-1] if drafts else None
        self._open = None
        if last is not None and not last.args_done and last.args[:1] in ('"', "{", "["):
            begin = len(held) - len(last.args)
            value = OpenValue()
            value.feed(held, begin)
            self._open = drafts, begin, value
        return drafts

    def finish(self) -> str:
        """The completion ended: check what was held; return the content not shown yet (all of it if the held text
        holds no valid call and none was streamed). ``calls`` then holds the OpenAI tool calls."""
        held = self._text[self._held_from :] if self._held_from >= 0 else ""
        drafts, unbroken = self.markup.drafts(held) if held else ([], True)
        found = _valid_calls(drafts, self.names) if unbroken else None
        if found is not None:
            kept = found if self.parallel else found[:1]
            rest = _unwrapped(_outside(held, drafts), self.markup.WRAPPERS)
        elif self._sent:  # calls already streamed stay, delivered as written; the text around them is content
            sent = drafts[: len(self._sent)]
            valid = _valid_calls(sent, self.names)
            kept = valid or [(d.name, d.args if d.args.startswith("{") else "") for d in sent]
            rest, self.whole = _outside(held, sent), valid is not None
        else:
            return self._show(len(self._text))
        self._left = self._advance(kept)
        self.calls = [
            {"id": sent[0], "type": "function", "function": {"name": name, "arguments": args}}
            for sent, (name, args) in zip(self._sent, kept)
        ]
        return self._show(self._held_from) + (rest if rest.strip() else "")

    def _advance(self, calls: list[tuple[str, str]]) -> list[dict]:
        """Deltas that bring the streamed calls up to ``calls`` (name, arguments so far; each extends what was
        sent)."""
        out = []
        for k, (name, args) in enumerate(calls):
            if k == len(self._sent):
                self._sent.append([f"call_{uuid.uuid4().hex[:24]}", 0])
                out.append(
                    {
                        "index": k,
                        "id": self._sent[k][0],
                        "type": "function",
                        "function": {"name": name, "arguments": ""},
                    }
                )
            new, self._sent[k][1] = args[self._sent[k][1] :], max(len(args), self._sent[k][1])
            if new and out and out[-1]["index"] == k:
                out[-1]["function"]["arguments"] += new
            elif new:
                out.append({"index": k, "function": {"arguments": new}})
        return out

    def _show(self, end: int) -> str:
        out = self._text[self._shown : end] if end > self._shown else ""
        self._shown = max(self._shown, end)
        return out


def _outside(held: str, drafts: list[CallDraft]) -> str:
    """The held text outside the calls (none after a call still open)."""
    parts, pos = [], 0
    for d in drafts:
        parts.append(held[pos : d.start])
        pos = d.end if d.end >= 0 else len(held)
    return "".join(parts) + held[pos:]


def _unwrapped(text: str, wrappers: tuple[str, ...]) -> str:
    for mark in wrappers:
        text = text.replace(mark, "")
    return text


def _valid_calls(drafts: list[CallDraft], names: frozenset[str]) -> list[tuple[str, str]] | None:
    """Each call's name and arguments (the model's JSON text of an object; a JSON string's value) where every draft
    is a whole call to one of ``names``; None otherwise (or where there is none)."""
    calls = []
    for d in drafts:
        if d.end < 0 or d.name not in names:
            return None
        try:
            args = json.loads(d.args)
        except ValueError:
            return None
        if not isinstance(args, (dict, str)):
            return None
        calls.append((d.name, d.args if isinstance(args, dict) else args))
    return calls or None
