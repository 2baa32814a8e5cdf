"""The traffic manager: one per engine, it moves KV between storage, the engine's DRAM buffer, its device memory
and peer engines' buffers, and counts every byte by path and class.

Who calls it: the engine (prefill: load hit blocks, per-layer reads and writes through a ``LayerPipeline``;
decode: load, receive, persist filled blocks). What it may not do: decide what to move (the engine and the
scheduler do) or interpret KV beyond the block geometry.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from dualpath.core.errors import DualPathError, TransferTimeoutError
from dualpath.core.geometry import BlockHash, BlockLayout, KVGeometry
from dualpath.traffic.buffer import BufferPool
from dualpath.traffic.planner import plan_segments
from dualpath.traffic.prefetch import Prefetcher
from dualpath.traffic.storage.base import Results, StorageBackend
from dualpath.traffic.transport.base import Op, Priority, Transport


class Waitable(Protocol):
    def wait(self, timeout: float | None = None) -> None: ...

    def add_done_callback(self, fn: Callable[[], None]) -> None: ...


class FutureHandle:
    """A storage future seen as a transfer handle: ``wait`` raises the first per-key error."""

    def __init__(self, future: "Future[Results]"):
        self.future = future

    def wait(self, timeout: float | None = None) -> None:
        try:
            results = self.future.result(timeout)
        except TimeoutError:
            raise TransferTimeoutError(f"storage operation not done after {timeout} s") from None
        errors = [e for e in results if e is not None]
        if errors:
            raise errors[0]

    def done(self) -> bool:
        return self.future.done()

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        self.future.add_done_callback(lambda _: fn())


class Counted:
    """A handle that adds its bytes to a counter once it completes."""

    def __init__(self, inner: Waitable, on_done: Callable[[], None]):
        self.inner, self._on_done, self._counted = inner, on_done, False

    def wait(self, timeout: float | None = None) -> None:
        self.inner.wait(timeout)
        if not self._counted:
            self._counted = True
            self._on_done()

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        self.inner.add_done_callback(fn)


@dataclass(frozen=True)
class PeerRegion:
    """A peer's region and how blocks are laid out in it."""

    peer: str
    region_id: int
    layout: BlockLayout


