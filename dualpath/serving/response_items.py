"""The Responses API's items: the output items a response holds (``message`` with its ``output_text``,
``reasoning``, ``function_call``), the input items as ``GET /v1/responses/{id}/input_items`` lists them (a page at a
time), an item's text, and a chat's usage in the API's form."""

from __future__ import annotations

import uuid
from typing import Optional, Union

from dualpath.core.errors import RequestError
from dualpath.serving.choices import ApiError


def item_text(content, where: str) -> str:
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


def input_items(items: Union[str, list[dict]]) -> list[dict]:
    """``input`` as the API lists it back (``GET /v1/responses/{id}/input_items``): each item in its resource form,
    with an id (its own, or a new one). Called on input ``input_messages`` has accepted."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    out = []
    for i, item in enumerate(items):
        kind, where, own = item.get("type", "message"), f"input[{i}]", item.get("id")
        if kind == "message" and item.get("role") == "assistant":
            out.append(message_item(item_text(item.get("content"), where), [], True, own))
        elif kind == "message":
            out.append(
                {
                    "type": "message",
                    "id": own or f"msg_{uuid.uuid4().hex}",
                    "role": item["role"],
                    "status": "completed",
                    "content": [{"type": "input_text", "text": item_text(item.get("content"), where)}],
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
                    "output": item_text(item.get("output"), where),
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
