"""OpenAI's Responses API (``/v1/responses``) on the chat endpoint's machinery.

A request's ``instructions`` and ``input`` items (messages, ``function_call`` items and their
``function_call_output``) become a chat, rendered by the model's own template; the chat's answer becomes output
items (``dualpath.serving.response_items``: a ``message`` with ``output_text``, then one ``function_call`` item per
call), streamed as the API's typed events (``dualpath.serving.response_events``). ``previous_response_id`` continues a stored response: the frontend keeps the conversations of its last
``capacity`` stored responses (``dualpath.serving.response_store``: a directory every frontend mounts, or memory).
Only the items live there: the conversation's KV is in storage, as for any chat, so a continued conversation loads its
prefix like a chat turn.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dualpath.core.errors import RequestError
from dualpath.serving.json_bodies import validated
from dualpath.serving.protocol import ChatRequest
from dualpath.serving.response_items import call_item, item_text, message_item, reasoning_item, usage

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
            out.append({"role": item.get("role"), "content": item_text(item.get("content"), where)})
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
                    "content": item_text(item.get("output"), where),
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
