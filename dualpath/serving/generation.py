"""A request's generations: its prompts submitted to the scheduler (``Generations.start``), one generation per
choice that turns the decode engine's token events into text (``ChoiceText``: detokenized incrementally, stop strings
matched here), and every choice gathered for a response that is not streamed (``Generations.gather``). The items a
generation yields are ``dualpath.serving.choices``'s: ``(text delta, token ids, logprob)`` per token,
``PromptLogprobs`` when the prompt's arrive, then its ``Outcome``."""

from __future__ import annotations

import asyncio
import time
import uuid
from functools import partial
from typing import Any, AsyncIterator

from dualpath.client import OverloadedError
from dualpath.core.errors import DualPathError, RequestError
from dualpath.core.sampling_params import SamplingParams
from dualpath.core.sessions import SessionHint
from dualpath.core.tokenizer import IncrementalDetokenizer, find_stop, stop_cut
from dualpath.serving.auth import ANONYMOUS, owned_label
from dualpath.serving.choices import ApiError, Fanout, Generation, Outcome, Prompt, PromptLogprobs, drain


class Generations:
    def __init__(self, front):
        self.front = front

    async def start(
        self,
        req,
        prompts: list[Prompt],
        samplings: list[SamplingParams],
        rids: list[str] | None = None,
        label: str = "",
        owner: str = ANONYMOUS,
        agent: SessionHint | None = None,
    ) -> list[Generation]:
        """Submit each prompt (its ``n`` choices are sampled from one prefill, choice i with seed + i when seeded);
        one generation per choice, prompt after prompt. Admission counts every choice, the server's and ``owner``'s.
        ``rids``: each prompt's name for ``/abort_request`` (SGLang's ``rid``; default: ``label``), in ``owner``'s
        namespace. ``label``: the HTTP request's id, which begins each prompt's id at the scheduler and engines
        (their logs name it; a random suffix keeps ids unique when clients reuse theirs). ``agent``: the session the
        request is a turn of (one prompt)."""
        if agent is not None and len(prompts) > 1:
            raise ApiError(400, "a turn of a session is one prompt", param="prompt")
        k = req.samples()
        total = k * len(prompts)
        done = self._admit(owner, total, len(prompts), k)
        if req.model in self.front.models.adapters:
            self.front.metrics.lora.labels(adapter=req.model).inc()
        mode = (req.dualpath.mode or "") if req.dualpath else ""
        gens, loop = [], asyncio.get_running_loop()
        try:
            for j, (p, sampling) in enumerate(zip(prompts, samplings)):
                sid = f"{label}-{uuid.uuid4().hex[:8]}" if label else None
                name = owned_label(owner, (rids[j] if rids else "") or label)
                handle = await asyncio.to_thread(self.front.client.start, p.ids, sampling, sid, mode, name, agent)
                fan = Fanout(handle, k, loop)
                gens += [
                    Generation(self._generate(fan, i, p.ids, sampling, done, agent is not None and i == 0), fan, done)
                    for i in range(k)
                ]
        except BaseException as e:
            for g in gens:  # the prompts already submitted are cancelled (each gives its slot back)
                await g.aclose()
            if total > len(gens):
                done(total - len(gens))
            if isinstance(e, DualPathError):  # the scheduler is unreachable or refused the submission
                raise ApiError(
                    503, f"the request could not be submitted: {e}", "server_error", headers={"Retry-After": "1"}
                ) from None
            raise
        return gens

    def end_turn(self, job, first: Outcome | None) -> None:
        """A session's turn replied: its choice 0's tokens go to the scheduler, and whether the reply called tools
        (then its next turn comes when they are done, and its KV may be prefetched meanwhile)."""
        if job.agent is None or first is None or first.token_ids is None:
            return
        job.gens[0].handle.end_turn(first.token_ids, tool_wait=first.tool_calls)

    def _admit(self, owner: str, total: int, n_prompts: int, k: int):
        """Take ``total`` generation slots for ``owner`` (a 400 for more than one request may ever have, a 429 when
        full); returns what gives one back."""
        admission = self.front.admission
        if total > admission.most(owner):
            raise ApiError(
                400,
                f"{n_prompts} prompt(s) x {k} choices exceed the "
                f"{admission.most(owner)} concurrent generations one request may have",
                param="prompt" if n_prompts > 1 else "n",
            )
        admission.take(owner, total)
        return partial(admission.give, owner)

    async def _generate(
        self, fan: Fanout, index: int, prompt: list[int], sampling: SamplingParams, done, turn: bool = False
    ) -> AsyncIterator[Any]:
        """Choice ``index``. Closing it before its end lets go of the request (cancelled once no choice wants it);
        ``done()`` gives back its admission slot, whatever way it ends. ``turn``: choice 0 of an agent session's turn
        (its tokens are kept for ``end_turn``)."""
        events, text = fan.queues[index], ChoiceText(self.front.tokenizer, prompt, sampling)
        outcome, clock, finished = Outcome(), _Clock(), False
        if turn:
            outcome.token_ids = []
        try:
            while not finished:
                ev = await events.get()
                if ev is None:
                    break
                if isinstance(ev, BaseException):
                    raise _failure(ev)
                lp = self._received(ev, outcome, clock)
                if turn and ev.token_id >= 0:
                    outcome.token_ids.append(ev.token_id)
                text.add(ev.token_id, bool(ev.finish_reason))
                if ev.prompt_logprobs is not None:  # on a choice's first event
                    outcome.prompt_logprobs = ev.prompt_logprobs
                    yield PromptLogprobs(ev.prompt_logprobs)
                cut = text.stopped(outcome.completion_tokens)
                if cut is not None:  # a stop string: what precedes it (and it, if asked), then the rest is cancelled
                    yield cut, [ev.token_id], lp
                    outcome.finish_reason, finished = "stop", True
                    fan.release(early=True)
                    break
                delta, ids = text.release(bool(ev.finish_reason)), [ev.token_id] if ev.token_id >= 0 else []
                if ids or delta:
                    yield delta, ids, lp
                if ev.finish_reason:
                    _finished(outcome, ev)
                    finished = True
                    fan.release(early=False)
            if not finished:
                raise ApiError(500, "generation ended without a finish reason", "server_error")
            n_prompt = len(prompt) if index == 0 else 0  # the prompt ran once, for every choice
            self.front.metrics.observe(outcome, n_prompt, clock.start, clock.first, clock.last)
            if turn and clock.first is not None:
                self.front.metrics.session_turn(fan.handle.prefetched, clock.first - clock.start)
            yield outcome
        finally:
            if not finished:
                fan.release(early=True)
                self.front.metrics.cancelled.inc()
            done()

    def _received(self, ev, outcome: Outcome, clock: _Clock) -> dict | None:
        """A token event's count and time (its logprob returned); nothing for an event without a token."""
        if ev.token_id < 0:
            return None
        now = self.front.last_token_at = time.perf_counter()
        clock.first, clock.last = clock.first or now, now
        outcome.completion_tokens += 1
        return ev.logprob

    async def gather(self, request, gens: list) -> tuple[list, list, list, list] | None:
        """Every choice's text pieces, logprobs, token ids and ``Outcome`` once all are done; None if the client left
        first (its request is cancelled)."""
        texts, lps, ids = [[] for _ in gens], [[] for _ in gens], [[] for _ in gens]
        consumers = [asyncio.ensure_future(drain(g, *parts)) for g, *parts in zip(gens, texts, lps, ids)]
        while not all(c.done() for c in consumers):  # a client that hangs up cancels its request
            await asyncio.wait(consumers, timeout=0.5, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((c for c in consumers if c.done() and c.exception() is not None), None)
            gone = failed is None and not all(c.done() for c in consumers) and await request.is_disconnected()
            if failed is not None or gone:
                for c in consumers:
                    c.cancel()
                # a cancelled drain ends inside its generation, whose cleanup then runs; only after that can a
                # generation be closed (closing one still mid-step raises)
                await asyncio.gather(*consumers, return_exceptions=True)
                for g in gens:
                    await g.aclose()
                if failed is not None:
                    raise failed.exception()
                return None
        outcomes = [c.result() for c in consumers]
        for g in gens:
            await g.aclose()
        return texts, lps, ids, outcomes


class ChoiceText:
    """One choice's text as its tokens come. Invariant: ``text[:emitted]`` went out, and the text after it that could
    still begin a stop string (its longest less one character) is held back until the end."""

    def __init__(self, tokenizer, prompt: list[int], sampling: SamplingParams):
        self.detok = IncrementalDetokenizer(tokenizer, prompt, sampling.skip_special_tokens)
        self.sampling = sampling
        self.hold = max((len(s) for s in sampling.stop), default=1) - 1
        self.text, self.emitted = "", 0

    def add(self, token_id: int, last: bool) -> None:
        if token_id >= 0:
            self.text += self.detok.add(token_id)
        if last:
            self.text += self.detok.flush()

    def stopped(self, n_tokens: int) -> str | None:
        """Once a stop string appeared (after ``min_tokens`` tokens: none ends the reply before), the text still to
        go out up to it (and it, if asked); else None."""
        s = self.sampling
        cut = _find_stop(self.text, s.stop, self.emitted) if n_tokens >= s.min_tokens else -1
        if cut < 0:
            return None
        return self.text[self.emitted : stop_cut(self.text, s.stop, cut, s.include_stop_str_in_output)]

    def release(self, last: bool) -> str:
        """The text that can no longer begin a stop string (all of it at the end), not sent before."""
        safe = len(self.text) if last else max(self.emitted, len(self.text) - self.hold)
        out, self.emitted = self.text[self.emitted : safe], safe
        return out


class _Clock:
    """A choice's times (``perf_counter``): its arrival, its first token's and its last token's."""

    def __init__(self):
        self.start, self.first, self.last = time.perf_counter(), None, None


def _failure(ev: BaseException) -> ApiError:
    """The HTTP error of a generation's failure."""
    if isinstance(ev, OverloadedError):
        return ApiError(503, str(ev), "server_error", headers={"Retry-After": "1"})
    if isinstance(ev, RequestError):
        return ApiError(400, str(ev), param=ev.field)
    return ApiError(500, f"generation failed: {ev}", "server_error")


def _finished(outcome: Outcome, ev) -> None:
    """The engines' end of a choice: why, and what its prompt loaded from storage."""
    outcome.finish_reason = ev.finish_reason if ev.finish_reason in ("length", "abort") else "stop"
    outcome.cached_tokens, outcome.path = ev.num_cached_tokens, ev.path
    outcome.storage_bytes = ev.storage_bytes


def _find_stop(text: str, stops, start: int) -> int:
    """Where the first stop string begins, searching from where one could still begin given that ``start``
    characters were emitted; -1 if none."""
    if not stops:
        return -1
    longest = max(len(s) for s in stops)
    return find_stop(text, stops, max(0, start - longest + 1))
