"""gRPC plumbing: services declared as method tables over ``dualpath.core.messages`` types, JSON on the wire.

Every client call has a deadline; a peer that is gone surfaces as ``RpcError`` (a ``DualPathError``) naming the
method and the address, never as a hang.

The internal plane is closed to whoever lacks the cluster's credentials (``PlaneAuth``, from the environment every
process of a cluster shares): a cluster token that every call carries and every server checks in constant time,
and, where certificates are provisioned, mutual TLS. A call without them is refused (UNAUTHENTICATED) before any
handler runs, and counted.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import os
import queue
import secrets
import stat
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc

from dualpath.core.errors import ConfigError, DualPathError
from dualpath.core.messages import from_wire, to_wire

log = logging.getLogger(__name__)

KEEPALIVE_ENV = "DUALPATH_RPC_KEEPALIVE_S"
DEFAULT_KEEPALIVE_S = 10.0
TOKEN_ENV, TOKEN_FILE_ENV = "DUALPATH_CLUSTER_TOKEN", "DUALPATH_CLUSTER_TOKEN_FILE"
TLS_ENV = ("DUALPATH_TLS_CERT", "DUALPATH_TLS_KEY", "DUALPATH_TLS_CA")  # PEM files: this process's, and the CA's
TOKEN_HEADER = "x-dualpath-token"


@dataclass(frozen=True)
class PlaneAuth:
    """The credentials of the internal plane: ``token`` (every call carries it, every server checks it) and the PEM
    bytes of mutual TLS (``cert``, ``key`` of this process; ``ca`` that signed every member's). Empty: open."""

    token: str = ""
    cert: bytes = b""
    key: bytes = b""
    ca: bytes = b""

    @classmethod
    def from_env(cls) -> "PlaneAuth":
        """From ``DUALPATH_CLUSTER_TOKEN`` or ``DUALPATH_CLUSTER_TOKEN_FILE`` (a file only its owner may read) and,
        all three or none, ``DUALPATH_TLS_CERT`` / ``_KEY`` / ``_CA``."""
        token = os.environ.get(TOKEN_ENV, "")
        if not token and os.environ.get(TOKEN_FILE_ENV):
            token = _read_secret(os.environ[TOKEN_FILE_ENV], TOKEN_FILE_ENV).decode().strip()
        paths = [os.environ.get(name, "") for name in TLS_ENV]
        if any(paths) and not all(paths):
            raise ConfigError(f"mutual TLS needs all of {', '.join(TLS_ENV)}")
        pem = (
            [
                _read_secret(path, name) if name.endswith("KEY") else Path(path).read_bytes()
                for path, name in zip(paths, TLS_ENV)
            ]
            if all(paths)
            else [b"", b"", b""]
        )
        return cls(token, *pem)

    @property
    def tls(self) -> bool:
        return bool(self.cert)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TOKEN_HEADER, self.token),) if self.token else ()


def _read_secret(path: str, name: str) -> bytes:
    """A secret's file, refused when others than its owner may read it (as ssh refuses such a key)."""
    try:
        mode = os.stat(path).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"{name}: {path} is readable by others (mode {stat.filemode(mode)}); chmod 600 it")
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"{name}: cannot read {path}: {e.strerror}") from None


def ensure_cluster_token() -> None:
    """Give this process (and so every child it starts) a cluster token if its environment names none: a launcher's
    own single-host cluster is then closed with no setup. One token per process: every cluster it starts shares it."""
    if not os.environ.get(TOKEN_ENV) and not os.environ.get(TOKEN_FILE_ENV):
        os.environ[TOKEN_ENV] = secrets.token_urlsafe(32)


