"""The engine RPC server: open token streams never starve control calls; the stream hub delivers in order; pulls
ride one open stream."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from dualpath.core.messages import Ack, PullReply, PullRequest, RequestRef, TokenEvent
from dualpath.core.rpc import ENGINE_METHODS, SCHEDULER_METHODS, Client, RpcError, ThreadedServer
from dualpath.engines.streams import StreamHub


class _Handler:
    """A test double for an engine: ``Health`` answers, ``Stream`` waits on the hub."""

    def __init__(self, hub_loop):
        self.hub = StreamHub(hub_loop, ttl_s=0.2)

    def Health(self, ref: RequestRef, ctx) -> Ack:
        return Ack(True, ref.request_id)

    async def Stream(self, ref: RequestRef, ctx):
        async for ev in self.hub.events(ref.request_id):
            yield ev


@pytest.fixture()
def served():
    server = ThreadedServer("Engine", max_workers=4)
    handler = _Handler(server.loop)
    server.start(ENGINE_METHODS, handler, "127.0.0.1:0")
    client = Client("Engine", ENGINE_METHODS, f"127.0.0.1:{server.port}")
    yield server, handler, client
    client.close()
    server.stop(grace=0)


def test_open_streams_do_not_starve_unary_calls(served):
    server, handler, client = served
    streams = [client.stream("Stream", RequestRef(f"w{i}"), timeout=30) for i in range(64)]  # 16x the pool
    got: dict[int, list[int]] = {}

    def drain(i):
        got[i] = [ev.token_id for ev in streams[i] if not ev.finish_reason]

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    assert client.call("Health", RequestRef("ping"), timeout=5).error == "ping"
    for i in range(64):
        for tok in (1, 2, 3):
            handler.hub.put(f"w{i}", TokenEvent(f"w{i}", tok))
        handler.hub.put(f"w{i}", TokenEvent(f"w{i}", finish_reason="length"))
    for t in threads:
        t.join(10)
    assert got == {i: [1, 2, 3] for i in range(64)}


def test_events_before_the_submitter_arrives_wait_then_expire(served):
    server, handler, client = served
    handler.hub.put("early", TokenEvent("early", 7))
    handler.hub.put("early", TokenEvent("early", finish_reason="stop"))
    assert [ev.token_id for ev in client.stream("Stream", RequestRef("early"), timeout=5)][:1] == [7]
    handler.hub.put("late", TokenEvent("late", finish_reason="stop"))
    deadline = asyncio.run_coroutine_threadsafe(asyncio.sleep(1.0), server.loop)  # past the TTL and a sweep
    deadline.result(10)
    assert asyncio.run_coroutine_threadsafe(_count(handler.hub), server.loop).result(5) == 0


async def _count(hub: StreamHub) -> int:
    return hub.open_streams()


def test_a_sync_streaming_handler_is_refused():
    class Bad:
        def Stream(self, ref, ctx):
            yield TokenEvent(ref.request_id)

    server = ThreadedServer("Engine", max_workers=1)
    try:
        with pytest.raises(TypeError, match="async generator"):
            server.start(ENGINE_METHODS, Bad(), "127.0.0.1:0")
    finally:
        server.stop(grace=0)


def test_a_stopping_scheduler_ends_its_open_sessions_normally(capfd):
    """A scheduler told to stop (SIGTERM: a rolling upgrade, ``dualpath serve`` shutting down) ends every open
    Session stream itself, at once: the submitter's session reads as ended (it submits again to the next scheduler),
    and no handler is left for the server's grace period (1 s) to cut, which gRPC logs as an unhandled error."""
    import queue

    from dualpath import SamplingParams
    from dualpath.client import ClusterClient, OverloadedError
    from dualpath.core.config import SchedulerConfig
    from dualpath.scheduler.service import run_scheduler_async

    loop, stop, ports = asyncio.new_event_loop(), asyncio.Event(), queue.Queue()
    cfg = SchedulerConfig(host="127.0.0.1", heartbeat_timeout_s=60.0)
    runner = threading.Thread(
        target=loop.run_until_complete,
        daemon=True,
        args=(run_scheduler_async(cfg, lambda port, http: ports.put(port), stop),),
    )
    runner.start()
    client = ClusterClient(f"127.0.0.1:{ports.get(timeout=30)}")
    with pytest.raises(OverloadedError):  # a round trip on the session (no engines yet: refused), so it is open
        list(client.stream([5, 6, 7], SamplingParams(max_tokens=1)))
    session = client.session()  # the same one, nothing in it now: its handler waits until told otherwise
    assert session.alive
    capfd.readouterr()
    asked = time.monotonic()
    loop.call_soon_threadsafe(stop.set)
    runner.join(30)
    assert not runner.is_alive(), "the scheduler did not stop"
    while session.alive and time.monotonic() < asked + 10:
        time.sleep(0.005)
    took = time.monotonic() - asked
    assert not session.alive
    assert took < 0.5, f"the session was cut by the grace period after {took:.2f} s, not ended"  # ends in ~2 ms
    assert "Traceback" not in capfd.readouterr().err
    client.close()
    loop.close()


