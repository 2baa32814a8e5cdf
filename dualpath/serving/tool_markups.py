"""The tool-call markups chat templates teach their models (``dualpath.serving.tools`` says which are known and
how one is recognised): each reads a reply's calls as far as they are written, and writes the ``CallShape`` that
constrains a forced or a strict call."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import replace

from dualpath.core.errors import RequestError
from dualpath.serving.tool_json import (
    BLANK,
    CallDraft,
    CallShape,
    call_schema,
    closing,
    object_draft,
    partial_tag,
    rebased,
    skip_ws,
    tagged_drafts,
    value_end,
)


class ToolMarkup(ABC):
    """How one family of chat templates writes tool calls. ``ToolCallSplitter`` calls these with the whole reply so
    far; they keep no state."""

    WRAPPERS: tuple[str, ...] = ()  # markup outside the calls that is not content (dropped from the text around them)

    @abstractmethod
    def start(self, text: str, seen: int = 0) -> int:
        """Where calls begin in ``text``, or -1 while none has begun; ``text[:seen]`` was asked about before (and had
        none), so only a start that ends past it is new."""

    @abstractmethod
    def undecided(self, text: str) -> int:
        """How many trailing characters of ``text`` (with no call begun) may yet turn out to begin one."""

    @abstractmethod
    def drafts(self, held: str) -> tuple[list[CallDraft], bool]:
        """The calls begun in ``held`` (the text from ``start`` on), in order, as far as they are written; and
        False where the text breaks the markup (the drafts then end before the break). Text between whole calls is
        allowed where the markup allows it (it is content)."""

    @abstractmethod
    def forced(self, functions: list[dict]) -> CallShape:
        """One call to one of ``functions`` (OpenAI function objects: name, parameters) as structured output
        (``tool_choice`` "required" or named)."""

    def triggered(self, functions: list[dict]) -> CallShape | None:
        """Calls to ``functions`` the model may make or not, each held to its schema once begun (strict tools with
        ``tool_choice`` "auto"): the shape's prefix is what begins a call in free text. None where a call cannot be
        recognised as it begins (the calls are the whole reply)."""
        return None

    def for_tools(self, params: dict[str, dict]) -> "ToolMarkup":
        """This markup for a request whose tools take ``params`` (name -> parameters schema): the same, unless
        reading its calls needs their types."""
        return self


class Hermes(ToolMarkup):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def start(self, text: str, seen: int = 0) -> int:
        return text.find(self.OPEN, max(0, seen - len(self.OPEN) + 1))

    def undecided(self, text: str) -> int:
        return partial_tag(text, self.OPEN)

    def drafts(self, held: str) -> tuple[list[CallDraft], bool]:
        out, pos = [], 0
        while (start := held.find(self.OPEN, pos)) >= 0:
            d = object_draft(held, start, skip_ws(held, start + len(self.OPEN)), ("arguments", "parameters"))
            if d is None:
                return out, False
            pos = closing(held, d.end, self.CLOSE) if d.end >= 0 else -1
            out.append(replace(d, end=max(pos, -1)))
            if pos < 0:
                return out, pos == -1
        return out, True

    def forced(self, functions: list[dict]) -> CallShape:
        return CallShape(self.OPEN + "\n", call_schema(functions, "arguments"), "\n" + self.CLOSE)

    def triggered(self, functions: list[dict]) -> CallShape | None:
        return CallShape(self.OPEN, call_schema(functions, "arguments"), "\n" + self.CLOSE)  # JSON may start "\n"


class Qwen3Xml(Hermes):
    """Qwen3-Coder's calls: ``<tool_call>``, ``<function=NAME>``, then per argument ``<parameter=KEY>`` its value
    as text on its own lines ``</parameter>``, then ``</function>`` and ``</tool_call>``. A value is typed by the
    tool's parameters (an integer, number, boolean, object or array as JSON; a string as written; an unknown key
    as text), so the arguments come whole when the call ends. Nothing forces such a call: it is not JSON."""

    FUNCTION, PARAMETER, PARAMETER_END, FUNCTION_END = "<function=", "<parameter=", "</parameter>", "</function>"

    def __init__(self, params: dict[str, dict] | None = None):
        self.params = params or {}

    def for_tools(self, params: dict[str, dict]) -> "Qwen3Xml":
        return Qwen3Xml(params)

    def drafts(self, held: str) -> tuple[list[CallDraft], bool]:
        return tagged_drafts(held, self.OPEN, self._draft)

    def _draft(self, held: str, start: int) -> tuple[CallDraft, int]:
        """One call from ``start`` and where its markup ends (-1 while open, -2 where it breaks)."""
        draft = CallDraft(start, -1, None, "", False)
        at = closing(held, start + len(self.OPEN), self.FUNCTION)
        name_end = held.find(">", at) if at >= 0 else -1
        if name_end < 0:
            return draft, -1 if at != -2 else -2
        name, values, j = held[at:name_end].strip(), {}, name_end + 1
        draft = replace(draft, name=name)
        while True:
            j = skip_ws(held, j)
            if self.PARAMETER.startswith(held[j : j + len(self.PARAMETER)]) and j + len(self.PARAMETER) > len(held):
                return draft, -1  # the text ends inside "<parameter="
            if not held.startswith(self.PARAMETER, j):
                break
            key_end = held.find(">", j)
            close = held.find(self.PARAMETER_END, key_end) if key_end >= 0 else -1
            if close < 0:
                return draft, -1
            value = held[key_end + 1 : close]
            values[held[j + len(self.PARAMETER) : key_end].strip()] = value.removeprefix("\n").removesuffix("\n")
            j = close + len(self.PARAMETER_END)
        end = closing(held, j, self.FUNCTION_END, self.CLOSE)
        if end < 0:
            return draft, end
        args = {k: self._typed(name, k, v) for k, v in values.items()}
        return replace(draft, end=end, args=json.dumps(args, ensure_ascii=False), args_done=True), end

    def _typed(self, name: str, key: str, value: str):
        """A value as the tool's parameter ``key`` types it (as written where that is a string, unknown, or not
        what the text holds)."""
        prop = (self.params.get(name) or {}).get("properties", {}).get(key)
        types = prop.get("type") if isinstance(prop, dict) else None
        types = [types] if isinstance(types, str) else types or []
        if not types or "string" in types:
            return value
        try:
            parsed = json.loads(value.strip())
        except ValueError:
            return value
        ok = {"integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}
        if (
            parsed is None
            and "null" in types
            or any(
                isinstance(parsed, ok[t]) and not (t in ("integer", "number") and isinstance(parsed, bool))
                for t in types
                if t in ok
            )
        ):
            return parsed
        return value

    def forced(self, functions: list[dict]) -> CallShape:
        raise RequestError(
            "tool_choice 'required' or a named function is not supported with Qwen3-Coder's XML "
            "calls (there is no JSON object to hold to a schema); use 'auto'",
            field="tool_choice",
        )

    def triggered(self, functions: list[dict]) -> CallShape | None:
        return None


class Llama3Json(ToolMarkup):
    TAG = "<|python_tag|>"
    WRAPPERS = (TAG, ";")  # the calls are the whole reply: what is around them is these and blanks

    def start(self, text: str, seen: int = 0) -> int:
        return 0 if text.lstrip().startswith(("{", self.TAG)) else -1  # the calls are the whole reply

    def undecided(self, text: str) -> int:
        body = text.lstrip()
        return len(text) if self.TAG.startswith(body) else 0  # blank so far, or the tag's start

    def drafts(self, held: str) -> tuple[list[CallDraft], bool]:
        pos, out = skip_ws(held, 0), []
        pos = skip_ws(held, pos + len(self.TAG)) if held.startswith(self.TAG, pos) else pos
        while True:
            while pos < len(held) and held[pos] in BLANK + ";":
                pos += 1
            if pos == len(held) or self.TAG.startswith(held[pos:]):
                return out, True
            d = object_draft(held, pos, pos, ("parameters", "arguments"))
            if d is None:
                return out, False
            out.append(d)
            if d.end < 0:
                return out, True
            pos = d.end

    def forced(self, functions: list[dict]) -> CallShape:
        return CallShape("", call_schema(functions, "parameters"), "")


class DeepSeekV3(ToolMarkup):
    CALLS, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    WRAPPERS = (CALLS, CALLS_END)

    def __init__(self, code_block: bool = True):
        self.code_block = code_block  # the template's form: V3 (a json code block) or V3.1

    def start(self, text: str, seen: int = 0) -> int:
        since = max(0, seen - max(len(self.CALLS), len(self.CALL)) + 1)
        hits = [i for i in (text.find(self.CALLS, since), text.find(self.CALL, since)) if i >= 0]
        return min(hits) if hits else -1

    def undecided(self, text: str) -> int:
        return partial_tag(text, self.CALLS, self.CALL)

    def drafts(self, held: str) -> tuple[list[CallDraft], bool]:
        return tagged_drafts(held, self.CALL, self._draft)

    def _draft(self, held: str, start: int) -> tuple[CallDraft, int]:
        """One call from ``start``, and where its markup ends (-1 while it is open, -2 where it breaks). V3:
        ``function`` SEP the name, a newline, the arguments in a json code block; V3.1: the name SEP the
        arguments."""
        draft = CallDraft(start, -1, None, "", False)
        sep = held.find(self.SEP, start)
        if sep < 0:
            return draft, -1
        head, v = held[start + len(self.CALL) : sep].strip(), sep + len(self.SEP)
        fenced = head == "function"
        if fenced:
            line = held.find("\n", v)
            if line < 0:
                return draft, -1
            head, v = held[v:line].strip(), closing(held, line, "```")
            if v >= 0 and held.startswith("json", v):
                v += 4
            elif v >= 0 and "json".startswith(held[v:]):  # the text ends inside the fence's language
                v = -1
        draft = replace(draft, name=head)
        v = skip_ws(held, v) if v >= 0 else v
        if v < 0 or v == len(held):
            return draft, min(v, -1)
        end = value_end(held, v)
        draft = replace(draft, args=held[v : end if end >= 0 else len(held)], args_done=end >= 0)
        close = -1 if end < 0 else closing(held, end, *(("```", self.CALL_END) if fenced else (self.CALL_END,)))
        return replace(draft, end=max(close, -1)), close

    def forced(self, functions: list[dict]) -> CallShape:
        shape = self.triggered(functions)
        return replace(shape, prefix=self.CALLS + shape.prefix, suffix=shape.suffix + self.CALLS_END)

    def triggered(self, functions: list[dict]) -> CallShape:
        """The name comes before the arguments: a branch per function (its name, then its parameters' object)."""
        names = [
            f"function{self.SEP}{f['name']}\n```json\n" if self.code_block else f"{f['name']}{self.SEP}"
            for f in functions
        ]
        schema = {
            "anyOf": [
                rebased(f.get("parameters") or {"type": "object", "properties": {}}, f"#/anyOf/{i}")
                for i, f in enumerate(functions)
            ]
        }
        return CallShape(self.CALL, schema, ("\n```" if self.code_block else "") + self.CALL_END, tuple(names))
