"""``fs``: one file per Full Block under a root directory (local disk, or a shared mount: 3FS FUSE, Lustre,
GPFS, NFS).

File: ``<root>/<fingerprint>/<hash[:2]>/<hash>.kv`` = a header (magic, format version, header size, layer count,
bytes per layer, model fingerprint, block hash, an xxh3-64 checksum per layer, and a checksum of the header itself),
then the Layer Blocks, layer-major. A layer range is read with one ``preadv`` of exactly those bytes, straight into
the caller's buffer, and verified by the per-layer checksums. Writes go to a temporary file that is renamed into
place, so readers see a whole block or none, and concurrent writers of one block leave one valid file. A write of a
block whose file exists is skipped, so a block found corrupt on read (short, a bad header, a failed checksum) has
its file removed there and then (if its path still names the file read: a copy another writer renamed into place
meanwhile stays), and the next engine that computes the block stores it again: damage costs one recompute, not a
recompute on every later hit. Past ``capacity_bytes``, the least recently used blocks are evicted (reads touch their
file's mtime, so the order holds across processes sharing the directory). Other processes write to the directory too
(every decode engine of a node; every node on a shared mount), so the count of stored blocks is refreshed from the
directory every ``rescan_s`` (and never more than 5% of the time): the cap holds to within what the other writers
store in that interval, where counting only this process's writes would let the store grow to the capacity times the
number of writers.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Sequence

import torch
import xxhash

from dualpath.core.config import StorageConfig
from dualpath.core.errors import BlockCorruptError, BlockMissingError, StorageError, StorageFullError
from dualpath.core.faults import failpoint
from dualpath.core.geometry import HASH_BYTES, BlockHash, KVGeometry
from dualpath.traffic.storage.accounting import ReadAccounting
from dualpath.traffic.storage.pins import pinned_keys
from dualpath.traffic.storage.base import Results, StorageBackend

log = logging.getLogger(__name__)

MAGIC = b"DPKV"
FORMAT_VERSION = 1
WARNED_KEYS = 4096  # corrupt blocks that could not be removed, remembered as logged (then forgotten all at once)
DIR_CHECK_S = 1.0  # how often a store looks whether its model directory was replaced (a flush: recount at once)
_HEAD = struct.Struct(f"<4sHHIQ{HASH_BYTES}s{HASH_BYTES}s")  # magic, version, header bytes, layers, layer bytes,
# fingerprint, key; then one u64 checksum per layer, then a u64 checksum of everything before it.


class _NewerFormatError(BlockCorruptError):
    """A block file of a later ``FORMAT_VERSION`` (a newer DualPath sharing the store): unreadable here, not
    damaged, so it is not removed."""


def layer_checksums(block: torch.Tensor, layer_bytes: int) -> list[int]:
    """xxh3-64 of each consecutive ``layer_bytes`` run of a host uint8 tensor."""
    arr = block.numpy()
    return [xxhash.xxh3_64_intdigest(arr[i : i + layer_bytes]) for i in range(0, arr.size, layer_bytes)]


def header_bytes(geometry: KVGeometry) -> int:
    n = _HEAD.size + 8 * geometry.num_layers + 8
    return -(-n // 64) * 64


def pack_header(geometry: KVGeometry, fingerprint: BlockHash, key: BlockHash, block: torch.Tensor) -> bytes:
    lb, size = geometry.layer_block_bytes, header_bytes(geometry)
    sums = layer_checksums(block, lb)
    body = _HEAD.pack(MAGIC, FORMAT_VERSION, size, geometry.num_layers, lb, fingerprint, key) + struct.pack(
        f"<{len(sums)}Q", *sums
    )
    body += struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    return body.ljust(size, b"\0")


class FsStorage(StorageBackend):
    def __init__(
        self,
        root: Path,
        geometry: KVGeometry,
        fingerprint: BlockHash,
        config: StorageConfig,
        accounting: ReadAccounting | None = None,
    ):
        self.geometry, self.fingerprint, self.config = geometry, fingerprint, config
        self.dir = Path(root) / fingerprint.hex()
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.accounting = accounting or ReadAccounting(
            config.read_bandwidth_bps, geometry.full_block_bytes / geometry.block_size
        )
        self.header_size = header_bytes(geometry)
        self.file_bytes = self.header_size + geometry.full_block_bytes
        self._pool = ThreadPoolExecutor(config.io_threads or 2 * (os.cpu_count() or 1), thread_name_prefix="kv-io")
        self._lock = threading.Lock()
        self._on_evict = self._on_corrupt = self._on_cleared = None
        self.corrupt_removed = 0  # block files this store found corrupt on read and removed (to be stored again)
        self._warned: set[BlockHash] = set()  # corrupt blocks that could not be removed, logged once
        self._used, self._next_count, self._counting = 0, 0.0, True
        self._counted_dir, self._dir_checked_at = None, 0.0  # the directory the count is of (st_dev, st_ino)
        self._count()

    # --- paths ----------------------------------------------------------------------------------------------
    def path(self, key: BlockHash) -> Path:
        h = key.hex()
        return self.dir / h[:2] / f"{h}.kv"

    def contains(self, keys: Sequence[BlockHash]) -> list[bool]:
        return [self.path(k).is_file() for k in keys]

    def list_keys(self) -> Iterator[BlockHash]:
        return list_stored_keys(self.dir)

    def usage(self) -> dict:
        """The last count of the directory plus this process's writes since (a count that is due runs on the I/O
        pool: the caller, an engine's load report, does not wait for it)."""
        if self._count_due():
            try:
                self._pool.submit(self._count)
            except RuntimeError:  # closed (an engine's last report): the count stands
                self._counted(self._used, time.monotonic(), self._counted_dir)
        with self._lock:
            used = self._used
            removed = self.corrupt_removed
        return {
            "used_bytes": used,
            "capacity_bytes": self.config.capacity_bytes,
            "num_blocks": used // self.file_bytes,
            "corrupt_removed": removed,
        }

    def _count_due(self) -> bool:
        """Claims the next count if one is due (one at a time): every ``rescan_s``, or at once when the model's
        directory is another than the one counted (``remove_stored`` renamed it away: the count is of nothing)."""
        with self._lock:
            now = time.monotonic()
            if self._counting or (now < self._next_count and not self._dir_replaced(now)):
                return False
            self._counting = True
            return True

    def _dir_replaced(self, now: float) -> bool:
        if now < self._dir_checked_at + DIR_CHECK_S:
            return False
        self._dir_checked_at = now
        return _dir_identity(self.dir) != self._counted_dir

    def _count(self) -> None:
        """Count the stored blocks (the caller claimed the count)."""
        start, where = time.monotonic(), _dir_identity(self.dir)
        n = 0
        try:
            n = sum(1 for _ in self.list_keys())
        finally:
            self._counted(n * self.file_bytes, start, where)

    def _counted(self, used: int, start: float, where: tuple[int, int] | None) -> None:
        now = time.monotonic()
        with self._lock:
            replaced = self._counted_dir is not None and where != self._counted_dir  # (flushed: every block went)
            self._used, self._counting = used, False
            self._counted_dir = where
            self._next_count = now + max(self.config.rescan_s, 20 * (now - start))
        if replaced and self._on_cleared:
            self._on_cleared()

    # --- reads ----------------------------------------------------------------------------------------------
    def read(
        self, keys: Sequence[BlockHash], into: Sequence[torch.Tensor], layers: tuple[int, int] | None = None
    ) -> "Future[Results]":
        first, last = layers if layers is not None else (0, self.geometry.num_layers)
        offset, nbytes = self.geometry.layer_range(first, last)
        for t in into:
            if t.numel() != nbytes or t.dtype != torch.uint8 or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"read destinations must be contiguous host uint8 tensors of {nbytes} bytes")
        self.accounting.enqueue(len(keys), nbytes * len(keys))
        # One task per I/O thread, each reading its share of the blocks in order: per-block tasks cost more in
        # scheduling than a page-cache read of a block takes.
        groups = _split(list(zip(keys, into)), self._pool._max_workers)
        futures = [
            self._pool.submit(lambda g: [self._read_one(k, t, first, last, offset) for k, t in g], g) for g in groups
        ]
        return _gather(futures, flatten=True)

    def _read_one(self, key: BlockHash, dest: torch.Tensor, first: int, last: int, offset: int):
        nbytes = dest.numel()
        self.accounting.start(nbytes)
        error = None
        try:
            self._read_block(key, dest, first, last, offset)
        except StorageError as e:
            error = e
        except OSError as e:
            error = StorageError(f"block {key.hex()}: {e}", key)
        self.accounting.finish(nbytes, ok=error is None)
        return error

    def _read_block(self, key: BlockHash, dest: torch.Tensor, first: int, last: int, offset: int) -> None:
        failpoint("storage.read")
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise BlockMissingError(f"block {key.hex()} is not in storage", key) from None
        try:
            try:
                header = bytearray(self.header_size)
                if self._pread(fd, [header], 0) != self.header_size:
                    raise BlockCorruptError(f"block {key.hex()}: short header", key)
                sums = self._check_header(key, bytes(header))
                got = self._pread(fd, [dest.numpy()], self.header_size + offset)
                if got != dest.numel():
                    raise BlockCorruptError(f"block {key.hex()}: short read ({got} of {dest.numel()} bytes)", key)
                for layer, got_sum in zip(range(first, last), layer_checksums(dest, self.geometry.layer_block_bytes)):
                    if got_sum != sums[layer]:
                        raise BlockCorruptError(f"block {key.hex()}: checksum mismatch in layer {layer}", key)
            except _NewerFormatError:
                raise  # another writer's block, not a damaged one: left in place
            except BlockCorruptError as e:
                # while ``fd`` is open its inode cannot be reused: the identity compared is the file read
                self._remove_corrupt(key, os.fstat(fd), e)
                raise
        finally:
            os.close(fd)
        try:
            os.utime(path)  # recency for LRU eviction, seen by every process sharing the directory
        except OSError:
            pass

    def _remove_corrupt(self, key: BlockHash, read: os.stat_result, error: BlockCorruptError) -> bool:
        """Remove the block file ``read`` (the ``fstat`` of the file that failed to load) if the block's path still
        names it, so the next engine that computes the block stores it again (a write skips a block whose file
        exists: left in place, a damaged file would be recomputed on every later hit, never repaired). A path that
        names another file now (another writer renamed a new copy into place) is left alone. Whether it removed it.
        A check-then-unlink, not atomic: a copy renamed into place between the two is removed too (a miss, which
        is recomputed and stored again), never served wrong."""
        path = self.path(key)
        try:
            now = os.stat(path)
            if (now.st_dev, now.st_ino) != (read.st_dev, read.st_ino):
                log.debug("block %s: a new copy replaced the corrupt file; kept", key.hex())
                return False
            os.unlink(path)
        except FileNotFoundError:
            return False  # another reader removed it first
        except OSError as e:  # (a read-only mount): said once per block, not on every hit
            if self._warn_once(key):
                log.warning("%s; cannot remove it (%s): it is recomputed on every hit until removed", error, e)
            return False
        with self._lock:
            self._used = max(0, self._used - self.file_bytes)
            self.corrupt_removed += 1
        log.warning("%s; removed, so the next engine that computes the block stores it again", error)
        if self._on_corrupt:
            self._on_corrupt([key])
        return True

    def _warn_once(self, key: BlockHash) -> bool:
        with self._lock:
            if key in self._warned:
                return False
            if len(self._warned) >= WARNED_KEYS:
                self._warned.clear()
            self._warned.add(key)
            return True

    @staticmethod
    def _pread(fd: int, buffers: list, offset: int) -> int:
        """Fill ``buffers`` from ``offset``; returns bytes read (short at end of file)."""
        views = [memoryview(b).cast("B") for b in buffers]
        total, want = 0, sum(v.nbytes for v in views)
        while total < want:
            n = os.preadv(fd, _tail(views, total), offset + total)
            if n == 0:
                break
            total += n
        return total

    def _check_header(self, key: BlockHash, header: bytes) -> tuple[int, ...]:
        g = self.geometry
        magic, version, size, layers, lb, fp, stored_key = _HEAD.unpack_from(header)
        if magic == MAGIC and version > FORMAT_VERSION:
            raise _NewerFormatError(f"block {key.hex()}: written in a newer format ({version})", key)
        if magic != MAGIC or version != FORMAT_VERSION:
            raise BlockCorruptError(f"block {key.hex()}: not a DualPath KV block (format {version})", key)
        if fp != self.fingerprint:
            raise BlockCorruptError(f"block {key.hex()}: stored by another model (fingerprint {fp.hex()})", key)
        if stored_key != key or size != self.header_size or layers != g.num_layers or lb != g.layer_block_bytes:
            raise BlockCorruptError(f"block {key.hex()}: header does not match its name or geometry", key)
        end = _HEAD.size + 8 * layers
        if struct.unpack_from("<Q", header, end)[0] != xxhash.xxh3_64_intdigest(header[:end]):
            raise BlockCorruptError(f"block {key.hex()}: header checksum mismatch", key)
        return struct.unpack_from(f"<{layers}Q", header, _HEAD.size)

    # --- writes ---------------------------------------------------------------------------------------------
    def write(self, keys: Sequence[BlockHash], blocks: Sequence[torch.Tensor]) -> "Future[Results]":
        for b in blocks:
            if b.numel() != self.geometry.full_block_bytes or b.dtype != torch.uint8 or b.device.type != "cpu":
                raise ValueError(f"blocks must be host uint8 tensors of {self.geometry.full_block_bytes} bytes")
        return _gather([self._pool.submit(self._write_one, k, b) for k, b in zip(keys, blocks)])

    def _write_one(self, key: BlockHash, block: torch.Tensor) -> StorageError | None:
        path = self.path(key)
        if path.exists():
            return None
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(
                mode=0o700, parents=True, exist_ok=True
            )  # the model's directory too, after ``remove_stored``
            self._write_file(tmp, pack_header(self.geometry, self.fingerprint, key, block), block)
            os.rename(tmp, path)
        except OSError as e:
            _unlink(tmp)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                return StorageFullError(f"block {key.hex()}: storage is full ({e.strerror})", key)
            return StorageError(f"block {key.hex()}: write failed: {e}", key)
        with self._lock:
            self._used += self.file_bytes
        if self.config.capacity_bytes and self._count_due():
            self._count()
        with self._lock:
            over = self.config.capacity_bytes and self._used > self.config.capacity_bytes
        if over:
            self._evict()
        return None

    def _write_file(self, path: Path, header: bytes, block: torch.Tensor) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # users' prompts: for the cluster's user only
        try:
            data = [memoryview(header), memoryview(block.numpy())]
            written, want = 0, len(header) + block.numel()
            while written < want:
                written += os.pwritev(fd, _tail(data, written), written)
            if self.config.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def drop_cached(self, keys: Sequence[BlockHash]) -> None:
        for key in keys:
            try:
                fd = os.open(self.path(key), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)  # the kernel drops clean pages only
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass  # e.g. a filesystem without fadvise: the probe then measures what the cache gives
            finally:
                os.close(fd)

    def _evict(self) -> None:
        """Rescan (other processes write here too) and remove least recently used blocks to 90% of capacity."""
        with self._lock:
            entries = []
            for key in self.list_keys():
                try:
                    entries.append((self.path(key).stat().st_mtime, key))
                except FileNotFoundError:
                    continue
            self._used = len(entries) * self.file_bytes
            target = int(self.config.capacity_bytes * 0.9)
            evicted, pinned = [], pinned_keys(self.dir)  # agent sessions' TTLs (dualpath.traffic.storage.pins)
            for _, key in sorted(entries):
                if self._used <= target:
                    break
                if key in pinned:
                    continue
                _unlink(self.path(key))
                self._used -= self.file_bytes
                evicted.append(key)
        if evicted:
            log.info("evicted %d blocks to stay under %d bytes", len(evicted), self.config.capacity_bytes)
            if self._on_evict:
                self._on_evict(evicted)

    def delete(self, keys: Sequence[BlockHash]) -> "Future[Results]":
        def one(key):
            if _unlink(self.path(key)):
                with self._lock:
                    self._used -= self.file_bytes
            return None

        return _gather([self._pool.submit(one, k) for k in keys])

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def destroy(self) -> None:
        self.close()
        remove_stored(self.dir.parent, self.fingerprint, background=False)


