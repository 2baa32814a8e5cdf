"""KV events: the blocks an engine stores in the KV store and the blocks that leave it, published the way vLLM
publishes its prefix cache's (``--kv-events-config``), so KV-aware routers that index vLLM engines (llm-d's KV cache
indexer, NVIDIA Dynamo's KV router) index DualPath engines too. ``docs/kv-events.md`` is the user's side.

The wire, as vLLM's ``ZmqEventPublisher`` sends it (``vllm/distributed/kv_events.py``):

- a PUB socket sends each batch as three frames ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian counter from
  0, one per batch; ``payload`` the batch in MessagePack, ``[ts, events, data_parallel_rank]`` (msgspec's
  ``array_like`` ``KVEventBatch``);
- each event is msgspec's tagged struct, by ``KVEventsConfig.encoding``: "array" ``[tag, field, ...]`` (vLLM
  before PR #42892; every consumer decodes it) or "map" ``{"type": tag, field: value, ...}`` (vLLM since), with
  ``BlockStored`` (``block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name``),
  ``BlockRemoved`` (``block_hashes, medium``) and ``AllBlocksCleared`` (no field). The fields vLLM appended after
  these (``extra_keys``, ``group_idx``, ...) have defaults: a map leaves them out as vLLM's does, an array ends before
  them, the prefix every decoder reads (llm-d's and Dynamo's take the later ones as optional);
- a ROUTER socket on the replay endpoint answers a request ``[identity, "", start_seq]`` (a REQ socket's, or a
  DEALER's sending ``["", start_seq]``) with ``[identity, "", topic, seq, payload]`` for each buffered batch from
  ``start_seq`` on, then ``[identity, "", "", 0xff x 8, ""]`` (vLLM since PR #45177: replies carry the topic).

A block's hash on the wire is an unsigned 64-bit integer, the last 8 bytes of its 16-byte ``BlockHash`` read
big-endian: what vLLM sends by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), all Dynamo decodes, and what llm-d
folds a byte hash to. The engine's calls never wait: events go to a bounded queue that a thread of this module
drains (a full queue drops the event and counts it); that thread owns both sockets.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence

import msgpack

from dualpath.core.config import KVEventsConfig
from dualpath.core.errors import ConfigError
from dualpath.core.geometry import BlockHash

log = logging.getLogger(__name__)

BLOCK_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
BLOCK_REMOVED = ("block_hashes", "medium")
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the end of a replay (vLLM's)
MAX_BATCH_EVENTS = 1024  # events queued together leave in one batch, up to this many
POLL_S = 0.02  # how long the thread waits for an event before it looks at the replay socket again
LINGER_MS = 500  # what a closing PUB socket may still take to send what it holds


def wire_hash(key: BlockHash) -> int:
    """A block's hash as events carry it: its last 8 bytes, big-endian (vLLM's ``maybe_convert_block_hash``)."""
    return int.from_bytes(key[-8:], "big")


def lora_id(adapter: str) -> int | None:
    """vLLM's ``lora_id`` (an int, deprecated for ``lora_name``) of an adapter identity: its first 28 bits, at least 1."""
    return (int(adapter[:7], 16) or 1) if adapter else None


def event(tag: str, fields: Sequence[str], values: Sequence, encoding: str) -> list | dict:
    """One event as msgspec encodes a tagged struct: ``[tag, *values]`` (``array_like``) or ``{"type": tag, ...}``."""
    if encoding == "array":
        return [tag, *values]
    return {"type": tag, **dict(zip(fields, values))}


def block_stored(
    hashes: Sequence[int],
    parent: int | None,
    token_ids: Sequence[int],
    block_size: int,
    medium: str | None,
    lora_name: str | None = None,
    lora: int | None = None,
    encoding: str = "array",
) -> list | dict:
    values = (list(hashes), parent, list(token_ids), block_size, lora, medium, lora_name)
    return event("BlockStored", BLOCK_STORED, values, encoding)


def block_removed(hashes: Sequence[int], medium: str | None, encoding: str = "array") -> list | dict:
    return event("BlockRemoved", BLOCK_REMOVED, (list(hashes), medium), encoding)


def all_blocks_cleared(encoding: str = "array") -> list | dict:
    return event("AllBlocksCleared", (), (), encoding)


def encode_batch(ts: float, events: list, data_parallel_rank: int | None = 0) -> bytes:
    """A batch's payload: ``[ts, events, data_parallel_rank]``, byte for byte what msgspec encodes of vLLM's
    ``KVEventBatch`` (an ``array_like`` struct keeps every field, defaults too; the time stamp a float64)."""
    return msgpack.packb([float(ts), events, data_parallel_rank], use_bin_type=True)


class NullKVEvents:
    """KV events off: every call does nothing."""

    enabled = False
    endpoint = replay_endpoint = None
    dropped = published = 0

    def stored(self, keys, parent, token_ids, adapter="", ok=None) -> None:
        pass

    def removed(self, keys) -> None:
        pass

    def cleared(self) -> None:
        pass

    def close(self, timeout: float = 0.0) -> None:
        pass


