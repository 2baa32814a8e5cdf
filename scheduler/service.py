"""The scheduler process: ``SchedulerCore`` behind an asyncio gRPC server (``dualpath scheduler --port ...``).

It takes requests — ``Submit`` opens a stream of events for one request; a ``Session`` carries many requests each
way in batches, which is how busy frontends submit (one gRPC message per batch, not per event) — lets engine
groups pull work and push load reports, and stays off the data path: tokens stream from the decode engine to the
submitter.
Every handler runs on one event loop thread, so the core is never contended and thousands of open submit
streams cost coroutines, not threads.
"""

from __future__ import annotations

import asyncio
import logging
import time

from dualpath.core.config import SchedulerConfig
from dualpath.core.errors import RequestError, UnavailableError
from dualpath.core.faults import failpoint
from dualpath.core.messages import (
    Abort,
    AbortReply,
    Ack,
    AdapterLoad,
    AdapterLoadReply,
    EngineInfo,
    EngineLoad,
    Hold,
    HoldReply,
    PullReply,
    PullRequest,
    RegisterReply,
    RequestRef,
    SessionOut,
    Stats,
    SubmitEvent,
    SubmitRequest,
    WeightUpdate,
    WeightUpdateReply,
)
from dualpath.core.rpc import ENGINE_METHODS, SCHEDULER_METHODS, Client, PlaneAuth, RpcError, serve_async
from dualpath.scheduler.core import SchedulerCore
from dualpath.scheduler.policies import make_policy
from dualpath.scheduler.weights import drained_by, load_adapter, update_weights

log = logging.getLogger(__name__)

_TERMINAL = ("finished", "failed")
HEALTH_TIMEOUT_S = 3.0  # a dead process refuses at once; this bounds a hung host


def _refusal(request_id: str, e: RequestError) -> SubmitEvent:
    """A submission's refusal as submitters read it: "unavailable: ..." (retry later) or "invalid: ...", with the
    field at fault."""
    kind = "unavailable" if isinstance(e, UnavailableError) else "invalid"
    return SubmitEvent("failed", request_id, error=f"{kind}: {e}", param=e.field or "")