def remove_stored(root: Path, fingerprint: BlockHash, background: bool = True) -> bool:
    """Remove every block stored under ``root`` for the model ``fingerprint``; whether there were any. The model's
    directory is renamed aside first (one atomic step: a reader finds each block whole or missing, and writes after
    it start a new directory), then deleted, on a thread of its own with ``background``."""
    model_dir = Path(root) / fingerprint.hex()
    aside = model_dir.with_name(f".{model_dir.name}.removing.{os.getpid()}.{time.monotonic_ns()}")
    try:
        os.rename(model_dir, aside)
    except FileNotFoundError:
        return False
    if background:
        threading.Thread(
            target=shutil.rmtree, args=(aside,), kwargs={"ignore_errors": True}, daemon=True, name="kv-remove"
        ).start()
    else:
        shutil.rmtree(aside, ignore_errors=True)
    return True


def _dir_identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def list_stored_keys(model_dir: Path) -> Iterator[BlockHash]:
    """Keys of the blocks stored under ``<root>/<fingerprint>`` (what an index is rebuilt from)."""
    if not os.path.isdir(model_dir):
        return
    for sub in os.scandir(model_dir):
        if sub.is_dir() and len(sub.name) == 2:
            for f in os.scandir(sub.path):
                if f.name.endswith(".kv") and len(f.name) == 2 * HASH_BYTES + 3:
                    yield bytes.fromhex(f.name[:-3])


def _tail(buffers: list[memoryview], skip: int) -> list[memoryview]:
    out = []
    for b in buffers:
        if skip >= b.nbytes:
            skip -= b.nbytes
            continue
        out.append(b[skip:])
        skip = 0
    return out


def _unlink(path: Path) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _split(items: list, n: int) -> list[list]:
    """``items`` in at most ``n`` contiguous groups of near-equal size."""
    n = max(1, min(n, len(items)))
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (i < extra)
        out.append(items[start:end])
        start = end
    return out


def _gather(futures: list[Future], flatten: bool = False) -> "Future[Results]":
    """One future resolving to every future's result, in order (concatenated when ``flatten``)."""
    out: Future = Future()
    if not futures:
        out.set_result([])
        return out
    remaining = [len(futures)]
    lock = threading.Lock()

    def done(_):
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            try:
                results = [f.result() for f in futures]
                out.set_result([r for group in results for r in group] if flatten else results)
            except BaseException as e:  # noqa: BLE001 - an unexpected bug in a worker
                out.set_exception(e)

    for f in futures:
        f.add_done_callback(done)
    return out
