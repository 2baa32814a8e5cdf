"""The transport contract: one-sided READ and WRITE of byte segments between registered regions.

A region is registered once and described to peers by a ``RegionDesc`` (exchanged at handshake). A batch of
``Segment``s is submitted with a priority class and returns a ``TransferHandle`` to wait on or poll. Per peer
and class there is one lane (a worker thread, and in backends that have them, its own connection or queue
pair); low-priority segments are cut into ``chunk_bytes`` pieces and pause between pieces while any
high-priority transfer is in flight, so a control-sized transfer never waits behind a bulk KV stream for more
than one piece.

Who calls it: the traffic manager (and tests). What a backend may not do: interpret the bytes, copy outside
the validated segments, or block ``submit``; a backend that cannot honour a call raises, it never pretends.
"""

from __future__ import annotations

import enum
import itertools
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from dualpath.core.config import TransportConfig
from dualpath.core.errors import SegmentError, TransferTimeoutError, TransportError
from dualpath.traffic.memory import HostMemory, as_bytes

log = logging.getLogger(__name__)

PEER_CHECK_INTERVAL_S = 0.02  # how stale a lane's knowledge of its peer's liveness may be


class Op(str, enum.Enum):
    READ = "read"  # remote -> local
    WRITE = "write"  # local -> remote


class Priority(enum.IntEnum):
    HIGH = 0  # model and control traffic
    LOW = 1  # KV traffic


@dataclass(frozen=True)
class Segment:
    local_region: int
    local_offset: int
    remote_region: int
    remote_offset: int
    nbytes: int


@dataclass(frozen=True)
class RegionDesc:
    """What a peer needs to address one of our regions. JSON-able via ``to_dict``."""

    owner: str
    region_id: int
    nbytes: int
    address: int
    device: str = "cpu"
    shm_name: str | None = None
    extra: dict = field(default_factory=dict)  # backend specifics (rkeys, ...)

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict) -> "RegionDesc":
        return cls(**d)


@dataclass
class Region:
    region_id: int
    tensor: torch.Tensor  # flat uint8 view of the memory
    memory: HostMemory | None  # set when the memory is host memory we can describe by name

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()


class TransferHandle:
    """Completion of one submitted batch. ``wait`` raises the transfer's error, if any."""

    def __init__(self, nbytes: int, priority: Priority):
        self.nbytes, self.priority = nbytes, priority
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._callbacks: list = []
        self._cb_lock = threading.Lock()
        self.submitted_at = time.perf_counter()
        self.finished_at: float | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._event.wait(timeout):
            raise TransferTimeoutError(f"transfer of {self.nbytes} bytes not done after {timeout} s")
        if self._error is not None:
            raise self._error

    def add_done_callback(self, fn) -> None:
        """Call ``fn()`` once the transfer ends (at once if it has); it runs in the transport's lane thread."""
        with self._cb_lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self.finished_at = time.perf_counter()
        with self._cb_lock:
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()


@dataclass
class _Job:
    op: Op
    segments: list[Segment]
    handle: TransferHandle


class _HighGate:
    """Counts in-flight high-priority jobs of a transport; low-priority pieces wait while any is in flight."""

    def __init__(self):
        self._active = 0
        self._cond = threading.Condition()

    def enter(self):
        with self._cond:
            self._active += 1

    def leave(self):
        with self._cond:
            self._active -= 1
            if self._active == 0:
                self._cond.notify_all()

    def wait_idle(self, timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._active == 0, timeout)


