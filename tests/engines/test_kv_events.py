"""KV events (``dualpath.engines.kv_events``) as vLLM's ``--kv-events-config`` publishes them: the MessagePack layout
field by field and byte for byte against msgspec (vLLM's encoder) with structs of vLLM's field order, both encodings
decoded by structs of vLLM's current schema, the ZeroMQ frames and the replay socket, the bounded queue and close,
the endpoint offsets, the store's hooks (a corrupt block removed, the store flushed), and a real decode engine's
stores, evictions and a flush as a ZeroMQ subscriber sees them. Every wait is bounded."""

from __future__ import annotations

import logging
import threading
import time
from typing import Union

import msgpack
import pytest
import torch
import zmq

from dualpath.core.config import KVEventsConfig, StorageConfig
from dualpath.core.errors import BlockCorruptError, ConfigError
from dualpath.core.geometry import KVGeometry, block_hashes
from dualpath.engines import kv_events as ke
from dualpath.engines.kv_events import END_SEQ, KVEventPublisher, open_kv_events, wire_hash
from dualpath.traffic.storage import fs
from dualpath.traffic.storage.fs import FsStorage, header_bytes, list_stored_keys, remove_stored

WAIT_MS = 5000  # the longest any receive below waits
ADAPTER = "ab" * 32  # an adapter identity (64 hex digits)


def config(**kw) -> KVEventsConfig:
    base = dict(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*", topic="kv@pod@tiny")
    return KVEventsConfig(**{**base, **kw})


class Subscriber:
    """A SUB socket on a publisher, as a router's indexer connects one: frames checked, payloads decoded."""

    def __init__(self, endpoint: str, topic: bytes = b"kv@"):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)

    def sync(self, publisher: KVEventPublisher) -> None:
        """Until the subscription has reached the publisher (PUB drops what it sends before): probe events, the
        last one seen, the rest drained."""
        deadline = time.monotonic() + WAIT_MS / 1000
        while time.monotonic() < deadline:
            publisher.cleared()
            if self.sub.poll(50):
                while self.sub.poll(100):
                    self.sub.recv_multipart()
                return
        raise AssertionError("the subscription never reached the publisher")

    def batch(self, timeout_ms: int = WAIT_MS) -> tuple[bytes, int, list]:
        """One message: (topic, seq, decoded batch)."""
        assert self.sub.poll(timeout_ms), "no KV event batch arrived"
        topic, seq, payload = self.sub.recv_multipart()
        assert len(seq) == 8
        return topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload)

    def events(self, until, timeout_s: float = 10.0) -> list:
        """Events of the batches that arrive until ``until(events so far)`` holds."""
        got: list = []
        deadline = time.monotonic() + timeout_s
        while not until(got):
            left = int((deadline - time.monotonic()) * 1000)
            assert left > 0, f"timed out; events so far: {got}"
            got += self.batch(left)[2][1]
        return got

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


# --- the encoding ---------------------------------------------------------------------------------------------


def test_block_hashes_go_as_their_last_8_bytes_big_endian():
    key = bytes(range(16))
    assert wire_hash(key) == int.from_bytes(bytes(range(8, 16)), "big") == 0x08090A0B0C0D0E0F
    assert wire_hash(b"\xff" * 16) == 2**64 - 1  # unsigned (MessagePack uint64), as vLLM's
    assert ke.lora_id("") is None and ke.lora_id(ADAPTER) == int(ADAPTER[:7], 16)


def test_the_array_layout_field_by_field():
    """vLLM's field order: KVEventBatch [ts, events, data_parallel_rank]; each event [tag, fields...] (msgspec's
    ``array_like`` tagged struct: the tag is the class name)."""
    stored = ke.block_stored([1, 2**64 - 1], 7, [5, 6, 7, 8], 2, "DISK", "sql", 9)
    payload = ke.encode_batch(12.5, [stored, ke.block_removed([3], "DISK"), ke.all_blocks_cleared()], 1)
    ts, events, rank = msgpack.unpackb(payload)
    assert (ts, rank) == (12.5, 1) and payload[1] == 0xCB  # a float64 time stamp, as msgspec's
    tag, hashes, parent, tokens, block_size, lora_id, medium, lora_name = events[0]
    assert (tag, hashes, parent, tokens, block_size) == ("BlockStored", [1, 2**64 - 1], 7, [5, 6, 7, 8], 2)
    assert (lora_id, medium, lora_name) == (9, "DISK", "sql")
    assert events[1] == ["BlockRemoved", [3], "DISK"]
    assert events[2] == ["AllBlocksCleared"]
    assert msgpack.unpackb(ke.encode_batch(1.0, [], None)) == [1.0, [], None]  # (every field, as array_like's)