class _TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses every call that does not carry the cluster token (compared in constant time), before its handler;
    ``on_refused`` counts it."""

    def __init__(self, service: str, token: str, on_refused: Callable[[], None] | None):
        self.service, self.token, self.on_refused = service, token.encode(), on_refused

    async def intercept_service(self, continuation, details):
        given = dict(details.invocation_metadata or ()).get(TOKEN_HEADER, "")
        if hmac.compare_digest(given.encode() if isinstance(given, str) else given, self.token):
            return await continuation(details)
        if self.on_refused is not None:
            self.on_refused()
        log.warning("%s refused %s: %s cluster token", self.service, details.method, "a wrong" if given else "no")
        return grpc.unary_unary_rpc_method_handler(_deny)  # answers a call of any shape with the status alone


async def _deny(request, ctx):
    await ctx.abort(grpc.StatusCode.UNAUTHENTICATED, "this call needs the cluster's token")


def _options() -> list[tuple[str, int]]:
    """Channel and server options. Keepalive: every connection with calls open is pinged after ``keepalive`` s
    without traffic, and closed if the ping is not answered within as long again, so a peer whose host died or
    froze (no FIN ever comes) fails its streams in ~2 × keepalive s: an idle Session stream would otherwise read as
    open forever, and a request on it wait for its whole timeout. Pings are answered by gRPC's own threads, not
    Python's, so a busy process still answers them. Servers accept pings this often, however many."""
    ms = int(1000 * float(os.environ.get(KEEPALIVE_ENV, DEFAULT_KEEPALIVE_S)))
    return [
        ("grpc.max_send_message_length", 256 << 20),
        ("grpc.max_receive_message_length", 256 << 20),
        ("grpc.so_reuseport", 0),
        # a peer that restarts (the scheduler) is found again within ~2 s, not after gRPC's default backoff
        # (which grows to 120 s between tries)
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", ms),
        ("grpc.http2.max_pings_without_data", 0),  # an idle stream is pinged on, not after 2 pings only
        ("grpc.http2.ping_timeout_ms", ms),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", min(ms, 5000)),
        ("grpc.http2.max_ping_strikes", 0),
    ]


class RpcError(DualPathError):
    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Method:
    request: type
    response: type
    streaming: bool = False  # server streaming
    bidi: bool = False  # a stream each way


class ThreadedServer:
    """A ``grpc.aio`` server on its own event-loop thread, for handlers written as plain methods.

    Plain unary handlers run on a bounded thread pool (they must finish in bounded time); ``async def`` ones run
    on the loop, for calls that wait on I/O; streaming handlers must be async generators and run on the loop, so open streams cost coroutines, never pool threads: a busy engine
    with thousands of open token streams still answers its control calls.
    """

    def __init__(self, service: str, max_workers: int = 32):
        self.service, self.port = service, 0
        self.pool = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=service)
        self.loop = asyncio.new_event_loop()  # exists before ``start``: handlers may bind queues to it
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=f"{service}-rpc")
        self._thread.start()
        self.server = None

    def start(
        self,
        methods: dict[str, Method],
        handler: Any,
        address: str,
        on_refused: Callable[[], None] | None = None,
        auth: PlaneAuth | None = None,
    ) -> int:
        wrapped = _Handlers()
        for name, m in methods.items():
            fn = getattr(handler, name, None)
            if fn is None:
                continue
            if m.streaming or m.bidi:
                if not inspect.isasyncgenfunction(fn):
                    raise TypeError(f"{self.service}.{name} streams: it must be an async generator")
                setattr(wrapped, name, fn)
            elif inspect.iscoroutinefunction(fn):  # awaits what it waits for: holds no pool thread
                setattr(wrapped, name, fn)
            else:
                setattr(wrapped, name, self._in_pool(fn))
        self.server, self.port = asyncio.run_coroutine_threadsafe(
            serve_async(self.service, methods, wrapped, address, auth, on_refused), self.loop
        ).result(30)
        return self.port

    def _in_pool(self, fn):
        async def call(request, ctx):
            return await self.loop.run_in_executor(self.pool, fn, request, ctx)

        return call

    def stop(self, grace: float = 1.0) -> None:
        if self.loop.is_closed():
            return
        try:
            if self.server is not None:
                asyncio.run_coroutine_threadsafe(self.server.stop(grace), self.loop).result(grace + 5)
        except Exception:  # noqa: BLE001 - stopping is best effort
            log.debug("rpc server stop", exc_info=True)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.pool.shutdown(wait=False, cancel_futures=True)


class _Handlers:
    """The attributes ``serve_async`` looks up, set per method."""


