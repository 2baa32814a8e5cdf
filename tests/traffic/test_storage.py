"""The fs storage backend: round trips, every corrupt-input case, atomic concurrent writes, capacity, pacing."""

import os
import shutil
import subprocess
import threading
import time

import pytest
import torch

from dualpath.core.config import StorageConfig
from dualpath.core.errors import BlockCorruptError, BlockMissingError, StorageFullError
from dualpath.core.geometry import KVGeometry
from dualpath.core.paths import auto_store_capacity, parse_size
from dualpath.traffic.storage import ReadAccounting, make_storage
from dualpath.traffic.storage.fs import FsStorage, pack_header, remove_stored
from dualpath.scheduler.balance import drain_rate


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


GEOM = KVGeometry(num_layers=4, block_size=16, kv_elems_per_token=8, dtype="float32")  # 2 KiB a block
FP = bytes(range(16))


def store(tmp_path, **kw):
    return make_storage(StorageConfig(root=str(tmp_path), **kw), GEOM, FP)


def blocks(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (GEOM.full_block_bytes,), dtype=torch.uint8, generator=g) for _ in range(n)]


def keys(n, salt=0):
    return [bytes([salt]) + i.to_bytes(15, "little") for i in range(n)]


def empty(n, nbytes=GEOM.full_block_bytes):
    return [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(n)]


def test_round_trip_full_blocks_and_layer_ranges(tmp_path):
    s = store(tmp_path)
    ks, bs = keys(5), blocks(5)
    assert s.write(ks, bs).result() == [None] * 5
    out = empty(5)
    assert s.read(ks, out).result() == [None] * 5
    assert all(torch.equal(a, b) for a, b in zip(out, bs))
    off, n = GEOM.layer_range(1, 3)
    part = empty(5, n)
    assert s.read(ks, part, layers=(1, 3)).result() == [None] * 5
    assert all(torch.equal(p, b[off : off + n]) for p, b in zip(part, bs))
    assert s.contains(ks + keys(2, salt=9)) == [True] * 5 + [False] * 2
    assert sorted(s.list_keys()) == sorted(ks)
    assert s.write(ks[:1], bs[:1]).result() == [None]  # idempotent


def test_stored_blocks_are_readable_by_their_owner_only(tmp_path):
    """Stored KV holds users' prompts (issue 54: files were world-readable): block files 0600, directories 0700."""
    import stat

    s = store(tmp_path)
    assert s.write(keys(1), blocks(1)).result() == [None]
    path = s.path(keys(1)[0])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700 and stat.S_IMODE(s.dir.stat().st_mode) == 0o700


def test_missing_block_is_named(tmp_path):
    s = store(tmp_path)
    k = keys(1)[0]
    [err] = s.read([k], empty(1)).result()
    assert isinstance(err, BlockMissingError) and err.key == k and k.hex() in str(err)


def corrupt(tmp_path, mutate):
    s = store(tmp_path)
    k, b = keys(1)[0], blocks(1)[0]
    s.write([k], [b]).result()
    mutate(s.path(k), s)
    return s, k


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "case,match",
    [
        ("short", "short read"),
        ("data", "checksum mismatch in layer 2"),
        ("header", "header checksum|header does not match|not a DualPath"),
        ("magic", "not a DualPath KV block"),
        ("empty", "short header"),
    ],
)
def test_corrupt_blocks_raise_typed_errors(tmp_path, case, match):
    def mutate(path, s):
        if case == "short":
            path.write_bytes(path.read_bytes()[:-100])
        elif case == "data":
            _flip(path, s.header_size + 2 * GEOM.layer_block_bytes + 5)
        elif case == "header":
            _flip(path, 40)
        elif case == "magic":
            _flip(path, 0)
        elif case == "empty":
            path.write_bytes(b"")

    s, k = corrupt(tmp_path, mutate)
    [err] = s.read([k], empty(1)).result()
    assert isinstance(err, BlockCorruptError) and err.key == k
    assert __import__("re").search(match, str(err))