def test_the_map_layout_field_by_field():
    stored = ke.block_stored([1], None, [5, 6], 2, "DISK", encoding="map")
    ts, events, rank = msgpack.unpackb(ke.encode_batch(3.0, [stored, ke.block_removed([3], None, "map")], 0))
    assert list(events[0]) == ["type", *ke.BLOCK_STORED]  # the tag first, then vLLM's order
    assert events[0] == dict(
        type="BlockStored",
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=[5, 6],
        block_size=2,
        lora_id=None,
        medium="DISK",
        lora_name=None,
    )
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [3], "medium": None}
    assert ke.all_blocks_cleared("map") == {"type": "AllBlocksCleared"}


def _vllm_structs(msgspec, array_like: bool, current: bool):
    """vLLM's event structs as msgspec declares them: the fields of ``BlockStored`` up to ``lora_name``, and with
    ``current`` the ones vLLM appended since (all with defaults)."""

    class Event(msgspec.Struct, array_like=array_like, omit_defaults=True, tag=True):
        pass

    class BlockStored(Event):
        block_hashes: list[Union[int, bytes]]
        parent_block_hash: Union[int, bytes, None]
        token_ids: list[int]
        block_size: int
        lora_id: Union[int, None]
        medium: Union[str, None]
        lora_name: Union[str, None]
        if current:
            event_version: int = 1
            extra_keys: Union[list, None] = None
            group_idx: Union[int, None] = None
            kv_cache_spec_kind: Union[str, None] = None
            kv_cache_spec_sliding_window: Union[int, None] = None
            locality: Union[str, None] = None

    class BlockRemoved(Event):
        block_hashes: list[Union[int, bytes]]
        medium: Union[str, None]
        if current:
            group_idx: Union[int, None] = None

    class AllBlocksCleared(Event):
        pass

    fields = [("ts", float), ("events", list[Union[BlockStored, BlockRemoved, AllBlocksCleared]])]
    fields.append(("data_parallel_rank", Union[int, None], None))
    KVEventBatch = msgspec.defstruct("KVEventBatch", fields, array_like=True, omit_defaults=True)
    return BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_bytes_are_msgspecs_and_vllms_current_structs_decode_them(encoding):
    msgspec = pytest.importorskip("msgspec")
    hashes, parent = [2**64 - 5, 7], 2**63 + 1
    ours = [
        ke.block_stored(hashes, parent, [1, 2, 3, 4], 2, "DISK", "sql", ke.lora_id(ADAPTER), encoding),
        ke.block_stored(hashes, None, [1, 2, 3, 4], 2, None, None, None, encoding),
        ke.block_removed(hashes, "DISK", encoding),
        ke.all_blocks_cleared(encoding),
    ]
    S, R, C, Batch = _vllm_structs(msgspec, array_like=encoding == "array", current=False)
    theirs = [
        S(hashes, parent, [1, 2, 3, 4], 2, ke.lora_id(ADAPTER), "DISK", "sql"),
        S(hashes, None, [1, 2, 3, 4], 2, None, None, None),
        R(hashes, "DISK"),
        C(),
    ]
    payload = ke.encode_batch(1234.5, ours, 3)
    assert payload == msgspec.msgpack.encode(Batch(1234.5, theirs, 3))
    S, R, C, Batch = _vllm_structs(msgspec, array_like=encoding == "array", current=True)
    batch = msgspec.msgpack.decode(payload, type=Batch)  # a consumer built on vLLM's current schema
    assert batch.data_parallel_rank == 3 and [type(e).__name__ for e in batch.events] == [
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    ]
    first = batch.events[0]
    assert (first.block_hashes, first.parent_block_hash, first.lora_name, first.medium) == (
        hashes,
        parent,
        "sql",
        "DISK",
    )
    assert first.extra_keys is None and first.group_idx is None