class TrafficManager:
    def __init__(
        self,
        geometry: KVGeometry,
        storage: StorageBackend,
        buffer: BufferPool,
        transport: Transport,
        buffer_region: int,
    ):
        self.geometry, self.storage, self.buffer, self.transport = geometry, storage, buffer, transport
        self.buffer_region = buffer_region
        self.bytes = Counter()  # (path, class) -> bytes; paths: storage_read, storage_write, peer_read, ...
        self._lock = threading.Lock()
        self.prefetcher: Prefetcher | None = None  # set by an engine that takes prefetch orders

    def count(self, path: str, nbytes: int, klass: str = "kv") -> None:
        with self._lock:
            self.bytes[(path, klass)] += nbytes

    # --- storage --------------------------------------------------------------------------------------------
    def load(self, keys: Sequence[BlockHash], slots: Sequence[int], path: str = "storage_read") -> "Future[Results]":
        """Read hit blocks into buffer ``slots`` (all layers): prefetched ones from the buffer, the rest from
        storage. Per-key results."""
        rest = self._unprefetched(keys, slots)
        dests = [self.buffer.slot_bytes(slots[i]) for i in rest]
        fut = self.storage.read([keys[i] for i in rest], dests) if rest else _done([])
        fb = self.geometry.full_block_bytes
        fut.add_done_callback(lambda f: self.count(path, fb * sum(e is None for e in f.result())))
        return _spread(fut, rest, len(keys))

    def load_layers(self, keys: Sequence[BlockHash], slots: Sequence[int]) -> list["Future[Results]"]:
        """Read hit blocks layer by layer (layer 0 of every block first), so a layerwise prefill can compute
        layer l while layer l+1 is still being read; prefetched blocks come from the buffer at once. One future of
        per-key results per layer."""
        lb = self.geometry.layer_block_bytes
        rest = self._unprefetched(keys, slots)
        futures = []
        for layer in range(self.geometry.num_layers):
            dests = [self.buffer.slot_bytes(slots[i])[layer * lb : (layer + 1) * lb] for i in rest]
            fut = self.storage.read([keys[i] for i in rest], dests, layers=(layer, layer + 1)) if rest else _done([])
            fut.add_done_callback(lambda f: self.count("storage_read", lb * sum(e is None for e in f.result())))
            futures.append(_spread(fut, rest, len(keys)))
        return futures

    def _unprefetched(self, keys: Sequence[BlockHash], slots: Sequence[int]) -> list[int]:
        """Copy the prefetched ones of ``keys`` into their ``slots``; the indices of the others."""
        if self.prefetcher is None:
            return list(range(len(keys)))
        served = self.prefetcher.served(keys, [self.buffer.slot_bytes(s) for s in slots])
        self.count("prefetch_hit", self.geometry.full_block_bytes * sum(served))
        return [i for i, hit in enumerate(served) if not hit]

    def prefetch(self, keys: Sequence[BlockHash], hold_s: float) -> None:
        """Read a session's stored blocks into spare buffer slots for its next turn (``Prefetcher``)."""
        if self.prefetcher is not None:
            self.prefetcher.order(keys, hold_s)

    def store(self, keys: Sequence[BlockHash], blocks: Sequence[torch.Tensor]) -> "Future[Results]":
        """Write Full Blocks (host uint8 tensors, e.g. buffer slots) to storage."""
        fut = self.storage.write(keys, blocks)
        fb = self.geometry.full_block_bytes
        fut.add_done_callback(lambda f: self.count("storage_write", fb * sum(e is None for e in f.result())))
        return fut

    # --- local buffer -> device ------------------------------------------------------------------------------
    def layer_to_device(
        self, slots: Sequence[int], layer: int, out: torch.Tensor, stream: "torch.cuda.Stream | None" = None
    ) -> None:
        """``BufferPool.layer_to_device``, counted."""
        self.buffer.layer_to_device(list(slots), layer, out, stream)
        self.count("buffer_to_device", len(slots) * self.geometry.layer_block_bytes)

    def layer_from_device(self, slots: Sequence[int], layer: int, rows: torch.Tensor) -> None:
        """``BufferPool.layer_from_device``, counted."""
        self.buffer.layer_from_device(list(slots), layer, rows)
        self.count("device_to_buffer", len(slots) * self.geometry.layer_block_bytes)

    # --- peers ----------------------------------------------------------------------------------------------
    def move_layers(
        self,
        op: Op,
        local_region: int,
        local_layout: BlockLayout,
        local_slots: Sequence[int],
        remote: PeerRegion,
        remote_slots: Sequence[int],
        layers: Sequence[int],
        tokens: tuple[int, int] | None = None,
        priority: Priority = Priority.LOW,
        path: str | None = None,
    ) -> Waitable:
        """One-sided READ (peer -> us) or WRITE (us -> peer) of ``layers`` of the given blocks and tokens."""
        segments = plan_segments(
            local_region, local_layout, local_slots, remote.region_id, remote.layout, remote_slots, layers, tokens
        )
        handle = self.transport.submit(remote.peer, op, segments, priority)
        label = path or ("peer_read" if op is Op.READ else "peer_write")
        klass = "kv" if priority is Priority.LOW else "control"
        return Counted(handle, lambda: self.count(label, handle.nbytes, klass))

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f"{p}:{k}": v for (p, k), v in self.bytes.items()}