def test_layer_range_reads_only_its_layers(tmp_path):
    s, k = corrupt(tmp_path, lambda path, s: _flip(path, s.header_size + 3 * GEOM.layer_block_bytes + 1))
    assert s.read([k], empty(1, GEOM.layer_range(0, 3)[1]), layers=(0, 3)).result() == [None]
    assert isinstance(s.read([k], empty(1)).result()[0], BlockCorruptError)


def test_foreign_fingerprint_and_renamed_block_fail_closed(tmp_path):
    a = store(tmp_path)
    b = make_storage(StorageConfig(root=str(tmp_path)), GEOM, bytes(16))
    k, blk = keys(1)[0], blocks(1)[0]
    a.write([k], [blk]).result()
    b.path(k).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(a.path(k), b.path(k))
    [err] = b.read([k], empty(1)).result()
    assert isinstance(err, BlockCorruptError) and "another model" in str(err)
    other = keys(1, salt=5)[0]
    a.path(other).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(a.path(k), a.path(other))
    [err] = a.read([other], empty(1)).result()
    assert isinstance(err, BlockCorruptError) and "does not match its name" in str(err)


def _damage(path, s, case):
    if case == "layer":
        _flip(path, s.header_size + 2 * GEOM.layer_block_bytes + 5)
    elif case == "truncated":
        path.write_bytes(path.read_bytes()[: s.header_size + GEOM.layer_block_bytes])
    elif case == "fingerprint":  # the header's model fingerprint (after magic, version, sizes, layers, layer bytes)
        data = bytearray(path.read_bytes())
        data[20 : 20 + len(FP)] = bytes(len(FP))
        path.write_bytes(bytes(data))
    elif case == "empty":
        path.write_bytes(b"")


@pytest.mark.parametrize("case", ["layer", "truncated", "fingerprint", "empty"])
@pytest.mark.parametrize("layers", [None, (2, 3)])
def test_a_corrupt_block_is_removed_on_read_and_the_next_write_stores_it_again(tmp_path, case, layers):
    """A block that fails to load has its file removed, so the next engine that computes it stores it (a write skips
    a stored key: left in place, the damaged file would be recomputed on every later hit)."""
    s, k = corrupt(tmp_path, lambda path, s: _damage(path, s, case))
    b = blocks(1)[0]  # (what ``corrupt`` wrote)
    assert s.write([k], [b]).result() == [None] and s.contains([k]) == [True]  # skipped: the damaged file stays
    n = GEOM.layer_range(*layers)[1] if layers else GEOM.full_block_bytes
    [err] = s.read([k], empty(1, n), layers=layers).result()
    assert isinstance(err, BlockCorruptError) and err.key == k
    assert s.contains([k]) == [False] and not s.path(k).exists()
    assert s.usage()["corrupt_removed"] == 1 and s.usage()["used_bytes"] == 0
    assert isinstance(s.read([k], empty(1)).result()[0], BlockMissingError)  # removed once: now a plain miss
    assert s.usage()["corrupt_removed"] == 1
    assert s.write([k], [b]).result() == [None]
    out = empty(1)
    assert s.read([k], out).result() == [None] and torch.equal(out[0], b)
    assert s.usage()["used_bytes"] == s.file_bytes


def test_a_corrupt_file_replaced_by_a_new_copy_before_its_removal_is_kept(tmp_path):
    """The removal compares the file it read with the one the path names now: a good copy another writer renamed
    into place between the two is kept."""
    s, k = corrupt(tmp_path, lambda path, s: _flip(path, s.header_size + 1))
    path, b = s.path(k), blocks(1)[0]
    stale = os.stat(path)  # what the reader opened
    other = store(tmp_path)  # another writer: its temporary file is made while the damaged one exists (a new inode)
    other._write_file(path.with_name("new.tmp"), pack_header(GEOM, FP, k, b), b)
    os.rename(path.with_name("new.tmp"), path)
    assert os.stat(path).st_ino != stale.st_ino
    assert not s._remove_corrupt(k, stale, BlockCorruptError("stale", k))
    out = empty(1)
    assert s.read([k], out).result() == [None] and torch.equal(out[0], b)
    assert s.usage()["corrupt_removed"] == 0
    assert s._remove_corrupt(k, os.stat(path), BlockCorruptError("current", k))  # the file read: removed
    assert not path.exists() and s.usage()["corrupt_removed"] == 1


