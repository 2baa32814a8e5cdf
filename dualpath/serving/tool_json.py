"""Tool calls as JSON: what constrains a call the model must make or may begin (``CallShape``, a schema of the
request's functions with the markup around it), and the calls read from a reply's text as far as the model has
written them (``CallDraft``): only each JSON value's extent is found here (strings and brackets), ``json.loads``
checks the value. The markups of ``dualpath.serving.tool_markups`` are written with these."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from dualpath.core.errors import RequestError


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
    schema = {"anyOf": [rebased(s["schema"], f"#/anyOf/{i}") for i, s in enumerate(structures)]}
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


BLANK = " \t\n\r"
# JSON strings whole, brackets; a lone quote is a string the text ends in (the first form did not match)
_JSON_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[{}\[\]]|"')


def tagged_drafts(held: str, tag: str, draft) -> tuple[list[CallDraft], bool]:
    """The calls in ``held`` that each begin with ``tag``: ``draft(held, start)`` reads one and says where its
    markup ends (-1 while it is open, -2 where it breaks the markup)."""
    out, pos = [], 0
    while (start := held.find(tag, pos)) >= 0:
        d, pos = draft(held, start)
        out.append(d)
        if pos < 0:
            return out, pos == -1
    return out, True


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in BLANK:
        i += 1
    return i


def value_end(text: str, i: int) -> int:
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


class OpenValue:
    """Where a JSON value that begins with a string or a bracket ends, found as its text grows: each character is
    read once (strings and brackets, as ``value_end`` reads them)."""

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
    members, j = {}, skip_ws(text, i + 1)
    if text.startswith("}", j):
        return members, j + 1
    while j < len(text):
        key_end = value_end(text, j) if text[j] == '"' else -2
        if key_end == -2:
            return None
        colon = skip_ws(text, key_end) if key_end >= 0 else len(text)
        if colon >= len(text):
            return members, -1
        if text[colon] != ":":
            return None
        v = skip_ws(text, colon + 1)
        if v >= len(text):
            return members, -1
        end = value_end(text, v)
        members[json.loads(text[j:key_end])] = (v, end)
        j = skip_ws(text, end) if end >= 0 else len(text)
        if text.startswith("}", j):
            return members, j + 1
        if j < len(text) and text[j] != ",":
            return None
        j = skip_ws(text, j + 1)
    return members, -1


def object_draft(held: str, start: int, i: int, args_keys: tuple[str, str]) -> CallDraft | None:
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


def closing(text: str, i: int, *marks: str) -> int:
    """The index past ``marks`` written in order from ``i``, blanks allowed before each; -1 while the text may yet
    become them, -2 where it cannot."""
    for mark in marks:
        i = skip_ws(text, i)
        written = text[i : i + len(mark)]
        if written != mark:
            return -1 if i + len(written) == len(text) and mark.startswith(written) else -2
        i += len(mark)
    return i


def call_schema(functions: list[dict], arguments: str) -> dict:
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
                arguments: rebased(f.get("parameters") or {"type": "object", "properties": {}}, at),
            },
        }

    calls = [call(i, f) for i, f in enumerate(functions)]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def rebased(schema, base: str):
    """``schema`` with each local ``$ref`` ("#..." JSON pointers) pointing into ``base`` (a pointer to where the
    schema is placed in a larger one)."""
    if isinstance(schema, list):
        return [rebased(x, base) for x in schema]
    if not isinstance(schema, dict):
        return schema
    return {
        k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else rebased(v, base))
        for k, v in schema.items()
    }
