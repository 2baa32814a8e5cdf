"""Talking to a running cluster: submit a request to the scheduler, stream its tokens from the decode engine.

Used by the HTTP frontend, offline rollouts, benchmarks and tests. If the decode engine fails before any token
arrived, the scheduler retries the request elsewhere and the client follows the new assignment. If it dies while
generating (its process gone, or silent past the scheduler's heartbeat timeout), the client moves the reply
(request migration, as Dynamo's frontends do): each unfinished choice goes on as a request of its own whose prompt
ends with the tokens already delivered (``SamplingParams.num_resumed_tokens``), so it continues where the reader
is, not from the start; the dead engine stored every full block of the reply so far, so most of that context is
loaded, not computed. Greedy and seeded replies come out as they would have; the consumer sees one stream.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

from dualpath.core.errors import DualPathError, RequestError
from dualpath.core.geometry import block_hashes
from dualpath.core.messages import (
    Abort,
    Ack,
    AdapterLoad,
    AdapterLoadReply,
    Hold,
    HoldReply,
    RequestRef,
    SessionIn,
    SubmitEvent,
    SubmitRequest,
    TokenEvent,
    TurnEnd,
    WeightUpdate,
    WeightUpdateReply,
    pack_keys,
    pack_tokens,
)
from dualpath.core.rpc import ENGINE_METHODS, SCHEDULER_METHODS, Client, RpcError
from dualpath.core.sampling_params import SamplingParams
from dualpath.core.sessions import SessionHint

log = logging.getLogger(__name__)
RECONNECT_PAUSE_S = 0.5  # between submissions of a request whose scheduler session ended


class OverloadedError(RequestError):
    """The cluster cannot take the request now (the scheduler's queue is full, or it has no engines yet); retry
    later."""


class SessionLost(DualPathError):
    """The scheduler session ended while a request waited for a decode engine: it is submitted again."""


class EngineLost(DualPathError):
    """A request's decode engine died or is stopping while generating it (the client may move the reply), or,
    ``preempted``, handed it back to make room for a more urgent request (the reply goes on, whatever the
    migration limit)."""

    def __init__(self, message: str, preempted: bool = False):
        super().__init__(message)
        self.preempted = preempted


class Aborted(DualPathError):
    """The scheduler ended a request while it generated (a weight update's abort): its choices end where they are."""


@dataclass
class GenerationResult:
    request_id: str
    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    path: str = ""
    storage_bytes: int = 0
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    logprobs: list = field(default_factory=list)
    index: int = 0  # the choice (``SamplingParams.n``)
    prefetched: bool = False  # an agent session's turn that read a prefetch of its KV (placed where it was)


@dataclass(frozen=True)
class _Unreachable:
    engine_id: str


def _size(item) -> int:
    return len(item.tokens) + len(item.block_hashes) if isinstance(item, SubmitRequest) else 64


class _Session:
    """One long-lived ``Session`` stream to the scheduler carrying every request of this client, in batches."""

    def __init__(self, scheduler: Client):
        self.outgoing: queue.Queue = queue.Queue()
        self.listeners: dict[str, object] = {}
        self.lock = threading.Lock()
        self.alive = True
        self.call = scheduler.stream("Session", self._batches())
        threading.Thread(target=self._receive, daemon=True, name="session").start()

    def _batches(self):
        while True:
            item = self.outgoing.get()
            if item is None:
                return
            batch, size = [item], _size(item)
            while len(batch) < 256 and size < 32 << 20:  # what else is waiting goes in the same message
                try:
                    nxt = self.outgoing.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self.outgoing.put(None)
                    break
                batch.append(nxt)
                size += _size(nxt)
            yield SessionIn(
                [x for x in batch if isinstance(x, SubmitRequest)],
                [x for x in batch if isinstance(x, str)],
                [x.engine_id for x in batch if isinstance(x, _Unreachable)],
                [x for x in batch if isinstance(x, TurnEnd)],
            )

    def _receive(self) -> None:
        error = "the scheduler session ended"
        try:
            for out in self.call:
                for ev in out.events:
                    with self.lock:
                        listener = self.listeners.get(ev.request_id)
                        if ev.kind in ("finished", "failed"):
                            self.listeners.pop(ev.request_id, None)
                    if listener is not None:
                        listener(ev)
        except DualPathError as e:
            error = str(e)
        with self.lock:
            self.alive = False
            orphans, self.listeners = self.listeners, {}
        for rid, listener in orphans.items():  # the scheduler restarted, or the link to it broke
            listener(SubmitEvent("lost", rid, error=error))

    def submit(self, req: SubmitRequest, listener) -> None:
        with self.lock:
            alive = self.alive
            if alive:
                self.listeners[req.request_id] = listener
        if not alive:  # it ended between being handed out and now
            listener(SubmitEvent("lost", req.request_id, error="the scheduler session ended"))
            return
        self.outgoing.put(req)

    def cancel(self, request_id: str) -> None:
        with self.lock:
            known = self.listeners.pop(request_id, None) is not None
        if known and self.alive:
            self.outgoing.put(request_id)

    def unreachable(self, engine_id: str) -> None:
        """Tell the scheduler a token stream from ``engine_id`` broke (it checks the engine's health)."""
        if self.alive:
            self.outgoing.put(_Unreachable(engine_id))

    def end_turn(self, turn: TurnEnd) -> None:
        if self.alive:
            self.outgoing.put(turn)

    def close(self) -> None:
        self.outgoing.put(None)
        self.call.cancel()


class _Delivered:
    """What one choice of a request has delivered to the reader: its tokens, and whether (and why) it ended."""

    __slots__ = ("tokens", "ending", "done", "numbers")

    def __init__(self):
        self.tokens: list[int] = []
        self.ending = ""  # a token said it ended the choice (its finish event may not have come)
        self.done = False  # its finish event came
        self.numbers: dict = {}  # the request's numbers, from the choice's first token event

    def note(self, ev: TokenEvent) -> None:
        if ev.token_id >= 0:
            self.tokens.append(ev.token_id)
            self.ending = ev.ending
            if ev.num_prompt_tokens and not self.numbers:
                self.numbers = {
                    "num_prompt_tokens": ev.num_prompt_tokens,
                    "num_cached_tokens": ev.num_cached_tokens,
                    "path": ev.path,
                    "storage_bytes": ev.storage_bytes,
                }
        self.done = self.done or bool(ev.finish_reason)


class RequestHandle:
    """One submitted request: its token events, and a way to cancel it from any thread."""

    def __init__(
        self,
        client: "ClusterClient",
        request_id: str,
        token_ids: list[int],
        sampling: SamplingParams,
        mode: str,
        migrations: int,
        label: str = "",
        agent: SessionHint | None = None,
    ):
        self.client, self.request_id, self.base_id, self.label = client, request_id, request_id, label
        self.agent = agent  # the agent session this request is a turn of
        self.prefetched = False
        self.token_ids, self.sampling, self.mode = token_ids, sampling, mode
        self.migrations = migrations  # how many more times the reply may move off a lost decode engine
        self.queue: queue.Queue = queue.Queue()
        self.active: list = []  # the decode-engine stream being read, so news from the scheduler can interrupt it
        self.session: _Session | None = None
        self.cancelled = False
        self.moved: list[RequestHandle] = []  # where its unfinished choices went after its engine was lost
        self.got_tokens = False  # its current attempt streamed a token
        self.session_lost = False  # the scheduler session of its current submission ended
        self.lost_at: float | None = None  # when it last lost its session before reaching a decode engine
        self.resubmits = 0

    @property
    def num_prompt_tokens(self) -> int:
        """The prompt's tokens as its submitter counts them (a resumed reply's own are not prompt)."""
        return len(self.token_ids) - self.sampling.num_resumed_tokens

    def _submit(self) -> None:
        self.session = self.client.session()
        hashes, fingerprint = self.client._hashes(self.token_ids, self.sampling.cache_salt, self.sampling.adapter)
        self.session.submit(
            SubmitRequest(
                self.request_id,
                pack_tokens(self.token_ids),
                self.sampling.to_dict(),
                self.mode,
                hashes,
                fingerprint,
                self.label,
                self.agent,
            ),
            self._listen,
        )

    def _resubmit(self) -> None:
        """The scheduler session ended before this request got to a decode engine (the scheduler restarted, or the
        link to it broke): submit it again, under a new id, on a new session, for up to the client's
        ``reconnect_s`` (a reply already on a decode engine goes on without the scheduler: ``_listen``)."""
        now = time.monotonic()
        self.lost_at = self.lost_at or now
        if now - self.lost_at > self.client.reconnect_s:
            raise DualPathError(
                f"request {self.request_id}: the scheduler did not answer again within {self.client.reconnect_s:.0f} s"
            )
        time.sleep(RECONNECT_PAUSE_S)
        self.resubmits += 1
        self.request_id = f"{self.base_id}~{self.resubmits}"
        self.got_tokens = self.session_lost = False
        self._submit()

    def _listen(self, ev: SubmitEvent) -> None:
        if ev.fingerprint:  # the weights changed since the client learnt the fingerprint: hash with the new one
            self.client.model_changed(ev.fingerprint)
        if ev.kind == "assigned":
            self.prefetched = ev.prefetched
        if ev.kind == "lost":
            self.session_lost = True
            if self.active and self.got_tokens:
                return  # its decode engine streams the reply whatever became of the scheduler
        self.queue.put(ev)
        if ev.preempted and self.active and self.got_tokens:
            return  # its engine ends the stream itself once it has sent the tokens before the hand-back: read them
        if ev.kind in ("failed", "assigned", "lost") and self.active:
            self.active[0].cancel()  # retried elsewhere, given up or to be sent again: stop waiting on this attempt

    def end_turn(self, output_tokens: list[int], tool_wait: bool = True, next_turn_in_s: float | None = None) -> None:
        """This turn of an agent session replied ``output_tokens`` (what the next turn's prompt repeats after this
        one's); ``tool_wait``: the reply called tools, so the next turn comes when they are done. The scheduler plans
        the session's prefetch from it. Nothing for a request of no session."""
        if self.agent is None:
            return
        hint = -1.0 if next_turn_in_s is None else next_turn_in_s
        self.client.session().end_turn(TurnEnd(self.request_id, pack_tokens(output_tokens), tool_wait, hint))

    def cancel(self) -> None:
        self.cancelled = True
        for h in list(self.moved):
            h.cancel()
        if self.session is not None:
            self.session.cancel(self.request_id)
        if self.active:
            self.active[0].cancel()
        self.queue.put(SubmitEvent("failed", self.request_id, error="cancelled"))

    def events(self) -> Iterator[TokenEvent]:
        delivered = [_Delivered() for _ in range(self.sampling.n)]
        try:
            for ev in self._attempts():
                delivered[ev.index].note(ev)
                yield self._own(ev)
            return
        except EngineLost as e:
            lost = e
        except Aborted:
            yield from self._ends(delivered, "abort")
            return
        finally:
            if self.session is not None:
                self.session.cancel(self.request_id)
        yield from self._move(delivered, lost)

    def _attempts(self) -> Iterator[TokenEvent]:
        """The request's events from whichever engines the scheduler assigns it to; ``EngineLost`` when its decode
        engine is lost while generating."""
        while not self.cancelled:
            try:
                assigned = self._assignment()
            except SessionLost:
                self._resubmit()
                continue
            except DualPathError:
                if self.cancelled:
                    return
                raise
            stream = self.client._engine(assigned.decode_address).stream("Stream", RequestRef(assigned.work_id))
            self.active[:] = [stream]
            try:
                for tok in stream:
                    # the engine is stopping, or (the session gone, so no retry will come) it dropped the reply
                    if tok.engine_lost or (tok.finish_reason == "abort" and self.got_tokens and self.session_lost):
                        raise EngineLost(f"request {self.request_id}: {tok.error}", tok.preempted)
                    if tok.finish_reason == "abort" and not self.got_tokens:
                        break  # the attempt was dropped before producing anything: wait for a retry
                    if tok.finish_reason == "abort":  # the scheduler's word on it (an abort of its own?) is near
                        raise self._interruption(0.5, f"request {self.request_id} aborted: {tok.error}")
                    self.got_tokens = self.got_tokens or tok.token_id >= 0
                    yield tok
                    if tok.finish_reason and tok.final:
                        return
            except RpcError as e:
                if self.session is not None:  # so no request waits for its heartbeats to lapse
                    self.session.unreachable(assigned.decode_engine)
                if self.got_tokens:
                    raise EngineLost(
                        f"request {self.request_id}: the decode engine failed mid-generation: {e}"
                    ) from None
            finally:
                self.active.clear()
            if self.got_tokens and not self.cancelled:
                raise self._interruption()

    def _assignment(self) -> SubmitEvent:
        """The scheduler's next assignment of this request (``SessionLost``, ``EngineLost`` or why it failed)."""
        deadline = time.monotonic() + self.client.timeout
        while True:
            try:
                ev = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise DualPathError(
                    f"request {self.request_id}: not scheduled within {self.client.timeout} s"
                ) from None
            if ev.kind == "lost":
                raise SessionLost(ev.error)
            if ev.kind == "failed":
                if ev.engine_lost:
                    raise EngineLost(f"request {self.request_id} failed: {ev.error}", ev.preempted)
                if ev.error.startswith("unavailable"):
                    if self.lost_at is not None:  # a scheduler just restarted, its engines not yet back
                        raise SessionLost(ev.error)
                    raise OverloadedError(ev.error.split(": ", 1)[-1])
                if ev.error.startswith("invalid"):
                    raise RequestError(ev.error.split(": ", 1)[-1], field=ev.param or None)
                raise (Aborted if ev.aborted else DualPathError)(f"request {self.request_id} failed: {ev.error}")
            if ev.kind == "assigned":
                self.lost_at = None
                return ev

    def _interruption(self, wait_s: float = 5.0, otherwise: str = "") -> DualPathError:
        """Why a stream that had delivered tokens was stopped by news from the scheduler (``_listen``)."""
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                ev = self.queue.get(timeout=left)
            except queue.Empty:
                break
            if ev.kind == "assigned":  # started over elsewhere: the reply moves on from what was delivered
                return EngineLost(f"request {self.request_id} was moved off {ev.decode_engine or 'its engine'}")
            if ev.kind == "failed" and ev.engine_lost:
                return EngineLost(f"request {self.request_id} failed: {ev.error}", ev.preempted)
            if ev.kind == "failed":
                return (Aborted if ev.aborted else DualPathError)(f"request {self.request_id} failed: {ev.error}")
            if ev.kind == "lost":  # and, with it, any retry: the reply moves on from what was delivered
                return EngineLost(f"request {self.request_id}: {ev.error}")
        return DualPathError(
            otherwise or f"request {self.request_id}: its stream ended early (the scheduler gave up on it)"
        )

    def _ends(self, delivered: list[_Delivered], reason: str, more: bool = False) -> Iterator[TokenEvent]:
        """Finish events of the choices whose finish event has not come: those a token ended with its reason,
        the others with ``reason`` ("": the others go on, ``more`` events follow)."""
        ending = [(i, d.ending or reason) for i, d in enumerate(delivered) if not d.done and (d.ending or reason)]
        for k, (i, why) in enumerate(ending):
            yield self._own(
                TokenEvent(
                    self.request_id,
                    finish_reason=why,
                    index=i,
                    final=k == len(ending) - 1 and not more,
                    **delivered[i].numbers,
                )
            )

    def _move(self, delivered: list[_Delivered], lost: EngineLost) -> Iterator[TokenEvent]:
        """The reply's events after its decode engine was lost: the finish events of choices whose last token
        ended them, then the unfinished choices' continuations, each a request of its own."""
        if (self.migrations <= 0 and not lost.preempted) or self.cancelled:
            raise DualPathError(str(lost))
        going = [i for i, d in enumerate(delivered) if not d.ending and not d.done]
        yield from self._ends(delivered, "", more=bool(going))
        if not going:
            return
        left = len(going)
        if not lost.preempted:  # a preempted reply goes on without spending a move
            self.client._migrated(self.request_id, lost, {i: len(delivered[i].tokens) for i in going})
        self.moved[:] = [self._continuation(i, delivered[i].tokens, lost.preempted) for i in going]
        if self.cancelled:  # ``cancel`` ran meanwhile, before these existed
            for h in self.moved:
                h.cancel()
        whole = False
        try:
            for j, ev in _merged(self.moved):
                left -= bool(ev.finish_reason)
                yield self._own(replace(ev, index=going[j], final=not left))
            whole = True
        finally:
            if not whole:  # an error, or the reader let go: nothing of the request may run on
                for h in self.moved:
                    h.cancel()

    def _continuation(self, choice: int, tokens: list[int], preempted: bool) -> "RequestHandle":
        """Choice ``choice`` as a request of its own that goes on after ``tokens``, the ones it delivered (its
        prompt's logprobs came with the first of them), with one move less unless it was ``preempted``."""
        p = self.sampling
        params = replace(
            p,
            n=1,
            seed=None if p.seed is None else p.seed + choice,
            prompt_logprobs=None if tokens else p.prompt_logprobs,
            num_resumed_tokens=p.num_resumed_tokens + len(tokens),
        )
        return self.client._start(
            self.token_ids + tokens,
            params,
            f"{self.request_id}+{choice}",
            self.mode,
            self.migrations - (not preempted),
            self.label,
        )

    def _own(self, ev: TokenEvent) -> TokenEvent:
        """``ev`` with this request's usage numbers: its prompt's tokens and how many of them were loaded (the
        engines of a resumed reply count its resumed tokens as prompt)."""
        if not (ev.finish_reason or ev.num_prompt_tokens):
            return ev
        n = self.num_prompt_tokens
        return replace(ev, num_prompt_tokens=n, num_cached_tokens=min(ev.num_cached_tokens, n))


def _merged(handles: list[RequestHandle]) -> Iterator[tuple[int, TokenEvent]]:
    """Every handle's events as they come, with the handle's position; the first error of any is raised (the
    caller cancels the others). Each handle bounds its own waits."""
    if len(handles) == 1:
        for ev in handles[0].events():
            yield 0, ev
        return
    out: queue.Queue = queue.Queue()

    def pump(j: int, h: RequestHandle) -> None:
        try:
            for ev in h.events():
                out.put((j, ev))
        except BaseException as e:  # noqa: BLE001 - raised to the reader
            out.put((j, e))
        out.put((j, None))

    for j, h in enumerate(handles):
        threading.Thread(target=pump, args=(j, h), daemon=True, name=f"moved-{h.request_id}").start()
    left = len(handles)
    while left:
        j, item = out.get()
        if item is None:
            left -= 1
        elif isinstance(item, BaseException):
            raise item
        else:
            yield j, item


class ClusterClient:
    """A cluster's client. ``timeout``: how long a request may wait to be scheduled; ``migration_limit``: how many
    times a reply may move off decode engines lost while generating it (0: such a request fails); ``on_migration``:
    called with the request id each time one moves; ``reconnect_s``: how long requests not yet on a decode engine
    wait for a scheduler whose session ended (restarting) before they fail."""

    def __init__(
        self,
        scheduler: str,
        timeout: float = 3600.0,
        migration_limit: int = 3,
        on_migration: Callable[[str], None] | None = None,
        reconnect_s: float = 60.0,
    ):
        self.scheduler = Client("Scheduler", SCHEDULER_METHODS, scheduler)
        self.timeout, self.reconnect_s = timeout, reconnect_s
        self.migration_limit, self.on_migration = migration_limit, on_migration
        self._engines: dict[str, Client] = {}
        self._lock = threading.Lock()
        self._model: tuple[bytes, int] | None = None  # (fingerprint, block size), to hash prompts here
        self._session: _Session | None = None

    def session(self) -> _Session:
        with self._lock:
            if self._session is None or not self._session.alive:
                self._session = _Session(self.scheduler)
            return self._session

    def _engine(self, address: str) -> Client:
        with self._lock:
            if address not in self._engines:
                self._engines[address] = Client("Engine", ENGINE_METHODS, address)
            return self._engines[address]

    def stats(self) -> dict:
        return self.scheduler.call("Stats", RequestRef(""), timeout=10).data

    def _hashes(self, token_ids: list[int], salt: str = "", adapter: str = "") -> tuple[bytes, str]:
        """The prompt's block hashes (chained from ``salt`` and ``adapter``: ``SamplingParams.cache_salt`` and
        ``SamplingParams.adapter``), computed here so the
        scheduler spends no time on them, and the fingerprint they chain from (if the weights changed meanwhile, the
        scheduler hashes again and says so)."""
        if self._model is None:
            data = self.stats()
            if not data.get("fingerprint"):
                return b"", ""
            self._model = (bytes.fromhex(data["fingerprint"]), data["block_size"])
        fp, bs = self._model
        return pack_keys(block_hashes(token_ids, fp, bs, salt=salt, adapter=adapter)), fp.hex()

    def model_changed(self, fingerprint: str) -> None:
        if self._model is not None:
            self._model = (bytes.fromhex(fingerprint), self._model[1])

    def load_adapter(self, path: str, timeout: float = 120.0) -> AdapterLoadReply:
        """Have every engine load the PEFT LoRA adapter at ``path`` (and every engine that joins later); the reply
        says whether all did and the adapter's identity, which requests name it by (``SamplingParams.adapter``)."""
        return self.scheduler.call("LoadAdapter", AdapterLoad(path, timeout), timeout=timeout + 30)

    def update_weights(
        self, model_path: str, version: str = "", timeout: float = 600.0, abort: bool = False
    ) -> WeightUpdateReply:
        """Have every engine load the weights of checkpoint ``model_path`` (the same config, new values: an RL
        trainer's next policy). Requests in flight finish first (or, with ``abort``, those not yet generating go
        back to the queue and those generating end); requests sent meanwhile wait and run on the new weights.
        The reply says whether every engine loaded them (``ok``; ``error`` why not) and their ``fingerprint``;
        when no engine could (another model's checkpoint, a missing directory) the old weights stay."""
        reply = self.scheduler.call(
            "UpdateWeights", WeightUpdate(model_path, version, timeout, abort), timeout=timeout + 30
        )
        if reply.fingerprint:
            self.model_changed(reply.fingerprint)
        return reply

    def hold(self, on: bool, abort: bool = False, wait_s: float = 0.0) -> HoldReply:
        """Pause generation (``on``: the scheduler hands no request sent from now on to an engine; with ``abort``
        every request in flight ends now, its choices with finish reason abort; else wait up to ``wait_s`` for those
        sent before to end), or go on again."""
        return self.scheduler.call("Hold", Hold(on, abort, wait_s), timeout=wait_s + 30)

    def abort(self, label: str = "", every: bool = False) -> int:
        """End the requests labelled ``label`` (every request with ``every``) in flight anywhere in the cluster, where
        they are: their choices finish with the tokens they had, reason abort. Returns how many ended."""
        return self.scheduler.call("Abort", Abort(label, every), timeout=30).aborted

    def flush_cache(self) -> Ack:
        """Remove every stored block of the served weights, so the next requests compute their prompts whole (a
        benchmark's cold start); refused (``ok`` false, ``error`` why) while requests are in flight."""
        return self.scheduler.call("FlushCache", RequestRef(""), timeout=60)

    def block_size(self) -> int:
        """The model's KV block size in tokens, known once a request was submitted (0 before)."""
        return self._model[1] if self._model else 0

    def start(
        self,
        token_ids: list[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        mode: str = "",
        label: str = "",
        session: SessionHint | None = None,
    ) -> "RequestHandle":
        """Submit a request; iterate ``handle.events()`` for its tokens, ``handle.cancel()`` (any thread) to drop it.
        ``label``: a name it shares with others (``abort`` ends every request of a label); ``session``: the agent
        session it is a turn of (``handle.end_turn`` when it replied)."""
        return self._start(
            token_ids, sampling, request_id or uuid.uuid4().hex, mode, self.migration_limit, label, session
        )

    def _start(
        self,
        token_ids: list[int],
        sampling: SamplingParams,
        request_id: str,
        mode: str,
        migrations: int,
        label: str = "",
        session: SessionHint | None = None,
    ) -> "RequestHandle":
        handle = RequestHandle(self, request_id, list(token_ids), sampling, mode, migrations, label, session)
        handle._submit()
        return handle

    def _migrated(self, request_id: str, why: EngineLost, resumed: dict[int, int]) -> None:
        """A reply moves on from what was delivered (``resumed``: choice -> its tokens so far)."""
        log.warning(
            "%s; continuing choice(s) %s after %s token(s) on other engines",
            why,
            ", ".join(map(str, resumed)),
            ", ".join(map(str, resumed.values())),
        )
        if self.on_migration is not None:
            self.on_migration(request_id)

    def stream(
        self, token_ids: list[int], sampling: SamplingParams, request_id: str | None = None, mode: str = ""
    ) -> Iterator[TokenEvent]:
        """Token events of one request, ending with the event that carries ``finish_reason``."""
        return self.start(token_ids, sampling, request_id, mode).events()

    def generate(
        self, token_ids: list[int], sampling: SamplingParams, request_id: str | None = None, mode: str = ""
    ) -> GenerationResult:
        """One choice's tokens (``sampling.n`` 1; ``generate_choices`` returns all of them)."""
        if sampling.n != 1:
            raise RequestError(f"generate returns one choice; use generate_choices for n = {sampling.n}", field="n")
        return self.generate_choices(token_ids, sampling, request_id, mode)[0]

    def generate_choices(
        self,
        token_ids: list[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        mode: str = "",
        session: SessionHint | None = None,
        tool_wait: bool = False,
    ) -> list[GenerationResult]:
        """Every choice of one request (``sampling.n``), in choice order. A choice a weight update aborted
        (``update_weights(abort=True)``) ends with finish reason ``abort`` and the tokens it had. A turn of an agent
        ``session`` ends with ``end_turn`` of choice 0's reply (``tool_wait``: a tool now runs)."""
        start = time.perf_counter()
        times: list[list[float]] = [[] for _ in range(sampling.n)]
        tokens, logprobs = [[] for _ in range(sampling.n)], [[] for _ in range(sampling.n)]
        out: list[GenerationResult | None] = [None] * sampling.n
        handle = self.start(token_ids, sampling, request_id, mode, session=session)
        for ev in handle.events():
            i = ev.index
            if ev.token_id >= 0:
                times[i].append(time.perf_counter())
                tokens[i].append(ev.token_id)
                logprobs[i].append(ev.logprob)
            if ev.finish_reason:
                t = times[i]
                tpot = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0
                out[i] = GenerationResult(
                    ev.request_id,
                    tokens[i],
                    ev.finish_reason,
                    ev.num_prompt_tokens,
                    ev.num_cached_tokens,
                    ev.path,
                    ev.storage_bytes,
                    (t[0] if t else time.perf_counter()) - start,
                    tpot,
                    logprobs[i],
                    i,
                    handle.prefetched,
                )
        if any(r is None for r in out):
            raise DualPathError("the token stream ended without every choice's finish reason")
        if session is not None:
            handle.end_turn(out[0].token_ids, tool_wait)
        return out

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
        self.scheduler.close()
        for c in self._engines.values():
            c.close()
