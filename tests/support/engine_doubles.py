"""An in-process prefill engine on CPU with a shared-memory peer standing in for its decode engine (a buffer pool
and transport, no process): the prefill engine's loops driven directly in tests."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from dualpath.core.config import CacheConfig, EngineConfig, EngineProcessConfig, StorageConfig, TransportConfig
from dualpath.core.messages import EngineInfo, Role
from dualpath.traffic.buffer import BufferPool
from dualpath.traffic.transport import make_transport


def engine_config(role: str, model, tmp_path, block_size: int, **kw) -> EngineProcessConfig:
    """An engine of the tiny model on CPU, one thread, a small buffer, its KV store under ``tmp_path``."""
    cache = CacheConfig(block_size=block_size, **({"device_memory_bytes": 8 << 20} if role == "decode" else {}))
    base = dict(
        role=role,
        model=str(model),
        scheduler="127.0.0.1:1",
        engine_id=f"t-{role[0]}e",
        engine=EngineConfig(device="cpu", dtype="float32", cache=cache),
        transport=TransportConfig(name="shm"),
        storage=StorageConfig(root=str(tmp_path / "kv"), io_threads=1),
        buffer_bytes=4 << 20,
        torch_threads=1,
    )
    if role == "prefill":
        base.update(workspace_tokens=256, cost_model=(0.0, 1e-4, 0.0))
    return EngineProcessConfig(**{**base, **kw})


@dataclass
class DecodePeer:
    info: EngineInfo  # what an assignment names as its decode engine
    pool: BufferPool  # its buffer: allocate the slots the prefill engine writes


@contextmanager
def prefill_with_decode_peer(model, tmp_path, block_size: int):
    """``(prefill engine, decode peer)``; both closed after."""
    from dualpath.engines.prefill import PrefillEngine

    pe = PrefillEngine(engine_config("prefill", model, tmp_path, block_size))
    g = pe.geometry
    de_t = make_transport(TransportConfig(name="shm"), "t-de")
    try:
        de_mem = de_t.allocate(2 << 20)
        de_region = de_t.register(de_mem).region_id
        pool = BufferPool(g, (2 << 20) // g.full_block_bytes, de_mem)
        info = EngineInfo(
            "t-de",
            Role.DECODE,
            "n1",
            "127.0.0.1:1",
            "shm",
            de_t.address(),
            [r.to_dict() for r in de_t.regions()],
            de_region,
            pool.num_slots,
            g.block_size,
            g.num_layers,
            pe.fingerprint.hex(),
            0,
        )
        pe.transport.add_peer("t-de", de_t.address(), de_t.regions())
        yield pe, DecodePeer(info, pool)
    finally:
        pe.stopping.set()
        pe.stop()
        de_t.close()
