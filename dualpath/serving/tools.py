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

Each markup reads the text from where calls begin into ``CallDraft``s: the calls as far as they are written, each
call's arguments as the model's own JSON text. ``ToolCallSplitter`` is fed the completion's text as it streams and
returns the content that can be shown at once; from where calls may begin the text is held, and ``call_deltas``
streams each call once its name is one of the request's tools: the name, then its arguments as they are written
(OpenAI's streamed form). At the end ``finish`` checks the calls whole. Held text that is not valid calls to the
request's tools becomes content again, where no call of it was streamed: nothing the model wrote is lost, and no call
is invented. A call already streamed cannot be taken back: if the reply then breaks the markup (or ends inside a
call, cut by ``max_tokens``), the calls begun are delivered as written and what follows the last of them is content.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace

from dualpath.core.errors import RequestError


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
            d = _object_draft(held, start, _skip_ws(held, start + len(self.OPEN)), ("arguments", "parameters"))
            if d is None:
                return out, False
            pos = _closing(held, d.end, self.CLOSE) if d.end >= 0 else -1
            out.append(replace(d, end=max(pos, -1)))
            if pos < 0:
                return out, pos == -1
        return out, True

    def forced(self, functions: list[dict]) -> CallShape:
        return CallShape(self.OPEN + "\n", _call_schema(functions, "arguments"), "\n" + self.CLOSE)

    def triggered(self, functions: list[dict]) -> CallShape | None:
        return CallShape(self.OPEN, _call_schema(functions, "arguments"), "\n" + self.CLOSE)  # JSON may start "\n"


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
        return _tagged_drafts(held, self.OPEN, self._draft)

    def _draft(self, held: str, start: int) -> tuple[CallDraft, int]:
        """One call from ``start`` and where its markup ends (-1 while open, -2 where it breaks)."""
        draft = CallDraft(start, -1, None, "", False)
        at = _closing(held, start + len(self.OPEN), self.FUNCTION)
        name_end = held.find(">", at) if at >= 0 else -1
        if name_end < 0:
            return draft, -1 if at != -2 else -2
        name, values, j = held[at:name_end].strip(), {}, name_end + 1
        draft = replace(draft, name=name)
        while True:
            j = _skip_ws(held, j)
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
        end = _closing(held, j, self.FUNCTION_END, self.CLOSE)
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
        pos, out = _skip_ws(held, 0), []
        pos = _skip_ws(held, pos + len(self.TAG)) if held.startswith(self.TAG, pos) else pos
        while True:
            while pos < len(held) and held[pos] in _BLANK + ";":
                pos += 1
            if pos == len(held) or self.TAG.startswith(held[pos:]):
                return out, True
            d = _object_draft(held, pos, pos, ("parameters", "arguments"))
            if d is None:
                return out, False
            out.append(d)
            if d.end < 0:
                return out, True
            pos = d.end

    def forced(self, functions: list[dict]) -> CallShape:
        return CallShape("", _call_schema(functions, "parameters"), "")


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
        return _tagged_drafts(held, self.CALL, self._draft)

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
            head, v = held[v:line].strip(), _closing(held, line, "```")
            if v >= 0 and held.startswith("json", v):
                v += 4
            elif v >= 0 and "json".startswith(held[v:]):  # the text ends inside the fence's language
                v = -1
        draft = replace(draft, name=head)
        v = _skip_ws(held, v) if v >= 0 else v
        if v < 0 or v == len(held):
            return draft, min(v, -1)
        end = _value_end(held, v)
        draft = replace(draft, args=held[v : end if end >= 0 else len(held)], args_done=end >= 0)
        close = -1 if end < 0 else _closing(held, end, *(("```", self.CALL_END) if fenced else (self.CALL_END,)))
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
                _rebased(f.get("parameters") or {"type": "object", "properties": {}}, f"#/anyOf/{i}")
                for i, f in enumerate(functions)
            ]
        }
        return CallShape(self.CALL, schema, ("\n```" if self.code_block else "") + self.CALL_END, tuple(names))