def test_a_block_of_a_newer_format_is_not_removed(tmp_path):
    """A file whose header has our magic and a later format version is a newer writer's block, not damage: it fails
    to load here but stays."""

    def newer(path, s):
        data = bytearray(path.read_bytes())
        data[4:6] = (99).to_bytes(2, "little")
        path.write_bytes(bytes(data))

    s, k = corrupt(tmp_path, newer)
    [err] = s.read([k], empty(1)).result()
    assert isinstance(err, BlockCorruptError) and "newer format" in str(err)
    assert s.path(k).exists() and s.usage()["corrupt_removed"] == 0


def test_a_corrupt_block_that_cannot_be_removed_is_said_once(tmp_path, monkeypatch, caplog):
    """(A read-only mount, say): every hit fails closed and is recomputed; the warning is not repeated on each."""
    from dualpath.traffic.storage import fs

    s, k = corrupt(tmp_path, lambda path, s: _flip(path, s.header_size + 1))

    def refuse(path):
        raise PermissionError(13, "read-only", str(path))

    monkeypatch.setattr(fs.os, "unlink", refuse)
    with caplog.at_level("WARNING", logger=fs.__name__):
        for _ in range(3):
            assert isinstance(s.read([k], empty(1)).result()[0], BlockCorruptError)
    assert s.path(k).exists() and s.usage()["corrupt_removed"] == 0
    assert len(caplog.records) == 1 and "cannot remove" in caplog.records[0].getMessage()


