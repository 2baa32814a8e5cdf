"""Real engines (tiny model, CPU, shm transport, real files) in this process, reporting to a real ``SchedulerCore``
in this process: the engines' scheduler client is swapped for ``CoreLink``, which hands each call's message to
the core through its wire encoding (no sockets, no scheduler process), so a test decides when each engine pulls
and can look at what it reports at that moment.

``hold_reads`` keeps a store's I/O thread busy, so the reads queued behind it wait (a node whose storage is
saturated) until the test lets them go."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from dualpath.core.config import KVEventsConfig, SchedulerConfig, StorageConfig
from dualpath.core.geometry import block_hashes
from dualpath.core.messages import Ack, EngineLoad, SubmitRequest, from_wire, pack_tokens, to_wire
from dualpath.core.sampling_params import SamplingParams
from dualpath.scheduler.core import SchedulerCore
from dualpath.scheduler.policies import make_policy
from engine_doubles import engine_config


class CoreLink:
    """An engine's scheduler client whose calls go straight to an in-process core (each message encoded and decoded
    as on the wire)."""

    def __init__(self, core: SchedulerCore):
        self.core = core

    def call(self, method: str, request, timeout: float = 30.0):
        request = from_wire(type(request), to_wire(request))
        if method == "Register":
            return self.core.register(request)
        if method == "Pull":
            reply = self.core.pull(request.group_id, request.loads, request.sender, request.unreachable)
            return from_wire(type(reply), to_wire(reply))
        if method == "Report":
            self.core.report(request)
            return Ack()
        raise NotImplementedError(method)

    def exchange(self, method: str, request, timeout: float, unary: str = ""):
        assert method == "PullStream"
        return self.call("Pull", request, timeout)


@dataclass(frozen=True)
class EngineSpec:
    role: str  # "prefill" or "decode"
    engine_id: str
    node_id: str
    capacity_bytes: int = 0  # its store's cap (0: none)
    read_bps: float = 0.0  # its node's storage read rate, capped (0: no cap)
    kv_events: KVEventsConfig = KVEventsConfig()  # its KV events (off)


@contextmanager
def engines_on_core(model, tmp_path, block_size: int, specs: list[EngineSpec], policy: str = "dualpath", setup=None):
    """``(core, {engine id: engine})``: the engines built, ``setup(engines)`` run (write stored blocks there: the
    core's index is rebuilt from the store when the first engine registers), then every engine registered. Engines
    pull only when the test says (``engine._pull()``); their loops run only if the test starts them. Stopped after."""
    from dualpath.engines.decode import DecodeEngine
    from dualpath.engines.prefill import PrefillEngine

    kv = tmp_path / "kv"
    core = SchedulerCore(SchedulerConfig(kv_store=str(kv), policy=policy, heartbeat_timeout_s=1e9), make_policy(policy))
    engines = {}
    try:
        for s in specs:
            cls = PrefillEngine if s.role == "prefill" else DecodeEngine
            cfg = engine_config(
                s.role,
                model,
                tmp_path,
                block_size,
                engine_id=s.engine_id,
                node_id=s.node_id,
                alpha_tokens=1 << 20,  # pinned: no start-up read probe, and Algorithm 1 never counts a node slow
                kv_events=s.kv_events,
                storage=StorageConfig(
                    root=str(kv), io_threads=1, capacity_bytes=s.capacity_bytes, read_bandwidth_bps=s.read_bps
                ),
            )
            engines[s.engine_id] = e = cls(cfg)
            e.scheduler.channel.close()
            e.scheduler = CoreLink(core)
        if setup is not None:
            setup(engines)
        for e in engines.values():
            e.register()
        core.index_rebuild.join(30)
        yield core, engines
    finally:
        for e in engines.values():
            e.stopping.set()
        for e in engines.values():
            e.stop()


def store_prefix(engine, tokens: list[int], blocks: int) -> list[bytes]:
    """Write the first ``blocks`` full blocks of ``tokens`` to ``engine``'s store (zeroed KV, valid files), as an
    earlier turn would have; their keys."""
    g = engine.geometry
    keys = block_hashes(tokens, engine.fingerprint, g.block_size)[:blocks]
    results = engine.storage.write(keys, [torch.zeros(g.full_block_bytes, dtype=torch.uint8) for _ in keys]).result()
    assert results == [None] * len(keys), results
    return keys


def submit(core: SchedulerCore, request_id: str, tokens: list[int], max_tokens: int = 4, mode: str = "") -> list:
    """Submit a greedy request; the events the core sends about it (a list that grows)."""
    events: list = []
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    core.submit(SubmitRequest(request_id, pack_tokens(tokens), params.to_dict(), mode=mode), events.append)
    return events


def current_load(engine) -> EngineLoad:
    """The load report ``engine`` would send now (what it has to deliver stays in its outbox)."""
    load, marks = engine.load()
    engine.outbox.put_back(marks["items"])
    return load


@contextmanager
def hold_reads(*engines):
    """Every read of these engines' stores waits until the block exits: each store's single I/O thread is kept
    busy (the engines' stores have ``io_threads=1``)."""
    gate, busy = threading.Event(), []
    for e in engines:
        started = threading.Event()
        e.storage._pool.submit(lambda s=started: (s.set(), gate.wait(60)))
        busy.append(started)
    try:
        assert all(s.wait(10) for s in busy)
        yield
    finally:
        gate.set()


@contextmanager
def running(*engines):
    """The engines' loops, pull loops and reporters on threads (as ``Engine.run`` starts them), until the block
    exits."""
    threads = [
        threading.Thread(target=fn, daemon=True, name=f"{e.engine_id}-{fn.__name__}")
        for e in engines
        for fn in (e.loop, e.pull_loop, e._reporter)
    ]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        for e in engines:
            e.stopping.set()
        for t in threads:
            t.join(30)


def wait_for(check, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what or check}"
        time.sleep(0.01)