@dataclass(frozen=True)
class CallShape:
    """A call to one of the request's functions as structured output: ``prefix`` (or, triggered, what begins a
    call in free text), then, with ``branches``, the text of one (naming its function) before an object of the
    schema's matching ``anyOf`` alternative, else the object of ``schema``; then ``suffix``."""

    prefix: str
    schema: dict
    suffix: str
    branches: tuple[str, ...] = ()

    def sampling(self, trigger: bool = False) -> dict:
        """The ``SamplingParams`` fields that constrain a reply to it."""
        return {
            "json_schema": json.dumps(self.schema),
            "json_prefix": self.prefix,
            "json_suffix": self.suffix,
            "json_branches": self.branches,
            **({"json_trigger": True} if trigger else {}),
        }


def structural_shape(structures: list[dict], triggers: list[str]) -> CallShape:
    """vLLM's ``structural_tag`` response format as a triggered ``CallShape``: one trigger, which every structure's
    ``begin`` starts with (the rest of it is the structure's branch), and one ``end`` for all (what the grammar can
    hold; other forms are a RequestError naming why)."""
    if len(triggers) != 1 or not triggers[0]:
        raise RequestError("structural_tag: one (non-empty) trigger is supported", field="response_format")
    trigger, ends = triggers[0], {s["end"] for s in structures}
    if not all(s["begin"].startswith(trigger) for s in structures) or len(ends) != 1:
        raise RequestError(
            "structural_tag: every structure's begin must start with the trigger, and all must share one end",
            field="response_format",
        )
    schema = {"anyOf": [_rebased(s["schema"], f"#/anyOf/{i}") for i, s in enumerate(structures)]}
    return CallShape(trigger, schema, ends.pop(), tuple(s["begin"][len(trigger) :] for s in structures))


def partial_tag(text: str, *tags: str) -> int:
    """How many trailing characters of ``text`` are the start of one of ``tags`` (0: none)."""
    return next(
        (
            n
            for n in range(min(max(map(len, tags)) - 1, len(text)), 0, -1)
            if any(t.startswith(text[-n:]) for t in tags)
        ),
        0,
    )


@dataclass(frozen=True)
class CallDraft:
    """One call as far as the model has written it: where its markup begins and ends in the held text (``end`` -1
    while it is open), its name once written whole, its arguments' JSON text so far (``args_done`` once the value
    has ended: "{}" where a whole call has none)."""

    start: int
    end: int
    name: str | None
    args: str
    args_done: bool


_BLANK = " \t\n\r"
# JSON strings whole, brackets; a lone quote is a string the text ends in (the first form did not match)
_JSON_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[{}\[\]]|"')


def _tagged_drafts(held: str, tag: str, draft) -> tuple[list[CallDraft], bool]:
    """The calls in ``held`` that each begin with ``tag``: ``draft(held, start)`` reads one and says where its
    markup ends (-1 while it is open, -2 where it breaks the markup)."""
    out, pos = [], 0
    while (start := held.find(tag, pos)) >= 0:
        d, pos = draft(held, start)
        out.append(d)
        if pos < 0:
            return out, pos == -1
    return out, True


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _BLANK:
        i += 1
    return i


def _value_end(text: str, i: int) -> int:
    """Where the JSON value that begins at ``text[i]`` ends (the index past it); -1 if the text ends first. Only the
    extent is found here (strings and brackets; a scalar ends at a delimiter): ``json.loads`` checks the value."""
    if i >= len(text):
        return -1
    if text[i] in '"{[':
        depth = 0
        for m in _JSON_TOKENS.finditer(text, i):
            tok = m.group()
            if tok == '"':
                return -1
            depth += 1 if tok in "{[" else -1 if tok in "}]" else 0
            if depth <= 0:
                return m.end()
        return -1
    j = i
    while j < len(text) and text[j] not in ",}]; \t\n\r":
        j += 1
    return j if j < len(text) else -1