# --- the endpoints -------------------------------------------------------------------------------------------


def test_the_config_is_vllms_json_and_offsets_bound_ports():
    cfg = KVEventsConfig.parse(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5657", "buffer_steps": 10, "hwm": 5, "max_queue_size": 7, "topic": "kv@p@m"}',
        port_offset=3,
    )
    assert cfg.enabled and (cfg.buffer_steps, cfg.hwm, cfg.max_queue_size, cfg.topic) == (10, 5, 7, "kv@p@m")
    assert (cfg.publish_endpoint, cfg.replay_endpoint_bound) == ("tcp://*:5560", "tcp://*:5660")
    assert KVEventsConfig() == KVEventsConfig.parse("") and not KVEventsConfig().enabled  # off by default
    assert not KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    assert not KVEventsConfig.parse('{"publisher": "zmq"}').enabled  # (vLLM's: enabling is its own key)
    moved = lambda ep, n=2: KVEventsConfig(endpoint=ep, port_offset=n).publish_endpoint  # noqa: E731
    assert moved("tcp://[::]:5557") == "tcp://[::]:5559"
    assert moved("tcp://127.0.0.1:*") == "tcp://127.0.0.1:*"  # any port: nothing to move
    assert moved("tcp://indexer:5557") == "tcp://indexer:5557"  # connected to a central subscriber: one for all
    assert moved("ipc:///run/kv") == "ipc:///run/kv_2" and moved("ipc:///run/kv", 0) == "ipc:///run/kv"
    for bad in ('{"enable": true}', "[1]", "{", '{"hwm": -1}', '{"encoding": "json"}', '{"endpoint": "kv:1"}'):
        with pytest.raises(ConfigError):
            KVEventsConfig.parse(bad)