class _Lane(threading.Thread):
    """Executes one peer's jobs of one priority class in order."""

    def __init__(self, transport: "Transport", peer: str, priority: Priority, conn: Any):
        super().__init__(name=f"lane-{transport.name}-{peer}-{priority.name.lower()}", daemon=True)
        self.transport, self.peer, self.priority, self.conn = transport, peer, priority, conn
        self.jobs: queue.Queue[_Job | None] = queue.Queue()

    def run(self) -> None:
        t = self.transport
        last_check = 0.0
        while (job := self.jobs.get()) is not None:
            try:
                for piece in self._pieces(job.segments):
                    if self.priority is Priority.LOW:
                        t._gate.wait_idle(t.config.op_timeout_s)
                    now = time.monotonic()
                    if now - last_check > PEER_CHECK_INTERVAL_S:  # a liveness probe may cost a syscall or two
                        t._check_peer(self.peer, self.conn)
                        last_check = now
                    t._execute(self.conn, job.op, piece)
                job.handle._finish()
            except BaseException as e:  # noqa: BLE001 - the error belongs to the waiter
                if not isinstance(e, TransportError):
                    e = TransportError(f"{t.name} transfer to {self.peer} failed: {e!r}")
                job.handle._finish(e)
            finally:
                if self.priority is Priority.HIGH:
                    t._gate.leave()

    def _pieces(self, segments: list[Segment]):
        """Batches of at most ``chunk_bytes`` (low priority) — one batch for high priority."""
        if self.priority is Priority.HIGH:
            yield segments
            return
        limit, batch, size = self.transport.config.chunk_bytes, [], 0
        for s in segments:
            off = 0
            while off < s.nbytes:
                n = min(s.nbytes - off, limit - size)
                batch.append(Segment(s.local_region, s.local_offset + off, s.remote_region, s.remote_offset + off, n))
                size, off = size + n, off + n
                if size == limit:
                    yield batch
                    batch, size = [], 0
        if batch:
            yield batch