class _OpenValue:
    """Where a JSON value that begins with a string or a bracket ends, found as its text grows: each character is
    read once (strings and brackets, as ``_value_end`` reads them)."""

    def __init__(self):
        self.read, self.depth, self.in_string, self.escaped = 0, 0, False, False

    def feed(self, text: str, begin: int) -> int:
        """Read ``text[begin:]`` past what was read; the index past the value's end, or -1 while it is open."""
        for i in range(begin + self.read, len(text)):
            ch = text[i]
            self.read += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
        return -1


def _object_members(text: str, i: int) -> tuple[dict[str, tuple[int, int]], int] | None:
    """The members of the JSON object at ``text[i]`` whose values have begun, each key's value span (its end -1
    while open), and the index past the object (-1 while open); None where the text is not an object."""
    if i >= len(text):
        return {}, -1
    if text[i] != "{":
        return None
    members, j = {}, _skip_ws(text, i + 1)
    if text.startswith("}", j):
        return members, j + 1
    while j < len(text):
        key_end = _value_end(text, j) if text[j] == '"' else -2
        if key_end == -2:
            return None
        colon = _skip_ws(text, key_end) if key_end >= 0 else len(text)
        if colon >= len(text):
            return members, -1
        if text[colon] != ":":
            return None
        v = _skip_ws(text, colon + 1)
        if v >= len(text):
            return members, -1
        end = _value_end(text, v)
        members[json.loads(text[j:key_end])] = (v, end)
        j = _skip_ws(text, end) if end >= 0 else len(text)
        if text.startswith("}", j):
            return members, j + 1
        if j < len(text) and text[j] != ",":
            return None
        j = _skip_ws(text, j + 1)
    return members, -1


def _object_draft(held: str, start: int, i: int, args_keys: tuple[str, str]) -> CallDraft | None:
    """The call written as a JSON object at ``held[i]``: its "name", its arguments under the first of ``args_keys``
    present; ``end`` is past the object. None where it is not a call object."""
    try:
        got = _object_members(held, i)
    except ValueError:  # a key that is not a JSON string
        return None
    if got is None:
        return None
    members, end = got
    name = None
    if "name" in members and members["name"][1] >= 0:
        try:
            name = json.loads(held[slice(*members["name"])])
        except ValueError:
            return None
        if not isinstance(name, str):
            return None
    key = next((k for k in args_keys if k in members), None)
    if key is None:
        return CallDraft(start, end, name, "{}" if end >= 0 else "", end >= 0)
    v, v_end = members[key]
    return CallDraft(start, end, name, held[v : v_end if v_end >= 0 else len(held)], v_end >= 0)


def _closing(text: str, i: int, *marks: str) -> int:
    """The index past ``marks`` written in order from ``i``, blanks allowed before each; -1 while the text may yet
    become them, -2 where it cannot."""
    for mark in marks:
        i = _skip_ws(text, i)
        written = text[i : i + len(mark)]
        if written != mark:
            return -1 if i + len(written) == len(text) and mark.startswith(written) else -2
        i += len(mark)
    return i


def _call_schema(functions: list[dict], arguments: str) -> dict:
    """A call object's schema: the function's name and its arguments under ``arguments`` (the markup's key). The
    parameters' local ``$ref``s (pydantic's ``#/$defs/...`` for nested models) are rebased to where they now sit."""

    def call(i: int, f: dict) -> dict:
        at = f"#/properties/{arguments}" if len(functions) == 1 else f"#/anyOf/{i}/properties/{arguments}"
        return {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", arguments],
            "properties": {
                "name": {"const": f["name"]},
                arguments: _rebased(f.get("parameters") or {"type": "object", "properties": {}}, at),
            },
        }

    calls = [call(i, f) for i, f in enumerate(functions)]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _rebased(schema, base: str):
    """``schema`` with each local ``$ref`` ("#..." JSON pointers) pointing into ``base`` (a pointer to where the
    schema is placed in a larger one)."""
    if isinstance(schema, list):
        return [_rebased(x, base) for x in schema]
    if not isinstance(schema, dict):
        return schema
    return {
        k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebased(v, base))
        for k, v in schema.items()
    }


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
    _open: tuple | None = None  # while the last draft's arguments are open: (drafts, where they begin, _OpenValue)
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
            value = _OpenValue()
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