def test_a_scheduler_that_froze_ends_its_sessions_within_two_keepalives(monkeypatch, tmp_path):
    """A scheduler whose host died or froze sends no FIN: only keepalive pings find it. SIGSTOP freezes one (its
    kernel still acknowledges TCP, its gRPC threads answer no ping); the client's idle session must read as ended
    within ~2 keepalive periods (without pings: never), so its requests are submitted again or fail, never wait out
    their timeout."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    from dualpath import SamplingParams
    from dualpath.client import ClusterClient, OverloadedError
    from dualpath.core.errors import DualPathError
    from dualpath.core.rpc import KEEPALIVE_ENV

    monkeypatch.setenv(KEEPALIVE_ENV, "0.5")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dualpath.cli",
            "scheduler",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--http-port",
            "-1",
        ],
        env={**os.environ},
        cwd=tmp_path,
    )
    client = ClusterClient(f"127.0.0.1:{port}", timeout=600, reconnect_s=0.5)
    try:
        deadline = time.monotonic() + 60
        while True:  # a round trip (no engines: refused), so the session is open on the server
            try:
                list(client.stream([5, 6, 7], SamplingParams(max_tokens=1)))
            except OverloadedError:
                break
            except DualPathError:
                assert time.monotonic() < deadline and proc.poll() is None, "the scheduler did not start"
                time.sleep(0.2)
        session = client.session()
        assert session.alive
        proc.send_signal(signal.SIGSTOP)
        frozen = time.monotonic()
        while session.alive and time.monotonic() < frozen + 15:
            time.sleep(0.05)
        took = time.monotonic() - frozen
        assert not session.alive, "the session to a frozen scheduler still reads as open after 15 s"
        assert took < 5, took  # 2 × 0.5 s, plus a ping's schedule (its requests are then submitted again)
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        proc.wait(30)
        client.close()


class _Puller:
    """A test double for a scheduler: answers each pull with its group id; ``slow`` ones late; counts streams."""

    def __init__(self, streaming: bool = True):
        self.streams, self.unary = 0, 0
        if not streaming:  # an older scheduler: no PullStream
            self.PullStream = None

    async def Pull(self, req, ctx):
        self.unary += 1
        return PullReply({}, cancelled=[req.group_id])

    async def PullStream(self, requests, ctx):
        self.streams += 1
        async for req in requests:
            if req.group_id == "slow":
                await asyncio.sleep(1.0)
            yield PullReply({}, cancelled=[req.group_id])


def _pulls(handler):
    server = ThreadedServer("Scheduler", max_workers=2)
    server.start(SCHEDULER_METHODS, handler, "127.0.0.1:0")
    return server, Client("Scheduler", SCHEDULER_METHODS, f"127.0.0.1:{server.port}")


def test_exchanges_ride_one_stream_and_a_late_reply_never_answers_the_next_request():
    handler = _Puller()
    server, client = _pulls(handler)
    try:
        for i in range(20):
            assert client.exchange("PullStream", PullRequest(f"g{i}", []), 5, unary="Pull").cancelled == [f"g{i}"]
        assert (handler.streams, handler.unary) == (1, 0)
        t0 = time.monotonic()
        with pytest.raises(RpcError, match="no reply within"):
            client.exchange("PullStream", PullRequest("slow", []), 0.3)
        assert time.monotonic() - t0 < 1.0
        # the slow reply still comes, on the stream the timeout gave up: the next request has its own answer
        assert client.exchange("PullStream", PullRequest("next", []), 5).cancelled == ["next"]
        assert handler.streams == 2
        server.stop(grace=0)
        with pytest.raises(RpcError, match="PullStream"):  # a scheduler gone: an error within the deadline, no hang
            client.exchange("PullStream", PullRequest("gone", []), 2)
    finally:
        client.close()
        server.stop(grace=0)


def test_a_scheduler_without_pull_streams_is_pulled_from_by_unary_calls():
    handler = _Puller(streaming=False)
    server, client = _pulls(handler)
    try:
        for i in range(3):
            assert client.exchange("PullStream", PullRequest(f"g{i}", []), 5, unary="Pull").cancelled == [f"g{i}"]
        assert (handler.streams, handler.unary) == (0, 3)
        with pytest.raises(RpcError, match="UNIMPLEMENTED"):  # no unary fallback named: the error stands
            Client("Scheduler", SCHEDULER_METHODS, f"127.0.0.1:{server.port}").exchange(
                "PullStream", PullRequest("g", []), 5
            )
    finally:
        client.close()
        server.stop(grace=0)