class LayerPipeline:
    """The per-layer contract between an engine and its traffic: ``begin``, then per layer ``wait_layer(l)``
    before it computes and ``layer_done(l)`` after, then ``finish``.

    ``fetch(l)`` starts moving layer ``l``'s KV in (or returns None when there is nothing to fetch) and
    ``send(l)`` starts moving layer ``l``'s results out. ``depth + 1`` layers are fetched ahead, so layer l+1's KV
    is in flight while layer l computes; a workspace of ``depth + 1`` layer slots suffices because layer
    ``l + depth + 1`` is fetched (into layer l's slot) only once layer l's send has completed, so the engine may
    send straight from the slot. A send that must wait for the device (``layer_done``'s ``computed``) is started
    from the pipeline's sender thread, in layer order, so the engine's thread never waits on the device inside
    the layer loop. Every wait is bounded by ``timeout``; a failed transfer raises in the engine's thread at the
    next ``wait_layer`` or at ``finish``.
    """

    def __init__(
        self,
        num_layers: int,
        fetch: Callable[[int], Waitable | None],
        send: Callable[[int], Waitable | None],
        depth: int = 1,
        timeout: float = 60.0,
    ):
        self.num_layers, self.fetch, self.send, self.depth, self.timeout = num_layers, fetch, send, depth, timeout
        self._fetches: dict[int, Waitable | None] = {}
        self._cond = threading.Condition()
        self._sends: list[Waitable] = []
        self._error: BaseException | None = None  # from a fetch or send started outside the engine's thread
        self._pending: list[tuple[int, Callable[[], None]]] = []  # sends waiting for their layer's compute
        self._sender: threading.Thread | None = None
        self.wait_time = 0.0  # seconds the engine spent blocked on fetches

    def _issue(self, layer: int) -> None:
        try:
            handle = self.fetch(layer)
        except BaseException as e:  # noqa: BLE001 - may run in a transport thread: hand it to the engine
            handle = None
            self._fail(e)
        with self._cond:
            self._fetches[layer] = handle
            self._cond.notify_all()

    def _fail(self, e: BaseException) -> None:
        with self._cond:
            self._error = self._error or e
            self._cond.notify_all()

    def begin(self) -> None:
        for layer in range(min(self.depth + 1, self.num_layers)):
            self._issue(layer)

    def wait_layer(self, layer: int) -> None:
        t = time.perf_counter()
        with self._cond:
            if not self._cond.wait_for(lambda: layer in self._fetches or self._error is not None, self.timeout):
                raise TransferTimeoutError(f"layer {layer} was never fetched within {self.timeout} s")
            if self._error is not None:
                raise self._error
            handle = self._fetches.pop(layer)
        if handle is not None:
            handle.wait(self.timeout)
        self.wait_time += time.perf_counter() - t

    def layer_done(self, layer: int, computed: Callable[[], None] | None = None) -> None:
        """Layer ``layer`` has been computed, or, with ``computed``, launched: ``computed()`` blocks until its
        results may be read (a CUDA event's ``synchronize``), and the send starts from the sender thread after it."""
        if computed is None:
            self._sent(layer, self.send(layer))
            return
        with self._cond:
            self._pending.append((layer, computed))
            self._cond.notify_all()
            if self._sender is None:
                self._sender = threading.Thread(target=self._send_in_order, daemon=True, name="layer-sends")
                self._sender.start()

    def _send_in_order(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending)
                layer, computed = self._pending.pop(0)
            if layer < 0:
                return
            try:
                if self._error is None:
                    computed()
                if self._error is not None:
                    continue  # the batch has failed: start nothing more
                handle = self.send(layer)
            except BaseException as e:  # noqa: BLE001 - the engine's thread raises it
                self._fail(e)
                continue
            self._sent(layer, handle)

    def _sent(self, layer: int, handle: Waitable | None) -> None:
        nxt = layer + self.depth + 1
        if handle is not None:
            with self._cond:
                self._sends.append(handle)
        if nxt >= self.num_layers:
            return
        if handle is None:
            self._issue(nxt)
        else:
            handle.add_done_callback(lambda: self._issue(nxt))

    def finish(self) -> None:
        if not self._stop_sender():
            raise TransferTimeoutError(f"layer sends were not started within {self.timeout} s")
        errors = [self._error] if self._error is not None else []
        for h in self._sends:
            try:
                h.wait(self.timeout)
            except DualPathError as e:
                errors.append(e)
        self._sends.clear()
        if errors:
            raise errors[0]

    def abandon(self) -> None:
        """The engine gave up on the batch (an error in its thread, which it is raising): no more sends start and
        the sender thread ends; raises nothing of its own."""
        self._fail(DualPathError("the layer loop was abandoned"))
        self._stop_sender()

    def _stop_sender(self) -> bool:
        """Let the sender thread start what is queued, then end; False if it is still busy after ``timeout``."""
        sender, self._sender = self._sender, None
        if sender is None:
            return True
        with self._cond:
            self._pending.append((-1, lambda: None))
            self._cond.notify_all()
        sender.join(self.timeout)
        return not sender.is_alive()


class AllOf:
    """Several waitables seen as one (``None`` entries are already done)."""

    def __init__(self, handles: Sequence[Waitable | None]):
        self.handles = [h for h in handles if h is not None]

    def wait(self, timeout: float | None = None) -> None:
        for h in self.handles:
            h.wait(timeout)

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        if not self.handles:
            fn()
            return
        remaining = [len(self.handles)]
        lock = threading.Lock()

        def one():
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                fn()

        for h in self.handles:
            h.add_done_callback(one)


def _done(results: Results) -> "Future[Results]":
    fut: Future = Future()
    fut.set_result(results)
    return fut


def _spread(inner: "Future[Results]", where: list[int], n: int) -> "Future[Results]":
    """``inner``'s per-key results at indices ``where`` of ``n`` keys; the others succeeded (served already)."""
    if len(where) == n:
        return inner
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            results: Results = [None] * n
            for i, r in zip(where, f.result()):
                results[i] = r
            out.set_result(results)
        except BaseException as e:  # noqa: BLE001 - the caller's wait raises it
            out.set_exception(e)

    inner.add_done_callback(done)
    return out