def test_concurrent_writers_of_one_block_leave_one_valid_file(tmp_path):
    k = keys(1)[0]
    versions = blocks(8, seed=3)
    stores = [store(tmp_path) for _ in range(8)]
    barrier = threading.Barrier(8)

    def writer(i):
        barrier.wait()
        stores[i]._write_one(k, versions[i])

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = empty(1)
    assert stores[0].read([k], out).result() == [None]
    assert any(torch.equal(out[0], v) for v in versions)
    leftovers = [p for p in stores[0].dir.rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == []


def test_removing_a_models_blocks_is_atomic_and_later_writes_store_again(tmp_path):
    """``remove_stored`` (a flush, and ``destroy`` after new weights): readers find each block whole or missing, a
    writer that kept its backend stores into a new directory, other models' blocks stay."""
    s, other = store(tmp_path), make_storage(StorageConfig(root=str(tmp_path)), GEOM, bytes(16))
    ks, bs = keys(6), blocks(6)
    assert s.write(ks, bs).result() == [None] * 6 and other.write(ks[:1], bs[:1]).result() == [None]
    assert remove_stored(tmp_path, FP, background=False) and not remove_stored(tmp_path, FP)
    assert s.contains(ks) == [False] * 6 and other.contains(ks[:1]) == [True]
    assert all(isinstance(e, BlockMissingError) for e in s.read(ks, empty(6)).result())
    assert s.write(ks[:2], bs[:2]).result() == [None, None]  # the directory is made again
    out = empty(2)
    assert s.read(ks[:2], out).result() == [None, None] and all(torch.equal(a, b) for a, b in zip(out, bs))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([FP.hex(), bytes(16).hex()])  # nothing aside left
    s.destroy()
    assert not (tmp_path / FP.hex()).exists() and other.contains(ks[:1]) == [True]


def test_a_store_whose_directory_was_removed_recounts_within_a_second_not_at_its_rescan(tmp_path):
    """Another process's flush (the scheduler's ``remove_stored``) replaces the model's directory: the engine's store
    sees that within ``DIR_CHECK_S`` and counts again, though its next rescan is a day away, so its reports (and the
    cap's evictions) stop counting the removed blocks."""
    from dualpath.traffic.storage.fs import DIR_CHECK_S

    s = store(tmp_path, rescan_s=86400.0)
    per_file = s.file_bytes
    s.write(keys(5), blocks(5)).result()
    assert s.usage()["used_bytes"] == 5 * per_file
    assert remove_stored(tmp_path, FP, background=False)
    used = []
    deadline = time.monotonic() + DIR_CHECK_S + 3
    while time.monotonic() < deadline and (not used or used[-1]):
        used.append(s.usage()["used_bytes"])
        time.sleep(0.05)
    assert used[0] == 5 * per_file and used[-1] == 0  # stale at first, then counted
    s.write(keys(2, salt=3), blocks(2)).result()  # a new directory: counted once more, from what it holds
    time.sleep(DIR_CHECK_S + 0.1)
    s.usage()
    time.sleep(0.2)
    assert s.usage()["used_bytes"] == 2 * per_file


def test_contains_over_ten_thousand_keys(tmp_path):
    s = store(tmp_path)
    small = KVGeometry(1, 1, 1, "float32")
    tiny = FsStorage(tmp_path / "tiny", small, FP, StorageConfig())
    present = keys(10_000)
    tiny.write(present, [torch.zeros(small.full_block_bytes, dtype=torch.uint8)] * 10_000).result()
    absent = keys(500, salt=7)
    t = time.perf_counter()
    got = tiny.contains(present + absent)
    assert got == [True] * 10_000 + [False] * 500
    assert time.perf_counter() - t < 10
    assert s.contains([]) == []


def test_full_disk_is_reported_not_raised(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24k", "tmpfs", str(mnt)], capture_output=True).returncode
        != 0
    ):
        pytest.skip("cannot mount a small tmpfs here")
    try:
        s = store(mnt)
        results = s.write(keys(10), blocks(10)).result()
        full = [e for e in results if e is not None]
        assert full and all(isinstance(e, StorageFullError) for e in full)
        assert not [p for p in s.dir.rglob("*.tmp")]
        ok = [k for k, e in zip(keys(10), results) if e is None]
        assert s.read(ok, empty(len(ok))).result() == [None] * len(ok)
    finally:
        subprocess.run(["umount", str(mnt)])


def test_capacity_evicts_least_recently_used(tmp_path):
    per_file = GEOM.full_block_bytes + 128
    s = store(tmp_path, capacity_bytes=6 * per_file)
    evicted = []
    s.set_evict_callback(evicted.extend)
    ks, bs = keys(7), blocks(7)
    for k, b in zip(ks[:6], bs[:6]):
        s.write([k], [b]).result()
        time.sleep(0.02)
    s.read([ks[0]], empty(1)).result()  # key 0 becomes the most recently used
    time.sleep(0.02)
    s.write([ks[6]], [bs[6]]).result()  # 7 blocks > 6: evict down to 90% of capacity (5 blocks)
    assert evicted == [ks[1], ks[2]]
    assert s.usage()["used_bytes"] == 5 * per_file
    assert s.contains(ks) == [True, False, False, True, True, True, True]


@pytest.mark.parametrize("rescan_s", [0.0, 1e9])
def test_writers_sharing_a_directory_hold_the_cap_together(tmp_path, rescan_s):
    """Two writers (two engines, or two nodes on one mount) under one cap of 10 blocks: recounting the directory,
    they keep it under the cap together; counting only their own writes (never recounting), they would store 20."""
    per_file = GEOM.full_block_bytes + 128
    a, b = (store(tmp_path, capacity_bytes=10 * per_file, rescan_s=rescan_s) for _ in range(2))
    on_disk = []
    for i, (k, blk) in enumerate(zip(keys(20), blocks(20))):
        (a if i % 2 else b).write([bytes([i % 2 + 1]) + k[1:]], [blk]).result()
        on_disk.append(sum(1 for _ in a.list_keys()))
        time.sleep(0.03)  # past the next count (20 x a count's time)
    if rescan_s == 0:
        assert max(on_disk) <= 10
        a.usage(), b.usage()  # each starts a count on its I/O pool, and answers at once
        time.sleep(0.2)
        assert a.usage()["used_bytes"] == b.usage()["used_bytes"] == on_disk[-1] * per_file
    else:
        assert on_disk[-1] == 20
    a.close()
    time.sleep(0.03)
    assert a.usage()["capacity_bytes"] == 10 * per_file  # a closed store still answers (an engine's last report)


def test_sizes_and_the_default_store_cap(tmp_path):
    assert parse_size("20G") == parse_size("20GB") == 20 * 10**9 and parse_size("512MiB") == 512 << 20
    assert parse_size("1000") == 1000 and parse_size("1.5T") == 1.5e12
    for bad in ("x", "-1", "20Q", ""):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)
    s = store(tmp_path)
    s.write(keys(4), blocks(4)).result()
    held = sum(f.stat().st_size for f in tmp_path.rglob("*.kv"))
    assert held == 4 * (GEOM.full_block_bytes + 128)
    cap = auto_store_capacity(tmp_path)
    assert abs(cap - (shutil.disk_usage(tmp_path).free + held) // 2) < 64 << 20  # other writers on the disk


def test_read_accounting_and_bandwidth_cap(tmp_path):
    acct = ReadAccounting(bandwidth_bps=200_000, bytes_per_token=GEOM.full_block_bytes / GEOM.block_size)
    s = FsStorage(tmp_path, GEOM, FP, StorageConfig(io_threads=4), acct)
    ks = keys(12)
    s.write(ks, blocks(12)).result()
    t = time.perf_counter()
    fut = s.read(ks, empty(12))
    time.sleep(0.02)
    assert acct.snapshot().queue_tokens > 0
    assert fut.result() == [None] * 12
    elapsed = time.perf_counter() - t
    expected = 12 * GEOM.full_block_bytes / 200_000  # ~0.49 s
    assert expected * 0.7 < elapsed < expected * 2 + 0.5
    snap = acct.snapshot()
    assert snap.queue_tokens == 0 and snap.completed_blocks == 12
    assert snap.completed_bytes == 12 * GEOM.full_block_bytes


def test_drain_intervals_measure_the_rate_reads_drain_at_not_the_idle_time_between(tmp_path):
    """Real reads through a 25 KB/s cap, in two bursts 0.4 s apart: two intervals while blocks waited for the cap,
    and the tokens read in them over their summed length is the cap's rate (the idle gap would nearly halve it)."""
    per_token = GEOM.full_block_bytes / GEOM.block_size
    acct = ReadAccounting(bandwidth_bps=25_000, bytes_per_token=per_token)
    s = FsStorage(tmp_path, GEOM, FP, StorageConfig(io_threads=4), acct)
    ks = keys(12)
    s.write(ks, blocks(12)).result()
    assert acct.drain_intervals() == []
    for part in (ks[:6], ks[6:]):  # each ~0.5 s at the cap
        assert s.read(part, empty(6)).result() == [None] * 6
        time.sleep(0.4)
    intervals = acct.drain_intervals()
    assert len(intervals) == 2  # (each burst's last reads finish once nothing waits: not counted)
    tokens, seconds = drain_rate(intervals)
    assert 0.75 * 25_000 < tokens * per_token / seconds < 1.3 * 25_000  # (each burst starts with 50 ms free)
    assert intervals[1][0] - intervals[0][1] >= 0.4


def test_drain_intervals_count_the_time_blocks_wait_and_the_tokens_read_meanwhile():
    """One I/O thread (the tests' clock): while blocks wait for it, each read it finishes counts; the last block's,
    read after nothing waits, does not, as the first started before the waiting: 1 token a second is the rate."""
    clock = Clock()
    acct = ReadAccounting(bytes_per_token=10.0, clock=clock)

    def burst(blocks, seconds, ok=True):
        acct.enqueue(blocks, 10 * blocks)
        for _ in range(blocks):
            acct.start(10)
            clock.t += seconds
            acct.finish(10, ok)

    burst(1, 1.0)  # a read that never waited for a thread: latency, no measure
    assert acct.drain_intervals() == []
    burst(3, 1.0)
    assert acct.drain_intervals() == [[1.0, 3.0, 2.0]]
    burst(2, 0.5, ok=False)  # failed reads finish no tokens: its waiting measured nothing
    assert acct.drain_intervals() == [[1.0, 3.0, 2.0]]
    acct.enqueue(2, 20)
    acct.start(10)
    clock.t += 0.5
    acct.finish(10)
    acct.start(10)  # nothing waits: the interval ends...
    clock.t += 0.002
    acct.enqueue(2, 20)  # ...and goes on, blocks waiting again within 5 ms
    acct.start(10)
    clock.t += 0.5
    acct.finish(10)
    assert acct.drain_intervals()[-1] == [5.0, 6.002, 2.0]  # waiting now: the open interval ends at the present
    acct.start(10)
    acct.finish(10)
    acct.finish(10)
    for _ in range(40):
        clock.t += 0.1
        burst(2, 0.01)
    intervals = acct.drain_intervals()  # the newest 32: merged, the old ones' idle gaps would count as reading
    assert len(intervals) == 32 and sum(t for *_, t in intervals) == 32
    assert abs(sum(e - s for s, e, _ in intervals) - 32 * 0.01) < 1e-9
    clock.t += 20
    assert acct.drain_intervals() == []
    acct.enqueue(2, 20)
    acct.start(10)
    clock.t += 30  # blocks waiting longer than the window are still reported
    acct.finish(10)
    assert acct.drain_intervals() == [[clock.t - 30, clock.t, 1.0]]


def resident_pages(path) -> int:
    """How many of the file's pages are in the page cache: mincore(2) over a read-only mapping of it."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    vec = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw)


def test_dropped_blocks_leave_the_page_cache_and_still_read_back(tmp_path):
    """The engine's read probe drops what it wrote before timing the read, so it measures the disk, not memory."""
    s, ks, bs = store(tmp_path), keys(3), blocks(3)
    s.write(ks, bs).result()
    paths = [s.path(k) for k in ks]
    if resident_pages(paths[0]) == 0:
        pytest.skip("this filesystem keeps no written pages in the page cache")
    s.drop_cached(ks[:2] + keys(1, salt=9))  # a key never written is passed over
    assert [resident_pages(p) for p in paths[:2]] == [0, 0]
    assert resident_pages(paths[2]) > 0
    out = empty(3)
    assert s.read(ks, out).result() == [None] * 3
    assert all(torch.equal(a, b) for a, b in zip(out, bs))


def test_the_engines_read_probe_times_reads_of_dropped_blocks(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import dualpath.traffic.storage
    from dualpath.engines.engine import Engine

    calls = []

    class Recording(FsStorage):
        def write(self, ks, bs):
            calls.append("write")
            return super().write(ks, bs)

        def drop_cached(self, ks):
            calls.append(("drop", len(ks)))
            super().drop_cached(ks)

        def read(self, ks, into, layers=None):
            calls.append(("read", len(ks)))
            return super().read(ks, into, layers)

    monkeypatch.setattr(dualpath.traffic.storage, "make_storage", lambda cfg, g, fp: Recording(tmp_path, g, fp, cfg))
    engine = SimpleNamespace(geometry=GEOM, cfg=SimpleNamespace(storage=StorageConfig(root=str(tmp_path))))
    assert Engine._measure_read_bps(engine, max_blocks=5) > 0
    assert calls == ["write", ("drop", 5), ("read", 5)]
    assert os.listdir(tmp_path) == []  # the probe's blocks are gone