class KVEventPublisher(NullKVEvents):
    """Publishes an engine's KV events (see the module's doc) from a thread of its own. ``adapter_names``: adapter
    identity -> the name requests give it (``lora_name``; an unnamed adapter goes by its identity). ``endpoint`` and
    ``replay_endpoint`` are where the sockets are, after ``port_offset`` (and a bound ``:*`` resolved)."""

    enabled = True

    def __init__(
        self,
        cfg: KVEventsConfig,
        block_size: int,
        data_parallel_rank: int = 0,
        adapter_names: Mapping[str, str] | None = None,
    ):
        import zmq

        self.cfg, self.block_size, self.rank = cfg, block_size, data_parallel_rank
        self.adapter_names = adapter_names if adapter_names is not None else {}
        self.dropped = 0  # events the full queue refused
        self._dropped_lock = threading.Lock()  # (the engine's I/O threads publish at once)
        self.published = 0  # batches sent
        self._queue: queue.Queue = queue.Queue(maxsize=cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._seq = itertools.count()
        self._topic = cfg.topic.encode()
        self._closed = False
        self._stop_now = False  # close() could not queue its end: the thread stops after the batch in hand
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(cfg.hwm)
            endpoint = cfg.publish_endpoint
            if cfg.binds(cfg.endpoint):
                self._pub.bind(endpoint)
                endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(endpoint)
            self.endpoint = endpoint
            self.replay_endpoint = None
            if cfg.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(cfg.replay_endpoint_bound)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._close_sockets(0)
            raise ConfigError(
                f"kv events: cannot open {cfg.publish_endpoint} / {cfg.replay_endpoint_bound}: {e}"
            ) from None
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events")
        self._thread.start()
        log.info(
            "KV events on %s (topic %r, %s events%s)",
            self.endpoint,
            cfg.topic,
            cfg.encoding,
            f", replay on {self.replay_endpoint}" if self.replay_endpoint else "",
        )

    # --- the engine's side: never waits ----------------------------------------------------------------------
    def stored(
        self,
        keys: Sequence[BlockHash],
        parent: BlockHash | None,
        token_ids: Sequence[int],
        adapter: str = "",
        ok: Sequence[bool] | None = None,
    ) -> None:
        """Blocks ``keys`` written, in chain order: ``parent`` the block before the first (None: the first of its
        sequence), ``token_ids`` theirs (``block_size`` each). ``ok``: which were written (a failed one splits the run
        into events of their own, each naming the block before it as its parent)."""
        if keys:
            self._put(("stored", list(keys), parent, token_ids, adapter, ok))

    def removed(self, keys: Sequence[BlockHash]) -> None:
        if keys:
            self._put(("removed", list(keys)))

    def cleared(self) -> None:
        self._put(("cleared",))

    def _put(self, item: tuple) -> None:
        if self._closed:
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            with self._dropped_lock:
                self.dropped += 1
                dropped = self.dropped
            if dropped == 1 or dropped % 1000 == 0:
                log.warning("KV events: the queue is full (%d); %d event(s) dropped", self.cfg.max_queue_size, dropped)

    def close(self, timeout: float = 2.0) -> None:
        """Publish what is queued, then close the sockets; waits at most about ``timeout`` seconds."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        try:
            self._queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            self._stop_now = True
        self._thread.join(max(0.0, deadline - time.monotonic()) + LINGER_MS / 1000)
        if self._thread.is_alive():
            log.warning("KV events: the publisher thread did not end in %.1f s; left behind", timeout)

    # --- the thread's side -------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop_now:
                if self._replay is not None and self._replay.poll(0):
                    try:
                        self._serve_replay()
                    except Exception:  # noqa: BLE001 - a bad request must not end the publisher
                        log.exception("KV events: a replay request failed")
                try:
                    item = self._queue.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                last = item is None
                events = [] if last else self._events(item)
                while not last and len(events) < MAX_BATCH_EVENTS:
                    try:
                        more = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    last = more is None
                    if not last:
                        events += self._events(more)
                if events:
                    try:
                        self._send(events)
                    except Exception:  # noqa: BLE001 - keep publishing what comes next
                        log.exception("KV events: publishing a batch failed")
                if last:
                    return
        finally:
            self._close_sockets(LINGER_MS)

    def _close_sockets(self, linger_ms: int) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=linger_ms)
        self._ctx.term()

    def _events(self, item: tuple) -> list:
        medium, enc = self.cfg.medium, self.cfg.encoding
        if item[0] == "removed":
            return [block_removed([wire_hash(k) for k in item[1]], medium, enc)]
        if item[0] == "cleared":
            return [all_blocks_cleared(enc)]
        _, keys, parent, tokens, adapter, ok = item
        bs = self.block_size
        name = (self.adapter_names.get(adapter) or adapter) if adapter else None
        out, start = [], 0
        for i in range(len(keys) + 1):  # runs of stored blocks
            if i < len(keys) and (ok is None or ok[i]):
                continue
            if i > start:
                before = keys[start - 1] if start else parent
                out.append(
                    block_stored(
                        [wire_hash(k) for k in keys[start:i]],
                        None if before is None else wire_hash(before),
                        tokens[start * bs : i * bs],
                        bs,
                        medium,
                        name,
                        lora_id(adapter),
                        enc,
                    )
                )
            start = i + 1
        return out

    def _send(self, events: list) -> None:
        payload = encode_batch(time.time(), events, self.rank)
        seq = next(self._seq)
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.published += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: a replay request of %d frames ignored (want identity, '', start seq)", len(frames))
            return
        identity, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((identity, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", b"", END_SEQ, b""))


def open_kv_events(
    cfg: KVEventsConfig, block_size: int, data_parallel_rank: int = 0, adapter_names: Mapping[str, str] | None = None
) -> NullKVEvents:
    """The engine's publisher: a ``KVEventPublisher`` when ``cfg`` enables events, else one that does nothing."""
    if not cfg.enabled:
        return NullKVEvents()
    return KVEventPublisher(cfg, block_size, data_parallel_rank, adapter_names)
