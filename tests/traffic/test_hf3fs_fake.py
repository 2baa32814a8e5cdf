"""The ``hf3fs`` storage backend against 3FS's documented USRBIO calls, through a fake of the ``hf3fs_fuse`` binding
and of its FUSE process (tests/support/fake_usrbio.py, installed here only): blocks written through the mount
read back byte-exact through iovecs and rings, every registered fd is deregistered, a failed io is a per-key
error, and damage is still caught by the checksums."""

import errno

import pytest
import torch

from dualpath.core.config import StorageConfig
from dualpath.core.errors import BlockCorruptError, ConfigError, StorageError
from dualpath.core.geometry import KVGeometry
from dualpath.traffic.storage import make_storage
from fake_usrbio import FakeUsrbio

GEOM = KVGeometry(num_layers=4, block_size=16, kv_elems_per_token=8, dtype="float32")  # 2 KiB a block
FP = bytes(range(16))


@pytest.fixture
def usrbio(tmp_path, monkeypatch):
    fake = FakeUsrbio(tmp_path / "3fs")
    fake.install(monkeypatch)
    return fake


def _store(root, threads: int = 2):
    return make_storage(StorageConfig(backend="hf3fs", root=str(root), io_threads=threads), GEOM, FP)


def _blocks(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (GEOM.full_block_bytes,), dtype=torch.uint8, generator=g) for _ in range(n)]


def _keys(n: int) -> list[bytes]:
    return [bytes([7]) + i.to_bytes(15, "little") for i in range(n)]


def test_blocks_read_through_usrbio_are_the_blocks_written(usrbio):
    s = _store(usrbio.mount / "kv")
    try:
        keys, blocks = _keys(6), _blocks(6)
        assert s.write(keys, blocks).result() == [None] * 6  # through the mount, as the fs backend writes
        out = [torch.zeros(GEOM.full_block_bytes, dtype=torch.uint8) for _ in keys]
        assert s.read(keys, out).result() == [None] * 6
        assert all(torch.equal(a, b) for a, b in zip(out, blocks))
        off, n = GEOM.layer_range(1, 3)
        part = [torch.zeros(n, dtype=torch.uint8) for _ in keys]
        assert s.read(keys, part, layers=(1, 3)).result() == [None] * 6
        assert all(torch.equal(p, b[off : off + n]) for p, b in zip(part, blocks))
    finally:
        s.close()
    # every byte came through USRBIO: per block read, its header then its layers, each a read io of the block's file
    assert len(usrbio.ios) == 2 * 2 * len(keys) and all(io["read"] for io in usrbio.ios)
    assert {io["path"] for io in usrbio.ios} == {str(s.path(k)) for k in keys}
    assert sorted({io["size"] for io in usrbio.ios}) == sorted({s.header_size, GEOM.full_block_bytes, n})
    assert not usrbio.registered  # each fd deregistered after its io (before it is closed)
    # one ring and one iovec per I/O thread, each iovec linked to the shared memory its ring stages into
    assert 1 <= len(usrbio.rings) == len(usrbio.iovecs) <= 2
    assert all(r.for_read and not r.queued and not r.done for r in usrbio.rings)


def test_a_failed_io_is_the_keys_error_and_leaves_no_fd_registered(usrbio):
    s = _store(usrbio.mount / "kv", threads=1)
    try:
        keys = _keys(2)
        assert s.write(keys, _blocks(2)).result() == [None] * 2
        usrbio.fail_reads = errno.EIO
        out = [torch.zeros(GEOM.full_block_bytes, dtype=torch.uint8) for _ in keys]
        results = s.read(keys, out).result()
        assert all(isinstance(r, StorageError) and "Input/output error" in str(r) for r in results), results
        assert not usrbio.registered
        usrbio.fail_reads = 0
        assert s.read(keys, out).result() == [None] * 2
        assert s.contains(keys) == [True, True]  # a failed io is not damage: the blocks stay
    finally:
        s.close()


def test_a_damaged_block_read_through_usrbio_fails_its_checksum_and_is_removed(usrbio):
    s = _store(usrbio.mount / "kv", threads=1)
    try:
        keys, blocks = _keys(2), _blocks(2, seed=3)
        assert s.write(keys, blocks).result() == [None] * 2
        path = s.path(keys[1])
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
        out = [torch.zeros(GEOM.full_block_bytes, dtype=torch.uint8) for _ in keys]
        results = s.read(keys, out).result()
        assert results[0] is None and torch.equal(out[0], blocks[0])
        assert isinstance(results[1], BlockCorruptError) and not path.exists()
        assert s.usage()["corrupt_removed"] == 1
    finally:
        s.close()


def test_a_store_off_a_3fs_mount_or_without_the_library_is_refused(usrbio, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="not on a 3FS mount"):
        _store(tmp_path / "elsewhere")
    monkeypatch.setitem(__import__("sys").modules, "hf3fs_fuse", None)
    with pytest.raises(ConfigError, match="3FS client library"):
        _store(usrbio.mount / "kv")