async def serve_async(
    service: str,
    methods: dict[str, Method],
    handler: Any,
    address: str = "0.0.0.0:0",
    auth: PlaneAuth | None = None,
    on_refused: Callable[[], None] | None = None,
) -> tuple["grpc.aio.Server", int]:
    """``serve`` for asyncio handlers (``async def`` methods, async generators for streams): thousands of open
    streams cost coroutines, not threads. ``auth`` (default: from the environment) closes it to callers without the
    cluster's credentials; ``on_refused`` is called for each call refused."""
    auth = PlaneAuth.from_env() if auth is None else auth
    table = {}
    for name, m in methods.items():
        fn = getattr(handler, name, None)
        if fn is None:
            continue
        deser = lambda b, c=m.request: from_wire(c, b)  # noqa: E731
        make = (
            grpc.stream_stream_rpc_method_handler
            if m.bidi
            else grpc.unary_stream_rpc_method_handler
            if m.streaming
            else grpc.unary_unary_rpc_method_handler
        )
        table[name] = make(fn, request_deserializer=deser, response_serializer=to_wire)
    check = _TokenCheck(service, auth.token, on_refused) if auth.token else None
    server = grpc.aio.server(options=_options(), interceptors=[check] if check else None)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(f"dualpath.{service}", table)])
    if auth.tls:
        creds = grpc.ssl_server_credentials(
            [(auth.key, auth.cert)], root_certificates=auth.ca, require_client_auth=True
        )
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise DualPathError(f"cannot listen on {address}")
    if not auth.token and not auth.tls:
        log.warning(
            "%s listens on %s with no cluster token: any process that reaches it may call it (set %s)",
            service,
            address,
            TOKEN_ENV,
        )
    await server.start()
    return server, port


class Client:
    """Calls ``service`` at ``address``: ``client.call("Method", request, timeout)``, ``client.stream(...)``, or
    ``client.exchange(...)``: a request and its reply as messages on an open bidi stream."""

    def __init__(self, service: str, methods: dict[str, Method], address: str, auth: PlaneAuth | None = None):
        self.service, self.methods, self.address = service, methods, address
        self.auth = PlaneAuth.from_env() if auth is None else auth
        if self.auth.tls:
            creds = grpc.ssl_channel_credentials(self.auth.ca, self.auth.key, self.auth.cert)
            self.channel = grpc.secure_channel(address, creds, options=_options())
        else:
            self.channel = grpc.insecure_channel(address, options=_options())
        self._stubs: dict[str, Callable] = {}
        for name, m in methods.items():
            make = (
                self.channel.stream_stream
                if m.bidi
                else self.channel.unary_stream
                if m.streaming
                else self.channel.unary_unary
            )
            self._stubs[name] = make(
                f"/dualpath.{service}/{name}",
                request_serializer=to_wire,
                response_deserializer=lambda b, c=m.response: from_wire(c, b),
            )
        self._exchanges: dict[str, _Exchange] = {}
        self._unary_only: set[str] = set()

    def call(self, method: str, request: Any, timeout: float = 30.0) -> Any:
        try:
            return self._stubs[method](request, timeout=timeout, metadata=self.auth.metadata)
        except grpc.RpcError as e:
            raise RpcError(
                f"{self.service}.{method} at {self.address} failed: {e.code().name}: {e.details()}", e.code()
            ) from None

    def stream(self, method: str, request: Any, timeout: float | None = None) -> Iterator[Any]:
        """Iterate a server stream (or, for a bidi method, pass an iterator of requests); ``cancel()`` on the
        returned iterator stops it."""
        return _Stream(
            self._stubs[method](request, timeout=timeout, metadata=self.auth.metadata),
            f"{self.service}.{method} at {self.address}",
        )

    def exchange(self, method: str, request: Any, timeout: float, unary: str = "") -> Any:
        """``request``'s reply, both sent as messages on one open ``method`` stream (a bidi method that answers each
        request with one reply, in order), opened at the first call and again after it breaks: a call often made
        (an engine group's pull, every 20 ms) costs no call setup, metadata or credential check each time. A server
        that lacks ``method`` (an older version) is called with ``unary`` instead, from then on. One caller at a time."""
        if method in self._unary_only:
            return self.call(unary, request, timeout)
        ex = self._exchanges.get(method)
        if ex is None or ex.broken:
            if ex is not None:
                ex.close()
            ex = self._exchanges[method] = _Exchange(
                self._stubs[method], self.auth.metadata, f"{self.service}.{method} at {self.address}"
            )
        try:
            return ex.ask(request, timeout)
        except RpcError as e:
            ex.close()
            self._exchanges.pop(method, None)
            if e.code != grpc.StatusCode.UNIMPLEMENTED or not unary:
                raise
        self._unary_only.add(method)
        log.info("%s at %s has no %s: calling %s", self.service, self.address, method, unary)
        return self.call(unary, request, timeout)

    def wait_ready(self, timeout: float) -> None:
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise RpcError(f"{self.service} at {self.address} not reachable within {timeout} s") from None

    def close(self) -> None:
        for ex in self._exchanges.values():
            ex.close()
        self.channel.close()


