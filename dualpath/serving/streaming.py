"""Streamed responses: a chat's or completion's chunks as its choices' tokens come (``ChunkStream``), and
server-sent events of any stream of bodies (``sse``), which every streamed endpoint but the Responses API's (typed
events: ``dualpath.serving.responses``) sends."""

from __future__ import annotations

import json
import time

from dualpath.serving.choices import ApiError, Outcome, PromptLogprobs, merge
from dualpath.serving.logprob_forms import wants_logprobs
from dualpath.serving.json_bodies import error_body


async def sse(bodies):
    """Server-sent events of the bodies, an error in OpenAI's form if one ends them early, then ``[DONE]``. Closing
    ``bodies`` is what ends their generations (each stream closes its own)."""
    try:
        async for body in bodies:
            yield f"data: {json.dumps(body)}\n\n"
    except ApiError as e:
        yield f"data: {json.dumps(error_body(str(e), e.type, e.param, e.code))}\n\n"
    finally:
        await bodies.aclose()
    yield "data: [DONE]\n\n"


class ChunkStream:
    """The chunk bodies of a streamed chat or completion (``job``: ``dualpath.serving.pipeline.Job``), every
    choice's interleaved as their tokens come (each chunk names its choice); usage, when asked, once at the end. A
    generation's error is raised (``ApiError``). Invariants: a choice's token ids go out in order, each once
    (``pending``), and a completion's ``text_offset`` counts from where its text so far ends (``offsets``)."""

    def __init__(self, front, job):
        self.front, self.job, self.req, self.kind = front, job, job.req, job.kind
        n = len(job.gens)
        self.want_lps = wants_logprobs(self.req, self.kind)
        opts = self.req.stream_options
        self.running = opts is not None and opts.include_usage and opts.continuous_usage_stats
        self.n_prompt, self.generated = sum(len(p.ids) for p in job.prompts), 0  # completion tokens so far, all's
        self.pending: list[list[int]] = [[] for _ in range(n)]  # token ids not yet sent (their text may be held back)
        self.told: set[int] = set()  # completions: choices whose prompt_token_ids went out
        self.offsets = [0] * n  # completions' logprobs: where the next token's text begins in its choice's text
        self.outcomes: dict[int, Outcome] = {}
        self.created, self.splitters, self.reasoners = 0, [], []

    def _prompt(self, i: int):
        return self.job.prompts[i // self.req.n]

    async def run(self):
        gens = self.job.gens
        try:
            self.created = int(time.time())
            self.splitters = [self.front.splits.splitter(self.req, self.kind) for _ in gens]
            self.reasoners = [self.front.splits.reasoner(self.kind, self._prompt(i)) for i in range(len(gens))]
            for body in self._opening():
                yield body
            async for i, item in merge(gens):
                for body in self._item(i, item):
                    yield body
            self.front.generations.end_turn(self.job, self.outcomes.get(0))
            if self.req.stream_options and self.req.stream_options.include_usage:
                outcomes = [self.outcomes[i] for i in range(len(gens))]
                yield self._chunk(None, self.front.replies.usage(self.req, self.job.prompts, outcomes))
        finally:
            for g in gens:
                await g.aclose()

    def _opening(self) -> list[dict]:
        """A chat's role chunk per choice; a completion's echoed prompt (with logprobs: once they come)."""
        n = len(self.job.gens)
        if self.kind == "chat":
            return [self._role(i) for i in range(n)]
        if not (self.req.echo and self.req.logprobs is None):
            return []
        out = []
        for i in range(n):
            head = self.front.replies.echoed(self.req, self._prompt(i), None)[0]
            self.offsets[i] = len(head)
            out.append(self._chunk(self._choice(i, head, [])))
        return out

    def _role(self, i: int) -> dict:
        first = self._chunk(
            {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}
        )
        if self.req.return_token_ids and i == 0:
            first["prompt_token_ids"] = self.job.prompts[0].ids
        return first

    def _item(self, i: int, item) -> list[dict]:
        if isinstance(item, PromptLogprobs):
            return self._echo_logprobs(i, item.lps)
        if isinstance(item, Outcome):
            return self._ending(i, item)
        return self._token(i, *item)

    def _echo_logprobs(self, i: int, lps: list) -> list[dict]:
        """A completion's echoed prompt with its tokens' logprobs (they come with the choice's first event)."""
        if self.kind == "chat" or not self.req.echo or self.req.logprobs is None:
            return []
        head, body = self.front.replies.echoed(self.req, self._prompt(i), lps)
        self.offsets[i] = len(head)
        return [self._chunk({"index": i, "text": head, "finish_reason": None, "logprobs": body})]

    def _token(self, i: int, delta: str, tokens: list[int], lp: dict | None) -> list[dict]:
        self.pending[i] += tokens
        self.generated += len(tokens)
        thought, calls, splitter = "", [], self.splitters[i]
        if self.reasoners[i] is not None:
            thought, delta = self.reasoners[i].feed(delta)
        if splitter is not None:
            delta, calls = splitter.feed(delta), splitter.call_deltas()
        if delta or thought or lp or calls or (tokens and self.req.return_token_ids):
            return [self._chunk(self._choice(i, delta, [lp] if lp else [], thought=thought, calls=calls))]
        return []

    def _ending(self, i: int, outcome: Outcome) -> list[dict]:
        """What the splitters held back, then the choice's finish (``tool_calls`` when the reply was whole calls)."""
        self.outcomes[i] = outcome
        finish, splitter, reasoner, out = outcome.finish_reason, self.splitters[i], self.reasoners[i], []
        if reasoner is not None:
            thought, tail = reasoner.finish()
            outcome.reasoning_tokens = reasoner.tokens
            tail = splitter.feed(tail) if splitter is not None else tail
            if thought or tail:
                out.append(self._chunk(self._choice(i, tail, [], thought=thought)))
        if splitter is not None:
            tail = splitter.finish()
            if calls := splitter.call_deltas():
                out.append(self._chunk(self._choice(i, "", [], calls=calls)))
            if tail:  # the held text that is not calls: after them
                out.append(self._chunk(self._choice(i, tail, [])))
            outcome.tool_calls = bool(splitter.calls)
            if splitter.calls and splitter.whole:
                finish = "tool_calls"
        out.append(self._chunk(self._choice(i, "", [], finish)))
        return out

    def _chunk(self, choice: dict | None, usage: dict | None = None) -> dict:
        body = {
            "id": self.job.rid,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.front.models.reply_name(self.req.model),
            "choices": [choice] if choice else [],
        }
        if usage is None and self.running and choice:  # vLLM's continuous_usage_stats: the request's so far
            n = self.n_prompt
            usage = {"prompt_tokens": n, "completion_tokens": self.generated, "total_tokens": n + self.generated}
        if usage is not None:
            body["usage"] = usage
        return body

    def _choice(self, i: int, text: str, lps: list, finish=None, thought: str = "", calls=()) -> dict:
        if self.kind == "chat":
            out = self._chat_delta(i, text, lps, finish, thought, calls)
        else:
            out = self._text(i, text, lps, finish)
        if self.req.return_token_ids:  # every choice's ids, in order, across its chunks
            out["token_ids"], self.pending[i] = self.pending[i], []
            if self.kind != "chat" and i not in self.told:
                out["prompt_token_ids"] = self._prompt(i).ids
                self.told.add(i)
        return out

    def _chat_delta(self, i: int, text: str, lps: list, finish, thought: str, calls) -> dict:
        delta = {"reasoning_content": thought} if thought else {}
        if text or (finish is None and not thought and not calls):
            delta["content"] = text
        if calls:
            delta["tool_calls"] = calls
        as_ids = self.req.return_tokens_as_token_ids
        logprobs = self.front.logprobs.chat(lps, as_ids) if self.want_lps and lps else None
        return {"index": i, "delta": delta, "finish_reason": finish, "logprobs": logprobs}

    def _text(self, i: int, text: str, lps: list, finish) -> dict:
        out = {"index": i, "text": text, "finish_reason": finish, "logprobs": None}
        if self.want_lps and lps:
            as_ids = self.req.return_tokens_as_token_ids
            out["logprobs"], self.offsets[i] = self.front.logprobs.completion(lps, self.offsets[i], as_ids)
        return out
