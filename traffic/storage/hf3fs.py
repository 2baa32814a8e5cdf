"""``hf3fs``: the ``fs`` file format on a 3FS mount, with reads through 3FS USRBIO (``hf3fs_fuse.io``).

USRBIO reads go through an I/O ring straight into shared memory registered with the 3FS FUSE process (an
"iovec"), bypassing FUSE's request size limits. Each reader thread owns one staging iovec and ring. Writes go
through the FUSE mount (the ``fs`` path), which 3FS serves well for whole-file writes. This backend is built only
where the 3FS client library is importable; elsewhere choosing it is a ``ConfigError`` — the ``fs`` backend on
the 3FS FUSE mount is the portable route.
"""

from __future__ import annotations

import datetime
import os
import threading
from pathlib import Path

import torch

from dualpath.core.config import StorageConfig
from dualpath.core.errors import ConfigError, StorageError
from dualpath.core.geometry import BlockHash, KVGeometry
from dualpath.traffic.memory import HostMemory
from dualpath.traffic.storage.accounting import ReadAccounting
from dualpath.traffic.storage.fs import FsStorage


def _usrbio():
    try:
        from hf3fs_fuse import io as h3io
    except ImportError as e:
        raise ConfigError(
            f"the hf3fs backend needs the 3FS client library (hf3fs_fuse), not installed here "
            f"({e}); use --kv-store on the 3FS FUSE mount with the fs backend instead"
        ) from None
    return h3io


class _Ring:
    """One thread's USRBIO state: a staging iovec over our own shared memory, and a read ring."""

    def __init__(self, mount: str, nbytes: int):
        h3io = _usrbio()
        self.mem = HostMemory(nbytes, shared=True)
        self.iov = h3io.make_iovec(_ShmName(self.mem), mount, 0, -1)
        self.ring = h3io.make_ioring(mount, 64, True, 0)


class _ShmName:
    """What ``make_iovec`` reads from a SharedMemory: its name (the FUSE process maps ``/dev/shm/<name>``) and its
    buffer (the iovec the binding builds wraps it)."""

    def __init__(self, mem: HostMemory):
        self.name, self.size, self.buf = mem.name, mem.nbytes, mem.tensor.numpy()


class Hf3fsStorage(FsStorage):
    def __init__(
        self,
        root: Path,
        geometry: KVGeometry,
        fingerprint: BlockHash,
        config: StorageConfig,
        accounting: ReadAccounting | None = None,
    ):
        h3io = _usrbio()
        super().__init__(root, geometry, fingerprint, config, accounting)
        self.mount = h3io.extract_mount_point(str(self.dir))
        if not self.mount:
            raise ConfigError(f"{self.dir} is not on a 3FS mount")
        self._local = threading.local()

    def _ring(self) -> _Ring:
        ring = getattr(self._local, "ring", None)
        if ring is None:
            ring = self._local.ring = _Ring(self.mount, self.file_bytes)
        return ring

    def _pread(self, fd: int, buffers: list, offset: int) -> int:
        """USRBIO read of the bytes ``buffers`` want, staged in this thread's iovec, then copied out."""
        h3io = _usrbio()
        ring = self._ring()
        want = sum(memoryview(b).nbytes for b in buffers)
        h3io.register_fd(fd)
        try:
            ring.ring.prepare(ring.iov[:want], True, fd, offset)
            results = ring.ring.submit().wait(min_results=1, timeout=datetime.timedelta(seconds=30))
        finally:
            h3io.deregister_fd(fd)
        got = results[0].result if results else -1
        if got < 0:
            raise StorageError(f"3FS USRBIO read failed: {os.strerror(-got)}")
        pos = 0
        for b in buffers:
            view = torch.frombuffer(memoryview(b).cast("B"), dtype=torch.uint8)
            n = min(view.numel(), max(0, got - pos))
            view[:n].copy_(ring.mem.tensor[pos : pos + n])
            pos += view.numel()
        if got > want:  # the client misbehaved, not the file (a corrupt block's file is removed: this one stays)
            raise StorageError("3FS returned more bytes than asked")
        return got
