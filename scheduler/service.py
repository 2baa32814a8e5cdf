"""The scheduler process: ``SchedulerCore`` behind gRPC (``dualpath scheduler --port ...``).

It takes requests (``Submit``, a stream of events about the request), lets engine groups pull work and push
load reports, and stays off the data path: tokens stream from the decode engine to the submitter.
"""
from __future__ import annotations

import logging
import queue
import threading

import grpc

from dualpath.config import SchedulerConfig
from dualpath.errors import RequestError
from dualpath.messages import Ack, EngineInfo, EngineLoad, PullReply, PullRequest, RequestRef, Stats, SubmitEvent, \
    SubmitRequest
from dualpath.rpc import SCHEDULER_METHODS, serve
from scheduler.core import SchedulerCore
from scheduler.policy import make_policy

log = logging.getLogger(__name__)

_TERMINAL = ("finished", "failed")


class SchedulerService:
    def __init__(self, core: SchedulerCore):
        self.core = core

    def Register(self, info: EngineInfo, ctx) -> Ack:
        return self.core.register(info)

    def Pull(self, req: PullRequest, ctx) -> PullReply:
        return self.core.pull(req.group_id, req.loads)

    def Report(self, load: EngineLoad, ctx) -> Ack:
        self.core.report(load)
        return Ack()

    def Cancel(self, ref: RequestRef, ctx) -> Ack:
        self.core.cancel(ref.request_id, ref.reason or "cancelled by the submitter")
        return Ack()

    def Stats(self, ref: RequestRef, ctx) -> Stats:
        return Stats({**self.core.stats(), "ready": self.core.ready()})

    def Submit(self, req: SubmitRequest, ctx):
        try:
            events = self.core.submit(req)
        except RequestError as e:
            code = "overloaded" if "overloaded" in str(e) else "invalid"
            yield SubmitEvent("failed", req.request_id, error=f"{code}: {e}")
            return
        done = threading.Event()
        ctx.add_callback(lambda: None if done.is_set() else self.core.cancel(req.request_id, "submitter went away"))
        while ctx.is_active():
            try:
                ev = events.get(timeout=0.5)
            except queue.Empty:
                continue
            if ev.kind in _TERMINAL:
                done.set()
            yield ev
            if ev.kind in _TERMINAL:
                return


def start_scheduler(config: SchedulerConfig) -> tuple[grpc.Server, int, SchedulerCore]:
    core = SchedulerCore(config, make_policy(config.policy))
    server, port = serve("Scheduler", SCHEDULER_METHODS, SchedulerService(core), f"{config.host}:{config.port}",
                         max_workers=64)

    def reap():
        while True:
            core.expire()
            threading.Event().wait(max(0.05, config.heartbeat_timeout_s / 4))

    threading.Thread(target=reap, daemon=True, name="reaper").start()
    log.info("scheduler listening on %s:%d (mode %s, policy %s)", config.host, port, config.mode, config.policy)
    return server, port, core