def test_engines_of_one_host_bind_ports_of_their_own(tmp_path):
    """Two engines given one config, offsets 0 and 1 (their indexes on the host), both bind and publish apart."""
    base = dict(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/kv", replay_endpoint=f"ipc://{tmp_path}/r")
    pubs = [open_kv_events(KVEventsConfig(**base, port_offset=n), 4, data_parallel_rank=n) for n in (0, 1)]
    try:
        assert [p.endpoint for p in pubs] == [f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/kv_1"]
        assert [p.replay_endpoint for p in pubs] == [f"ipc://{tmp_path}/r", f"ipc://{tmp_path}/r_1"]
        subs = [Subscriber(p.endpoint, b"") for p in pubs]
        for s, p in zip(subs, pubs):
            s.sync(p)
        pubs[1].removed([bytes(16)])
        assert subs[1].batch()[2][1:] == [[["BlockRemoved", [0], "DISK"]], 1]  # its rank in its batches
        assert not subs[0].sub.poll(100)
        for s in subs:
            s.close()
    finally:
        for p in pubs:
            p.close()
    assert not isinstance(open_kv_events(KVEventsConfig(), 4), KVEventPublisher)  # off: nothing opened


def test_serve_and_node_give_each_engine_of_the_host_its_offset(tmp_path):
    """``dualpath serve``: prefill engine i at offset 2i, decode engine i at 2i + 1; ``dualpath node``: engine i at
    i; ``dualpath engine`` alone: its data-parallel rank (vLLM's), unless given."""
    from dualpath.cli import build_parser, engine_config
    from dualpath.launcher import ClusterSpec, LocalCluster, NodeEngines, NodeSpec

    text = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'
    cluster = LocalCluster(ClusterSpec("/m", 2, 2, kv_events_config=text), str(tmp_path / "serve"))
    cluster.scheduler_address = "127.0.0.1:1"
    serve = [cluster._engine_args(role, i, 0) for role in ("prefill", "decode") for i in range(2)]
    node = NodeEngines(NodeSpec("decode", "s:1", 3, engine_args=("--model", "/m", "--kv-events-config", text)))
    parse = lambda argv: engine_config(build_parser().parse_args(argv)).kv_events  # noqa: E731
    assert [parse(a).publish_endpoint for a in serve] == [f"tcp://*:{5557 + n}" for n in (0, 2, 1, 3)]
    assert [parse(node.engine_args(i)).publish_endpoint for i in range(3)] == [f"tcp://*:{5557 + n}" for n in range(3)]
    engine = ["engine", "--role", "decode", "--scheduler", "s:1", "--model", "/m", "--kv-events-config", text]
    dp = ["--data-parallel-size", "4", "--data-parallel-rank", "2", "--data-parallel-master", "h:1"]
    assert parse(engine + dp).port_offset == 2
    assert parse(engine + dp + ["--kv-events-port-offset", "5"]).port_offset == 5
    plain = LocalCluster(ClusterSpec("/m", 1, 1), str(tmp_path / "plain"))
    assert "--kv-events-config" not in plain._engine_args("decode", 0, 0)  # (off: the command as before)


# --- the publisher ---------------------------------------------------------------------------------------------


def test_frames_runs_and_adapters():
    """[topic, seq, payload] frames, seq up by one a batch; a store with a failed block in the middle is two runs, each
    naming the block before it as parent; an adapter goes by the name requests give it (else its identity)."""
    pub = KVEventPublisher(config(), block_size=2, data_parallel_rank=0, adapter_names={ADAPTER: "sql"})
    sub = Subscriber(pub.endpoint)
    try:
        sub.sync(pub)
        keys = [bytes([i]) * 16 for i in range(1, 5)]
        pub.stored(keys, None, [10, 11, 12, 13, 14, 15, 16, 17], ok=[True, True, False, True])
        events = sub.events(lambda got: len(got) >= 2)
        assert events == [
            ["BlockStored", [wire_hash(keys[0]), wire_hash(keys[1])], None, [10, 11, 12, 13], 2, None, "DISK", None],
            ["BlockStored", [wire_hash(keys[3])], wire_hash(keys[2]), [16, 17], 2, None, "DISK", None],
        ]
        pub.stored(keys[:1], keys[3], [1, 2], adapter=ADAPTER)
        pub.stored(keys[1:2], keys[0], [3, 4], adapter="cd" * 32)
        events = sub.events(lambda got: len(got) >= 2)
        assert [(e[5], e[7]) for e in events] == [(ke.lora_id(ADAPTER), "sql"), (ke.lora_id("cd" * 32), "cd" * 32)]
        pub.cleared()
        topic, seq, batch = sub.batch()
        pub.cleared()
        assert sub.batch()[:2] == (topic, seq + 1) and topic == b"kv@pod@tiny"
        assert batch[1] == [["AllBlocksCleared"]] and pub.dropped == 0
    finally:
        sub.close()
        pub.close()


def _replay(endpoint: str, start: int, dealer: bool = True) -> list[list[bytes]]:
    """A replay request from ``start`` (an 8-byte big-endian seq); the replies' frames up to the end marker."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER if dealer else zmq.REQ)
    s.connect(endpoint)
    try:
        s.send_multipart([b"", start.to_bytes(8, "big")] if dealer else [start.to_bytes(8, "big")])
        out = []
        while True:
            assert s.poll(WAIT_MS), f"no replay reply (got {out})"
            frames = s.recv_multipart()
            frames = frames[1:] if dealer else frames  # (a DEALER sees the empty delimiter)
            out.append(frames)
            if frames[1] == END_SEQ or not dealer:
                return out
    finally:
        s.close(linger=0)
        ctx.term()


def test_replay_sends_the_buffered_batches_from_a_seq():
    pub = KVEventPublisher(config(replay_endpoint="tcp://127.0.0.1:*", buffer_steps=4), block_size=2)
    sub = Subscriber(pub.endpoint)
    try:
        sub.sync(pub)
        for i in range(6):  # one batch each: the subscriber reads each before the next
            pub.removed([bytes([i]) * 16])
            last = sub.batch()[1]
        replies = _replay(pub.replay_endpoint, last - 2)
        assert [(f[0], int.from_bytes(f[1], "big")) for f in replies[:-1]] == [
            (b"kv@pod@tiny", s) for s in range(last - 2, last + 1)
        ]
        assert msgpack.unpackb(replies[-2][2])[1] == [["BlockRemoved", [wire_hash(bytes([5]) * 16)], "DISK"]]
        assert replies[-1] == [b"", END_SEQ, b""]  # the end: empty topic, seq all ones, empty payload
        assert len(_replay(pub.replay_endpoint, 0)) == 4 + 1  # only buffer_steps batches are kept
        assert _replay(pub.replay_endpoint, last + 1) == [[b"", END_SEQ, b""]]  # nothing that new
        assert len(_replay(pub.replay_endpoint, last, dealer=False)) == 1  # a REQ socket gets the first reply
        ctx = zmq.Context()  # a malformed request is ignored, the publisher goes on
        bad = ctx.socket(zmq.DEALER)
        bad.connect(pub.replay_endpoint)
        bad.send_multipart([b"x", b"y", b"z"])
        assert not bad.poll(200)
        bad.close(linger=0)
        ctx.term()
        assert len(_replay(pub.replay_endpoint, last)) == 2
    finally:
        sub.close()
        pub.close()


def test_a_full_queue_drops_and_counts_and_close_is_bounded(caplog):
    pub = KVEventPublisher(config(max_queue_size=3), block_size=2)
    gate, entered = threading.Event(), threading.Event()
    events = pub._events

    def held(item):  # the thread stuck on its first event: the queue fills behind it
        entered.set()
        assert gate.wait(10)
        return events(item)

    pub._events = held
    try:
        pub.cleared()
        assert entered.wait(5)
        start = time.monotonic()
        for i in range(10):
            pub.removed([bytes([i]) * 16])  # never waits
        assert time.monotonic() - start < 0.5
        assert pub.dropped == 10 - 3
        with caplog.at_level(logging.WARNING, "dualpath.engines.kv_events"):
            start = time.monotonic()
            pub.close(timeout=0.3)  # the thread still stuck: close returns anyway
            assert time.monotonic() - start < 0.3 + ke.LINGER_MS / 1000 + 0.5
        assert "did not end" in caplog.text
        pub.removed([b"\0" * 16])  # closed: ignored
    finally:
        gate.set()
        pub._thread.join(5)
        assert not pub._thread.is_alive()


def test_close_publishes_what_is_queued():
    pub = KVEventPublisher(config(), block_size=2)
    sub = Subscriber(pub.endpoint)
    try:
        sub.sync(pub)
        for i in range(50):
            pub.removed([bytes([i]) * 16])
        pub.close()
        events = sub.events(lambda got: len(got) >= 50)
        assert [e[1][0] for e in events] == [wire_hash(bytes([i]) * 16) for i in range(50)]
        assert not pub._thread.is_alive()
    finally:
        sub.close()


# --- the store's hooks ----------------------------------------------------------------------------------------

GEOM = KVGeometry(num_layers=2, block_size=4, kv_elems_per_token=4, dtype="float32")


def test_the_store_says_when_it_removes_a_corrupt_block_and_when_it_was_flushed(tmp_path, monkeypatch):
    monkeypatch.setattr(fs, "DIR_CHECK_S", 0.0)  # a flush noticed at the next usage() (else within 1 s)
    store = FsStorage(tmp_path, GEOM, b"\1" * 16, StorageConfig(root=str(tmp_path), io_threads=1))
    corrupt, cleared = [], []
    store.set_corrupt_callback(corrupt.extend)
    store.set_cleared_callback(lambda: cleared.append(True))
    try:
        keys = [bytes([i]) * 16 for i in (1, 2)]
        blocks = [torch.full((GEOM.full_block_bytes,), i, dtype=torch.uint8) for i in (1, 2)]
        assert store.write(keys, blocks).result() == [None, None]
        with open(store.path(keys[1]), "r+b") as f:
            f.seek(header_bytes(GEOM) + 3)
            f.write(b"\x99")
        into = [torch.empty(GEOM.full_block_bytes, dtype=torch.uint8) for _ in keys]
        results = store.read(keys, into).result()
        assert results[0] is None and isinstance(results[1], BlockCorruptError)
        assert corrupt == [keys[1]] and not cleared
        store.usage()
        assert remove_stored(tmp_path, b"\1" * 16, background=False)
        deadline = time.monotonic() + 5
        while not cleared and time.monotonic() < deadline:  # noticed at the next count (within DIR_CHECK_S)
            store.usage()
            time.sleep(0.05)
        assert cleared == [True]
        store.usage()
        assert cleared == [True]  # once
    finally:
        store.close()


# --- a real decode engine ---------------------------------------------------------------------------------------

BS = 16
N = 5 * BS + 3  # 5 full blocks per prompt (the reply's few tokens fill no other)
PROMPTS = [[(i * (7 + 2 * p) + p) % 250 + 3 for i in range(N)] for p in range(3)]
CAP_BLOCKS = 8


def test_a_decode_engines_stores_evictions_and_flush_reach_a_subscriber(tiny_dirs, tmp_path, monkeypatch):
    """Three prompts through a prefill and a decode engine whose store holds 8 blocks: a subscriber sees each
    prompt's 5 blocks stored, chained from no parent, with their tokens; the blocks evicted for the third, each
    gone from the disk; and the store's flush, as AllBlocksCleared."""
    from dualpath.engines.models import open_checkpoint
    from engines_on_core import EngineSpec, engines_on_core, running, submit, wait_for

    geometry = KVGeometry.for_model(open_checkpoint(tiny_dirs["llama"]).config, "float32", BS)
    cap = CAP_BLOCKS * (header_bytes(geometry) + geometry.full_block_bytes)
    events_cfg = config(replay_endpoint="tcp://127.0.0.1:*", encoding="array")
    specs = [
        EngineSpec("prefill", "pe", "n1"),
        EngineSpec("decode", "de", "n2", capacity_bytes=cap, kv_events=events_cfg),
    ]
    with engines_on_core(tiny_dirs["llama"], tmp_path, BS, specs) as (core, engines):
        de = engines["de"]
        assert not engines["pe"].kv_events.enabled and de.kv_events.enabled
        sub = Subscriber(de.kv_events.endpoint)
        try:
            sub.sync(de.kv_events)
            with running(*engines.values()):
                for i, prompt in enumerate(PROMPTS):
                    events = submit(core, f"r{i}", prompt, max_tokens=3)
                    wait_for(lambda: events and events[-1].kind in ("finished", "failed"), 60, f"r{i} to end")
                    assert events[-1].kind == "finished", events
            keys = [block_hashes(p, de.fingerprint, BS) for p in PROMPTS]
            wire = {wire_hash(k): k for ks in keys for k in ks}
            model_dir = tmp_path / "kv" / de.fingerprint.hex()
            on_disk = set(list_stored_keys(model_dir))
            evicted = {k for ks in keys for k in ks} - on_disk
            got = sub.events(
                lambda got: (
                    {h for e in got if e[0] == "BlockStored" for h in e[1]} == set(wire)
                    and {h for e in got if e[0] == "BlockRemoved" for h in e[1]} >= {wire_hash(k) for k in evicted}
                )
            )
            stored = [e for e in got if e[0] == "BlockStored"]
            for e in stored:
                tag, hashes, parent, tokens, block_size, lora_id, medium, lora_name = e
                assert (block_size, lora_id, medium, lora_name) == (BS, None, "DISK", None)
                p = next(i for i, ks in enumerate(keys) if wire[hashes[0]] in ks)
                at = keys[p].index(wire[hashes[0]])
                assert [wire[h] for h in hashes] == keys[p][at : at + len(hashes)]  # a run of the chain
                assert parent == (wire_hash(keys[p][at - 1]) if at else None)
                assert tokens == PROMPTS[p][at * BS : (at + len(hashes)) * BS]
            removed = {wire[h] for e in got if e[0] == "BlockRemoved" for h in e[1]}
            assert len(evicted) >= 3 * 5 - CAP_BLOCKS and removed >= evicted and not removed & on_disk
            monkeypatch.setattr(fs, "DIR_CHECK_S", 0.0)
            remove_stored(tmp_path / "kv", de.fingerprint, background=False)  # what the scheduler's flush does
            deadline = time.monotonic() + 5
            while not sub.sub.poll(50):  # the engine's next load reports count the store again
                assert time.monotonic() < deadline, "the flush was not published"
                de.storage.usage()
            assert sub.batch()[2][1] == [["AllBlocksCleared"]]
            replies = _replay(de.kv_events.replay_endpoint, 0)
            assert replies[0][1] == bytes(8) and replies[-1] == [b"", END_SEQ, b""]  # every batch from seq 0 on
        finally:
            sub.close()
    assert not de.kv_events._thread.is_alive()  # closed with the engine