class SchedulerService:
    def __init__(self, core: SchedulerCore, members_authenticated: bool = False):
        self.core = core
        # the plane checks every caller's token: a submitter is a cluster member, whose block hashes (named with
        # the fingerprint they chain from) are used, a share of them checked (``SchedulerCore._prompt_hashes``)
        self.members_authenticated = members_authenticated
        self._updating = False
        self._checking: dict[str, asyncio.Task] = {}  # engine -> its health check under way (held: tasks are weak)
        self._open: set = set()  # how to wake each open Submit or Session stream so that it ends (``close_streams``)
        self._closing = False

    def close_streams(self) -> None:
        """The scheduler is stopping: every open Submit and Session stream ends now, normally; its submitter reads
        the session as lost and submits again to the next scheduler. (Cut by the server's grace period instead, each
        would end in a logged error.)"""
        self._closing = True
        for wake in list(self._open):
            wake()

    def _vouched(self, req: SubmitRequest) -> bool:
        return self.members_authenticated and bool(req.fingerprint)

    async def Register(self, info: EngineInfo, ctx) -> RegisterReply:
        return self.core.register(info)

    async def Pull(self, req: PullRequest, ctx) -> PullReply:
        reply = self.core.pull(req.group_id, req.loads, req.sender, req.unreachable)
        if reply.assignments:
            failpoint("scheduler.assign")
        return reply

    async def PullStream(self, requests, ctx):
        """``Pull`` as messages on one open stream per engine group, each request answered in order: no call setup,
        metadata or token check per pull, which engines make every 20 ms (``bench/pull_transport.py``)."""
        async for req in requests:
            yield await self.Pull(req, ctx)

    async def Report(self, load: EngineLoad, ctx) -> Ack:
        self.core.report(load)
        return Ack()

    async def Cancel(self, ref: RequestRef, ctx) -> Ack:
        self.core.cancel(ref.request_id, ref.reason or "cancelled by the submitter")
        return Ack()

    async def Stats(self, ref: RequestRef, ctx) -> Stats:
        return Stats({**self.core.stats(), "ready": self.core.ready()})

    async def UpdateWeights(self, req: WeightUpdate, ctx) -> WeightUpdateReply:
        """New weights for every engine (``dualpath.scheduler.weights``); one update at a time."""
        if self._updating:
            return WeightUpdateReply(False, "another weight update is running")
        self._updating = True
        try:
            return await update_weights(self.core, req)
        finally:
            self._updating = False

    async def LoadAdapter(self, req: AdapterLoad, ctx) -> AdapterLoadReply:
        """A LoRA adapter on every engine (``dualpath.scheduler.weights.load_adapter``)."""
        return await load_adapter(self.core, req)

    async def Hold(self, req: Hold, ctx) -> HoldReply:
        """Generation paused or going on again (``SchedulerCore.hold``, ``release``)."""
        if not req.on:
            self.core.release()
            return HoldReply()
        aborted = self.core.hold(req.abort)
        drained = await drained_by(self.core.hold_drained, time.monotonic() + req.wait_s)
        return HoldReply(aborted, drained)

    async def Abort(self, req: Abort, ctx) -> AbortReply:
        return AbortReply(self.core.abort(None if req.every else req.label))

    async def FlushCache(self, ref: RequestRef, ctx) -> Ack:
        """Every stored block of the served weights removed (``SchedulerCore.flush``); refused while requests run."""
        from dualpath.traffic.storage.fs import remove_stored  # imports torch, which a scheduler otherwise does without

        why = self.core.flush(remove_stored)
        return Ack(not why, why)

    async def Session(self, requests, ctx):
        """Batches in, batches out. Requests still open when the session ends are cancelled."""
        outbox: list[SubmitEvent] = []
        wake = asyncio.Event()
        mine: set[str] = set()

        def notify(ev: SubmitEvent) -> None:
            outbox.append(ev)
            if ev.kind in _TERMINAL:
                mine.discard(ev.request_id)
            wake.set()

        async def read():
            async for batch in requests:
                for req in batch.submits:
                    try:
                        self.core.submit(req, notify, member=self._vouched(req))
                        mine.add(req.request_id)
                    except RequestError as e:
                        notify(_refusal(req.request_id, e))
                for rid in batch.cancels:
                    self.core.cancel(rid, "cancelled by the submitter")
                for eid in batch.unreachable:
                    self._check(eid)
                for t in batch.turn_ends:
                    self.core.end_turn(t)
            wake.set()

        reader = asyncio.create_task(read())
        self._open.add(wake.set)
        try:
            while not self._closing and not (reader.done() and not outbox and not mine):
                await wake.wait()
                wake.clear()
                if outbox:
                    batch, outbox[:] = list(outbox), []
                    yield SessionOut(batch)
        finally:
            self._open.discard(wake.set)
            reader.cancel()
            for rid in list(mine):
                self.core.cancel(rid, "session closed")

    def _check(self, eid: str) -> None:
        """A submitter's stream from ``eid`` broke: ask the engine itself (once at a time), and count it gone if it
        does not answer. A submitter's word alone is not trusted: its own network may be at fault."""
        e = self.core.engines.get(eid)
        if e is None or not e.alive or eid in self._checking:
            return
        self._checking[eid] = asyncio.create_task(self._health(eid, e.info.control_address))

    async def _health(self, eid: str, address: str) -> None:
        def call() -> str:
            engine = Client("Engine", ENGINE_METHODS, address)
            try:
                return "" if engine.call("Health", RequestRef(""), timeout=HEALTH_TIMEOUT_S).ok else "it is stopping"
            except RpcError as e:
                return str(e)
            finally:
                engine.close()

        try:
            why = await asyncio.get_running_loop().run_in_executor(None, call)
            if why:
                self.core.lost(eid, f"a token stream from it broke and its health check failed: {why}")
        finally:
            self._checking.pop(eid, None)

    async def Submit(self, req: SubmitRequest, ctx):
        events: asyncio.Queue = asyncio.Queue()
        try:
            self.core.submit(req, events.put_nowait, member=self._vouched(req))
        except RequestError as e:
            yield _refusal(req.request_id, e)
            return
        done, closed = False, lambda: events.put_nowait(None)
        self._open.add(closed)
        try:
            while not self._closing:
                ev = await events.get()
                if ev is None:
                    return
                done = ev.kind in _TERMINAL
                yield ev
                if done:
                    return
        finally:
            self._open.discard(closed)
            if not done:  # the submitter went away (its stream was cancelled), or the scheduler is stopping
                self.core.cancel(req.request_id, "submitter went away")


async def run_scheduler_async(config: SchedulerConfig, ready=None, stop: asyncio.Event | None = None) -> None:
    core = SchedulerCore(config, make_policy(config.policy, recompute_slow_hits=config.recompute_slow_hits))
    auth = PlaneAuth.from_env()
    service = SchedulerService(core, members_authenticated=bool(auth.token))
    server, port = await serve_async(
        "Scheduler", SCHEDULER_METHODS, service, f"{config.host}:{config.port}", auth, on_refused=core.refused_call
    )
    http = None
    if config.http_port >= 0:
        import socket

        import uvicorn

        from dualpath.scheduler.http import build_app

        sock = socket.create_server((config.host, config.http_port))
        http = uvicorn.Server(uvicorn.Config(build_app(core), log_level="warning", lifespan="off"))
        http_task = asyncio.create_task(http.serve(sockets=[sock]))
        log.info("scheduler metrics on http://%s:%d/metrics", config.host, sock.getsockname()[1])
    log.info("scheduler listening on %s:%d (mode %s, policy %s)", config.host, port, config.mode, config.policy)
    if ready is not None:
        ready(port, sock.getsockname()[1] if http else -1)
    stop = stop or asyncio.Event()

    async def reap():
        while not stop.is_set():
            core.expire()
            await asyncio.sleep(max(0.05, config.heartbeat_timeout_s / 4))

    reaper = asyncio.create_task(reap())
    await stop.wait()
    reaper.cancel()
    if http is not None:
        http.should_exit = True
        await http_task
    service.close_streams()
    await server.stop(grace=1)
