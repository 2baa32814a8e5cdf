"""The Responses API's streamed events: a streamed chat's chunks in, the API's typed server-sent events out
(``response.created`` ... ``response.completed``), the response kept once it is whole."""

from __future__ import annotations

import json
from typing import Optional

from dualpath.serving.choices import ApiError
from dualpath.serving.response_items import call_item, message_item, reasoning_item, text_part, usage
from dualpath.serving.responses import CUT_SHORT, ResponseCall


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
        self.thought = None
        return self._closed(item, "response.reasoning_text.done", content_index=0, text=item["content"][0]["text"])

    def _closed(self, item: dict, done: str, **fields) -> list[dict]:
        """``item``, streamed until now, into the output: its own ``done`` event, then ``output_item.done``."""
        i = len(self.output)
        self.output.append(item)
        return [
            self._event(done, item_id=item["id"], output_index=i, **fields),
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
        item = {**self.call_open, "status": "completed" if self.finish not in CUT_SHORT else "incomplete"}
        self.call_open = None
        return self._closed(
            item, "response.function_call_arguments.done", name=item["name"], arguments=item["arguments"]
        )

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