_END = object()


class _Exchange:
    """One open bidi call used for request-reply pairs (``Client.exchange``). gRPC's thread sends what ``ask`` queues;
    a reader thread queues the replies, or the error that ended the call (then ``broken``). A reply that missed its
    deadline would answer the next request, so the client closes an exchange after any error and opens another."""

    def __init__(self, stub, metadata, what: str):
        self.what, self.broken = what, False
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._call = stub(iter(self._requests.get, _END), metadata=metadata)
        threading.Thread(target=self._read, daemon=True, name="rpc-exchange").start()

    def _read(self) -> None:
        try:
            for reply in self._call:
                self._replies.put(reply)
            ended = RpcError(f"{self.what} ended")
        except grpc.RpcError as e:
            ended = RpcError(f"{self.what} failed: {e.code().name}: {e.details()}", e.code())
        self.broken = True
        self._replies.put(ended)

    def ask(self, request: Any, timeout: float) -> Any:
        self._requests.put(request)
        try:
            got = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise RpcError(f"{self.what}: no reply within {timeout} s", grpc.StatusCode.DEADLINE_EXCEEDED) from None
        if isinstance(got, RpcError):
            raise got
        return got

    def close(self) -> None:
        self.broken = True
        self._requests.put(_END)
        self._call.cancel()


class _Stream:
    def __init__(self, call, what: str):
        self.call, self.what = call, what

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.call)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED:
                raise StopIteration from None
            raise RpcError(f"{self.what} failed: {e.code().name}: {e.details()}", e.code()) from None

    def cancel(self) -> None:
        self.call.cancel()


# --- the two services ----------------------------------------------------------------------------------------
def _methods():
    from dualpath.core import messages as m

    scheduler = {
        "Register": Method(m.EngineInfo, m.RegisterReply),
        "Pull": Method(m.PullRequest, m.PullReply),
        "PullStream": Method(m.PullRequest, m.PullReply, bidi=True),  # Pull's requests and replies on one stream
        "Report": Method(m.EngineLoad, m.Ack),
        "Submit": Method(m.SubmitRequest, m.SubmitEvent, streaming=True),
        "Session": Method(m.SessionIn, m.SessionOut, bidi=True),
        "Cancel": Method(m.RequestRef, m.Ack),
        "Stats": Method(m.RequestRef, m.Stats),
        "UpdateWeights": Method(m.WeightUpdate, m.WeightUpdateReply),
        "LoadAdapter": Method(m.AdapterLoad, m.AdapterLoadReply),
        "Hold": Method(m.Hold, m.HoldReply),
        "FlushCache": Method(m.RequestRef, m.Ack),
        "Abort": Method(m.Abort, m.AbortReply),
    }
    engine = {
        "Health": Method(m.RequestRef, m.Ack),
        "Assign": Method(m.PullReply, m.Ack),
        "PushLoad": Method(m.EngineLoad, m.Ack),
        "Prepare": Method(m.PrepareRequest, m.PrepareReply),
        "PrefillDone": Method(m.PrefillDone, m.Ack),
        "Release": Method(m.RequestRef, m.Ack),
        "Stream": Method(m.RequestRef, m.TokenEvent, streaming=True),
        "Cancel": Method(m.RequestRef, m.Ack),
        "UpdateWeights": Method(m.WeightUpdate, m.WeightUpdateReply),
        "LoadAdapter": Method(m.AdapterLoad, m.AdapterLoadReply),
    }
    return scheduler, engine


SCHEDULER_METHODS, ENGINE_METHODS = _methods()
