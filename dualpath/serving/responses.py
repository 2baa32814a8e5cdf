"""OpenAI's Responses API (``/v1/responses``) on the chat endpoint's machinery.

A request's ``instructions`` and ``input`` items (messages, ``function_call`` items and their
``function_call_output``) become a chat, rendered by the model's own template; the chat's answer becomes output
items (a ``message`` with ``output_text``, then one ``function_call`` item per call), streamed as the API's typed
events. ``previous_response_id`` continues a stored response: the frontend keeps the conversations of its last
``capacity`` stored responses (``dualpath.serving.response_store``: a directory every frontend mounts, or memory).
Only the items live there: the conversation's KV is in storage, as for any chat, so a continued conversation loads its
prefix like a chat turn.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dualpath.core.errors import RequestError
from dualpath.serving.choices import ApiError
from dualpath.serving.protocol import ChatRequest, validated

# Sampling fields the chat endpoint takes that the Responses API lacks (vLLM's Responses endpoint takes them too)
PASSTHROUGH = (
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "logit_bias",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "cache_salt",
    "priority",
    "dualpath",
)
CUT_SHORT = ("length", "abort")  # finish reasons that leave a response incomplete
# A chat field's name as the Responses API calls it (errors name what the client sent)
FIELD_NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text",
    "reasoning_effort": "reasoning",
}
LOGPROBS = "message.output_text.logprobs"
NOTHING_TO_INCLUDE = {"reasoning.encrypted_content"}  # no reasoning items are ever produced


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    store: bool = True
    stream: bool = False
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = None
    include: Optional[list[str]] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    metadata: Optional[dict[str, str]] = None
    truncation: Optional[str] = None
    reasoning: Optional[dict[str, Any]] = None
    background: Optional[bool] = None
    conversation: Optional[Any] = None
    prompt: Optional[Any] = None

    @field_validator("truncation")
    @classmethod
    def _truncation(cls, v):
        if v not in (None, "disabled", "auto"):
            raise ValueError("truncation is 'disabled' (an input over the model's context is a 400) or 'auto'")
        return v

    @field_validator("reasoning")
    @classmethod
    def _effort_only(cls, v):
        """``effort`` becomes the chat's ``reasoning_effort`` (refused there unless the template reads it); no
        summaries of the reasoning are written."""
        if v and any(x is not None for k, x in v.items() if k != "effort"):
            raise ValueError("reasoning: only effort is supported (no summaries)")
        return v

    @field_validator("background", "conversation", "prompt")
    @classmethod
    def _unsupported(cls, v, info):
        if v:
            raise ValueError(f"{info.field_name} is not supported")
        return v

    @field_validator("include")
    @classmethod
    def _includable(cls, v):
        other = sorted(set(v or ()) - {LOGPROBS} - NOTHING_TO_INCLUDE)
        if other:
            raise ValueError(f"{', '.join(other)} cannot be included (only {LOGPROBS})")
        return v

    def wants_logprobs(self) -> bool:
        return LOGPROBS in (self.include or ())


def to_chat(req: ResponsesRequest, history: list[dict]) -> ChatRequest:
    """The chat that answers ``req`` after ``history`` (the earlier turns' messages); errors name the Responses
    field."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    body: dict[str, Any] = {k: v for k, v in (req.model_extra or {}).items() if k in PASSTHROUGH}
    body.update(model=req.model, messages=messages + input_messages(req.input), stream=req.stream)
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    optional = {
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _format(req.text),
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    if req.tools:
        body["tools"] = [_tool(i, t) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    if (req.reasoning or {}).get("effort") is not None:
        body["reasoning_effort"] = req.reasoning["effort"]
    if req.wants_logprobs():
        body.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    return validated(ChatRequest, body, FIELD_NAMES)


def exchange_starts(chat: ChatRequest) -> list[int]:
    """Where ``truncation: "auto"`` may cut a chat's messages: dropping the earliest exchanges (everything after
    the instructions before a user message) keeps whole turns, no tool output without its call; the last user
    message is the last cut."""
    first = _instructions(chat)
    return [i for i, m in enumerate(chat.messages) if i > first and m.role == "user"]


def without_exchanges(chat: ChatRequest, start: int) -> ChatRequest:
    """``chat`` with the messages between its instructions and ``start`` dropped."""
    first = _instructions(chat)
    return chat.model_copy(update={"messages": chat.messages[:first] + chat.messages[start:]})


def _instructions(chat: ChatRequest) -> int:
    """How many leading messages are instructions (a system or developer message), which truncation keeps."""
    return 1 if chat.messages and chat.messages[0].role in ("system", "developer") else 0


def input_messages(items: Union[str, list[dict]]) -> list[dict]:
    """``input`` as chat messages: a function call joins the assistant message before it (a reply's text and its
    calls are one turn), its output is a tool message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            out.append({"role": item.get("role"), "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", where),
                "type": "function",
                "function": {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)},
            }
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "reasoning":
            continue  # an earlier turn's thinking: reasoning models' templates leave it out of the prompt
        elif kind == "function_call_output":
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": _field(item, "call_id", where),
                    "content": _text(item.get("output"), where),
                }
            )
        else:
            raise RequestError(
                f"{where}: items of type {kind!r} are not supported (messages, function_call, "
                f"function_call_output, reasoning)",
                field="input",
            )
    return out


def _field(item: dict, name: str, where: str) -> str:
    v = item.get(name)
    if not isinstance(v, str):
        raise RequestError(f"{where}.{name}: a string is required", field="input")
    return v


def _text(content, where: str) -> str:
    """A message's (or a call output's) text: a string, or text parts (input_text / output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}.content: a string or a list of text parts is required", field="input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise RequestError(
                f"{where}.content[{j}]: parts of type {kind!r} are not supported (text only)", field="input"
            )
        parts.append(part["text"])
    return "".join(parts)


def _tool(i: int, tool: dict) -> dict:
    if tool.get("type") != "function":
        raise RequestError(
            f"tools[{i}]: tools of type {tool.get('type')!r} are not supported (function tools only)", field="tools"
        )
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _echoed_tool(tool: dict) -> dict:
    """A function tool as the response object lists it (every field present)."""
    return {
        "type": "function",
        "name": tool["name"],
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": bool(tool.get("strict")),
    }


def _tool_choice(choice):
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError(
        "tool_choice: 'none', 'auto', 'required' or {'type': 'function', 'name': ...}", field="tool_choice"
    )


def _format(text: Optional[dict]) -> Optional[dict]:
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise RequestError(
            "text.format: an object ({'type': 'text' | 'json_object' | 'json_schema', ...})", field="text"
        )
    if not fmt or fmt.get("type") in ("text", "json_object"):
        return fmt and {"type": fmt["type"]}
    if fmt.get("type") == "json_schema":
        return {
            "type": "json_schema",
            "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt},
        }
    raise RequestError(
        f"text.format: type {fmt.get('type')!r} is not supported (text, json_object, json_schema)", field="text"
    )


def remap_param(param: Optional[str]) -> Optional[str]:
    return FIELD_NAMES.get(param, param) if param else param


@dataclass
class ResponseCall:
    """One ``/v1/responses`` request on its way: what the response object echoes, and the conversation it
    continues (``history``: the earlier turns' messages, without their instructions, as OpenAI's API keeps them)."""

    req: ResponsesRequest
    model: str
    history: list[dict]
    defaults: dict = field(default_factory=dict)  # the server's sampling defaults (the model's generation config)
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def envelope(
        self,
        status: str,
        output: list[dict],
        usage: Optional[dict],
        error: Optional[dict] = None,
        finish: Optional[str] = None,
    ) -> dict:
        r = self.req
        # an aborted reply (/abort_request, a weight update's) is incomplete for none of the schema's reasons
        details = {"reason": "max_output_tokens"} if status == "incomplete" and finish != "abort" else None
        fmt = (r.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": details,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": (r.reasoning or {}).get("effort"), "summary": None},
            "store": r.store,
            "temperature": self.defaults.get("temperature", 1.0) if r.temperature is None else r.temperature,
            "text": {"format": fmt},
            "tool_choice": r.tool_choice or "auto",
            "tools": [_echoed_tool(t) for t in r.tools or ()],
            "top_logprobs": r.top_logprobs or 0,
            "top_p": self.defaults.get("top_p", 1.0) if r.top_p is None else r.top_p,
            "truncation": r.truncation or "disabled",
            "metadata": r.metadata or {},
            **({"usage": usage} if usage is not None else {}),
        }  # none until the end (the schema has no null)

    def from_chat(self, body: dict, block_size: int) -> dict:
        """The response object of a finished chat completion."""
        choice = body["choices"][0]
        message, done = choice["message"], choice["finish_reason"] not in CUT_SHORT
        lps = (choice.get("logprobs") or {}).get("content") or []
        calls, thought = message.get("tool_calls") or [], message.get("reasoning_content")
        output = [reasoning_item(thought, done)] if thought else []
        output += [message_item(message["content"] or "", lps, done)] if message["content"] or not calls else []
        output += [call_item(c) for c in calls]
        return self.envelope(
            "completed" if done else "incomplete",
            output,
            usage(body["usage"], block_size),
            finish=choice["finish_reason"],
        )

    def conversation(self, response: dict) -> list[dict]:
        """The messages a later turn continues: the history, this input and this response's output."""
        reply: dict[str, Any] = {"role": "assistant", "content": None}
        for item in response["output"]:
            if item["type"] == "reasoning":
                continue
            if item["type"] == "message":
                reply["content"] = "".join(p["text"] for p in item["content"])
            else:
                reply.setdefault("tool_calls", []).append(
                    {
                        "id": item["call_id"],
                        "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]},
                    }
                )
        return self.history + input_messages(self.req.input) + [reply]


def input_items(items: Union[str, list[dict]]) -> list[dict]:
    """``input`` as the API lists it back (``GET /v1/responses/{id}/input_items``): each item in its resource form,
    with an id (its own, or a new one). Called on input ``input_messages`` has accepted."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    out = []
    for i, item in enumerate(items):
        kind, where, own = item.get("type", "message"), f"input[{i}]", item.get("id")
        if kind == "message" and item.get("role") == "assistant":
            out.append(message_item(_text(item.get("content"), where), [], True, own))
        elif kind == "message":
            out.append(
                {
                    "type": "message",
                    "id": own or f"msg_{uuid.uuid4().hex}",
                    "role": item["role"],
                    "status": "completed",
                    "content": [{"type": "input_text", "text": _text(item.get("content"), where)}],
                }
            )
        elif kind == "function_call":
            out.append({**call_item({"id": item["call_id"], "function": item}), **({"id": own} if own else {})})
        elif kind == "function_call_output":
            out.append(
                {
                    "type": "function_call_output",
                    "id": own or f"fco_{uuid.uuid4().hex}",
                    "call_id": item["call_id"],
                    "output": _text(item.get("output"), where),
                    "status": "completed",
                }
            )
        else:  # reasoning, as sent
            out.append({**item, "id": own or f"rs_{uuid.uuid4().hex}"})
    return out


def item_page(
    items: list[dict], limit: int = 20, order: str = "desc", after: Optional[str] = None, before: Optional[str] = None
) -> dict:
    """One page of a list of items (OpenAI's list form: newest first by default; ``after`` / ``before`` an item id
    of the list, in that order)."""
    if not 1 <= limit <= 100:
        raise ApiError(400, f"limit must be from 1 to 100, got {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    lo, hi = 0, len(ordered)
    for name, cursor in (("after", after), ("before", before)):
        if cursor is not None and cursor not in ids:
            raise ApiError(400, f"{name}: no item {cursor!r} in this list", param=name)
    if after is not None:
        lo = ids.index(after) + 1
    if before is not None:
        hi = ids.index(before)
    page = ordered[lo:hi][:limit] if before is None else ordered[lo:hi][-limit:]
    more = (lo + len(page) < hi) if before is None else (hi - len(page) > lo)
    return {
        "object": "list",
        "data": page,
        "has_more": more,
        "first_id": page[0]["id"] if page else "",
        "last_id": page[-1]["id"] if page else "",
    }


def message_item(text: str, lps: list, done: bool, item_id: Optional[str] = None) -> dict:
    return {
        "type": "message",
        "id": item_id or f"msg_{uuid.uuid4().hex}",
        "status": "completed" if done else "incomplete",
        "role": "assistant",
        "content": [text_part(text, lps)],
    }


def reasoning_item(text: str, done: bool, item_id: Optional[str] = None) -> dict:
    return {
        "type": "reasoning",
        "id": item_id or f"rs_{uuid.uuid4().hex}",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed" if done else "incomplete",
    }


def text_part(text: str, lps: list) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": lps}


def call_item(call: dict, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def usage(chat: dict, block_size: int) -> dict:
    """The chat's usage in the Responses API's form. The prompt's full blocks not found in storage were computed and
    written to it (a partial last block is not stored)."""
    cached, n = chat["prompt_tokens_details"]["cached_tokens"], chat["prompt_tokens"]
    written = max(0, n // block_size * block_size - cached) if block_size else 0
    out = {
        "input_tokens": n,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {
            "reasoning_tokens": chat.get("completion_tokens_details", {}).get("reasoning_tokens", 0)
        },
        "total_tokens": chat["total_tokens"],
    }
    if "dualpath" in chat:
        out["dualpath"] = chat["dualpath"]
    return out


class ResponseEvents:
    """A streamed chat's chunks in, the Responses API's events out (each numbered): ``start``, ``feed`` per
    chunk, then ``end`` (or ``fail``). Text streams into a message item, each call into a function_call item (its
    arguments as they are written), each item closed when the next begins or the response ends."""

    def __init__(self, call: ResponseCall, block_size: int):
        self.call, self.block_size, self.seq, self.output = call, block_size, 0, []
        self.text: Optional[dict] = None  # the message item being streamed
        self.thought: Optional[dict] = None  # the reasoning item being streamed (it comes first)
        self.call_open: Optional[dict] = None  # the function_call item being streamed
        self.lps: list = []
        self.finish, self.usage = None, None

    def _event(self, type_: str, **fields) -> dict:
        self.seq += 1
        return {"type": type_, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict]:
        shell = self.call.envelope("in_progress", [], None)
        return [self._event("response.created", response=shell), self._event("response.in_progress", response=shell)]

    def feed(self, chunk: dict) -> list[dict]:
        if chunk.get("usage"):
            self.usage = usage(chunk["usage"], self.block_size)
        out = []
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            lps = (choice.get("logprobs") or {}).get("content") or []
            if delta.get("reasoning_content"):
                out += self._thought(delta["reasoning_content"])
            if delta.get("content") or lps:
                out += self._text(delta.get("content") or "", lps)
            for call in delta.get("tool_calls") or ():
                out += self._call(call)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def _thought(self, delta: str) -> list[dict]:
        out = []
        if self.thought is None:
            self.thought = {**reasoning_item("", True), "status": "in_progress", "content": [], "_text": ""}
            shown = {k: v for k, v in self.thought.items() if k != "_text"}
            out.append(self._event("response.output_item.added", output_index=len(self.output), item=shown))
        self.thought["_text"] += delta
        return out + [
            self._event(
                "response.reasoning_text.delta",
                item_id=self.thought["id"],
                output_index=len(self.output),
                content_index=0,
                delta=delta,
            )
        ]

    def _close_thought(self) -> list[dict]:
        if self.thought is None:
            return []
        item = reasoning_item(self.thought["_text"], self.finish not in CUT_SHORT, self.thought["id"])
        i = len(self.output)
        self.output.append(item)
        self.thought = None
        return [
            self._event(
                "response.reasoning_text.done",
                item_id=item["id"],
                output_index=i,
                content_index=0,
                text=item["content"][0]["text"],
            ),
            self._event("response.output_item.done", output_index=i, item=item),
        ]

    def _text(self, delta: str, lps: list) -> list[dict]:
        out = self._close_thought() + self._close_call() + self._open_text() if self.text is None else []
        self.text["_text"] += delta
        self.lps += lps
        return out + [self._event("response.output_text.delta", **self._where(), delta=delta, logprobs=lps)]

    def _open_text(self) -> list[dict]:
        self.text = {**message_item("", [], True), "status": "in_progress", "content": [], "_text": ""}
        shown = {k: v for k, v in self.text.items() if k != "_text"}
        return [
            self._event("response.output_item.added", output_index=len(self.output), item=shown),
            self._event("response.content_part.added", **self._where(), part=text_part("", [])),
        ]

    def _where(self) -> dict:
        return {"item_id": self.text["id"], "output_index": len(self.output), "content_index": 0}

    def _close_text(self) -> list[dict]:
        if self.text is None:
            return []
        text, where = self.text["_text"], self._where()
        item = message_item(text, self.lps, self.finish not in CUT_SHORT, self.text["id"])
        part = item["content"][0]
        self.output.append(item)
        self.text = None
        return [
            self._event("response.output_text.done", **where, text=text, logprobs=part["logprobs"]),
            self._event("response.content_part.done", **where, part=part),
            self._event("response.output_item.done", output_index=where["output_index"], item=item),
        ]

    def _call(self, delta: dict) -> list[dict]:
        """A chat call delta: one with an id begins a call (closing the item before), the rest add arguments."""
        out = []
        if "id" in delta:
            out = self._close_thought() + self._close_text() + self._close_call()
            self.call_open = call_item({**delta, "function": {**delta["function"], "arguments": ""}}, "in_progress")
            out.append(self._event("response.output_item.added", output_index=len(self.output), item=self.call_open))
        args = delta["function"].get("arguments") or ""
        if args:
            self.call_open = {**self.call_open, "arguments": self.call_open["arguments"] + args}
            out.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=self.call_open["id"],
                    output_index=len(self.output),
                    delta=args,
                )
            )
        return out

    def _close_call(self) -> list[dict]:
        if self.call_open is None:
            return []
        item, i = (
            {**self.call_open, "status": "completed" if self.finish not in CUT_SHORT else "incomplete"},
            len(self.output),
        )
        self.output.append(item)
        self.call_open = None
        return [
            self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=i,
                name=item["name"],
                arguments=item["arguments"],
            ),
            self._event("response.output_item.done", output_index=i, item=item),
        ]

    def end(self) -> tuple[dict, list[dict]]:
        """The final response object and the events that end the stream."""
        out = self._close_thought() + self._close_call()
        answered = self.text is not None or any(o["type"] != "reasoning" for o in self.output)
        out += [] if answered else self._open_text()  # no answer and no call: one empty message
        out += self._close_text()
        status = "incomplete" if self.finish in CUT_SHORT else "completed"
        response = self.call.envelope(status, self.output, self.usage, finish=self.finish)
        return response, out + [self._event(f"response.{status}", response=response)]

    def fail(self, message: str, code: Optional[str]) -> list[dict]:
        response = self.call.envelope(
            "failed", self.output, self.usage, {"code": code or "server_error", "message": message}
        )
        return [self._event("response.failed", response=response)]


async def event_stream(call: ResponseCall, chunks, block_size: int, keep):
    """The Responses API's server-sent events (``event:`` lines with typed data) of a streamed chat's chunks;
    ``keep(call, response)`` (async) once the response is complete; a failure ends the stream with
    ``response.failed``."""
    events = ResponseEvents(call, block_size)

    def sse(evs: list[dict]) -> str:
        return "".join(f"event: {ev['type']}\ndata: {json.dumps(ev)}\n\n" for ev in evs)

    try:
        yield sse(events.start())
        async for body in chunks:
            if evs := events.feed(body):
                yield sse(evs)
        response, evs = events.end()
        await keep(call, response)
        yield sse(evs)
    except ApiError as e:
        yield sse(events.fail(str(e), e.code))
    finally:
        await chunks.aclose()