class Transport(ABC):
    """Base of every backend: regions, peers, validation, lanes and priority. Backends implement the raw
    data path (``_connect``, ``_execute``) and how peers reach them (``address``)."""

    name = "base"
    remote_needs_shared_memory = False  # peers can only address regions backed by named shared memory

    def __init__(self, config: TransportConfig, endpoint: str):
        self.config = config
        self.endpoint = endpoint  # our name among peers
        self._regions: dict[int, Region] = {}
        self._ids = itertools.count(1)
        self._peer_regions: dict[str, dict[int, RegionDesc]] = {}
        self._peer_address: dict[str, dict] = {}
        self._lanes: dict[tuple[str, Priority], _Lane] = {}
        self._gate = _HighGate()
        self._lock = threading.RLock()
        self._closed = False

    # --- backend hooks --------------------------------------------------------------------------------------
    @abstractmethod
    def address(self) -> dict:
        """How peers reach this endpoint (JSON-able)."""

    @abstractmethod
    def _connect(self, peer: str, address: dict, priority: Priority) -> Any:
        """Open what a lane to ``peer`` of class ``priority`` needs (a connection, an endpoint, mappings)."""

    @abstractmethod
    def _execute(self, conn: Any, op: Op, segments: list[Segment]) -> None:
        """Move ``segments`` synchronously (already validated, already at most one chunk). Raise on failure."""

    def _check_peer(self, peer: str, conn: Any) -> None:
        """Raise ``PeerDeadError`` if the peer is known to be gone. Called before every piece."""

    def _describe(self, region: Region) -> dict:
        """Backend specifics for a region's descriptor (rkeys, registration handles)."""
        return {}

    def _close_backend(self) -> None:
        """Release backend resources; lanes are already stopped."""

    # --- memory ---------------------------------------------------------------------------------------------
    def allocate(self, nbytes: int, pin: bool = True) -> HostMemory:
        """Host memory suitable as a remotely addressed region for this backend (page-locked where CUDA is)."""
        return HostMemory(nbytes, shared=self.remote_needs_shared_memory, pin=pin)

    def register(self, memory: HostMemory | torch.Tensor) -> RegionDesc:
        """Register host memory or a contiguous tensor (host or device) once; returns its descriptor."""
        if isinstance(memory, HostMemory):
            region = Region(next(self._ids), memory.tensor, memory)
        else:
            region = Region(next(self._ids), as_bytes(memory), None)
        self._regions[region.region_id] = region
        return self.describe(region.region_id)

    def describe(self, region_id: int) -> RegionDesc:
        r = self._regions[region_id]
        mem = r.memory
        return RegionDesc(
            self.endpoint,
            r.region_id,
            r.nbytes,
            r.tensor.data_ptr(),
            str(r.tensor.device),
            mem.name if mem is not None else None,
            self._describe(r),
        )

    def regions(self) -> list[RegionDesc]:
        return [self.describe(i) for i in self._regions]

    def local_tensor(self, region_id: int) -> torch.Tensor:
        return self._regions[region_id].tensor

    # --- peers ----------------------------------------------------------------------------------------------
    def add_peer(self, peer: str, address: dict, regions: list[RegionDesc]) -> None:
        """Learn a peer's address and regions (from its handshake). Lanes connect lazily on first use. A known peer
        at a new address (a restarted engine under its old name) is forgotten first: its lanes and mappings name
        the old process."""
        with self._lock:
            moved = self._peer_address.get(peer, address) != address
        if moved:
            self.remove_peer(peer)
        with self._lock:
            self._peer_address[peer] = address
            self._peer_regions[peer] = {r.region_id: r for r in regions}

    def update_peer_regions(self, peer: str, regions: list[RegionDesc]) -> None:
        with self._lock:
            self._peer_regions.setdefault(peer, {}).update({r.region_id: r for r in regions})

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            self._peer_address.pop(peer, None)
            self._peer_regions.pop(peer, None)
            lanes = [self._lanes.pop(k) for k in list(self._lanes) if k[0] == peer]
        for lane in lanes:
            lane.jobs.put(None)

    # --- transfers ------------------------------------------------------------------------------------------
    def submit(self, peer: str, op: Op, segments: list[Segment], priority: Priority = Priority.LOW) -> TransferHandle:
        """Queue a batch of one-sided transfers to ``peer``. Bad segments raise ``SegmentError`` here."""
        if self._closed:
            raise TransportError(f"{self.name} transport is closed")
        self._validate(peer, segments)
        handle = TransferHandle(sum(s.nbytes for s in segments), priority)
        if not segments:
            handle._finish()
            return handle
        lane = self._lane(peer, priority)
        if priority is Priority.HIGH:
            self._gate.enter()
        lane.jobs.put(_Job(op, list(segments), handle))
        return handle

    def _lane(self, peer: str, priority: Priority) -> _Lane:
        with self._lock:
            lane = self._lanes.get((peer, priority))
            if lane is None:
                conn = self._connect(peer, self._peer_address[peer], priority)
                lane = self._lanes[(peer, priority)] = _Lane(self, peer, priority, conn)
                lane.start()
            return lane

    def _validate(self, peer: str, segments: list[Segment]) -> None:
        remote = self._peer_regions.get(peer)
        if remote is None:
            raise SegmentError(f"unknown peer {peer!r}")
        for s in segments:
            if s.nbytes <= 0:
                raise SegmentError(f"segment of {s.nbytes} bytes")
            local = self._regions.get(s.local_region)
            if local is None:
                raise SegmentError(f"local region {s.local_region} is not registered")
            if s.local_offset < 0 or s.local_offset + s.nbytes > local.nbytes:
                raise SegmentError(
                    f"local [{s.local_offset}, +{s.nbytes}) outside region {s.local_region} of {local.nbytes} bytes"
                )
            desc = remote.get(s.remote_region)
            if desc is None:
                raise SegmentError(f"region {s.remote_region} of {peer} is not registered")
            if s.remote_offset < 0 or s.remote_offset + s.nbytes > desc.nbytes:
                raise SegmentError(
                    f"remote [{s.remote_offset}, +{s.nbytes}) outside region {s.remote_region} "
                    f"of {peer} ({desc.nbytes} bytes)"
                )
            if self.remote_needs_shared_memory and desc.shm_name is None:
                raise SegmentError(f"region {s.remote_region} of {peer} is not in shared memory")

    def remote_desc(self, peer: str, region_id: int) -> RegionDesc:
        return self._peer_regions[peer][region_id]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            lanes = list(self._lanes.values())
            self._lanes.clear()
        for lane in lanes:
            lane.jobs.put(None)
        for lane in lanes:
            lane.join(timeout=self.config.op_timeout_s)
        self._close_backend()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy between flat uint8 tensors on any devices; returns when the bytes have landed."""
    dst.copy_(src)
