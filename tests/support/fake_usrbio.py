"""A fake of 3FS's USRBIO Python binding (``hf3fs_fuse.io``) and of the FUSE process behind it, for tests on
machines without 3FS. Never the default: a test installs it in ``sys.modules`` (``FakeUsrbio.install``).

It follows the documented calls (3FS's ``hf3fs_fuse/io.py``, ``src/lib/py/usrbio_binding.cc``,
``src/lib/api/UsrbIo.md``) and checks what they require:
- ``extract_mount_point(path)``: the mount a path is on, else None;
- ``register_fd(fd, flags=0)`` / ``deregister_fd(fd)``: only a file of the mount can be registered, a registered
  fd not again before it is deregistered, and only registered fds can be used;
- ``make_iovec(shm, mount, block_size=0, numa=-1)``: reads ``shm.name`` and ``shm.buf`` (a SharedMemory's), links
  ``<mount>/3fs-virt/iovs/<uuid>`` to ``/dev/shm/<name>`` (the FUSE process maps the memory through that link)
  and wraps ``buf``; sliced (step 1) it addresses part of that memory;
- ``make_ioring(mount, entries, for_read=True, io_depth=0, ...)``; ``prepare(iov, read, fd, off, userdata=None)``
  (``read`` must be the ring's direction, at most ``entries`` queued); ``submit()`` returns the ring;
  ``wait(*, max_results=0, min_results=0, timeout=None)`` (keywords only, a ``timedelta``) returns the completed
  iovs, each with ``result``: bytes read, or ``-errno``.
The fake FUSE process reads the file at the io's offset and writes the bytes into the shared memory through the
iovec's link, so what the caller finds in its buffer is what the link names. ``fail_reads`` (an errno) fails the
next reads with it."""

from __future__ import annotations

import datetime
import errno
import os
import sys
import types
import uuid
from pathlib import Path


class _Iov:
    """An ``iovec`` (or a slice of one): ``size`` bytes at ``base_off`` of its base iovec's memory."""

    def __init__(self, fake: "FakeUsrbio", mount: str, link: str, buf: memoryview, base_off: int = 0, size=None):
        self.fake, self.mount, self.link, self.buf = fake, mount, link, buf
        self.base_off, self.size = base_off, buf.nbytes - base_off if size is None else size
        self.result, self.userdata = 0, None

    def __getitem__(self, key: slice) -> "_Iov":
        start, stop, step = key.indices(self.size)
        if step != 1:
            raise ValueError("step not 1 when slicing iovec")
        return _Iov(self.fake, self.mount, self.link, self.buf, self.base_off + start, max(0, stop - start))


class _IovecWrapper:
    """``hf3fs_fuse.io.iovec``: the binding's iovec and its link."""

    def __init__(self, iov: _Iov, link: str):
        self.iov, self.link = iov, link

    def __getitem__(self, key):
        return self.iov[key]


class _Ioring:
    def __init__(self, fake: "FakeUsrbio", mount: str, entries: int, for_read: bool):
        self.fake, self.mount, self.entries, self.for_read = fake, mount, entries, for_read
        self.queued: list[tuple[_Iov, int, int]] = []
        self.done: list[_Iov] = []

    def prepare(self, iov, read, fd, off, userdata=None):
        if isinstance(iov, _IovecWrapper):
            iov = iov.iov
        if not isinstance(iov, _Iov) or iov.mount != self.mount:
            raise TypeError("prepare needs an iovec of this ring's mount")
        if bool(read) != self.for_read:
            raise OSError(errno.EINVAL, "the io's direction is not the ring's")
        if fd not in self.fake.registered:
            raise OSError(errno.EBADF, f"fd {fd} is not registered")
        if len(self.queued) + len(self.done) >= self.entries:
            raise OSError(errno.EAGAIN, "the ring is full")
        iov.userdata = userdata
        self.queued.append((iov, fd, off))
        self.fake.ios.append({"read": bool(read), "path": self.fake.path_of(fd), "off": off, "size": iov.size})
        return self

    def submit(self):
        """The FUSE process runs what is queued: each read lands in the shared memory the iovec's link names."""
        for iov, fd, off in self.queued:
            iov.result = self.fake._serve(iov, fd, off)
            self.done.append(iov)
        self.queued = []
        return self

    def wait(self, *, max_results=0, min_results=0, timeout=None):
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            raise TypeError("timeout is a datetime.timedelta (microseconds) or None")
        want = max(max_results, min_results) or len(self.done)
        if len(self.done) < min_results:
            raise OSError(errno.ETIMEDOUT, "wait timed out")
        out, self.done = self.done[:want], self.done[want:]
        return out


class _IoringWrapper:
    """``hf3fs_fuse.io.ioring``."""

    def __init__(self, ior: _Ioring):
        self.ior = ior

    def prepare(self, iov, *args, **kwargs):
        return self.ior.prepare(iov.iov if isinstance(iov, _IovecWrapper) else iov, *args, **kwargs)

    def submit(self):
        return self.ior.submit()

    def wait(self, *args, **kwargs):
        return self.ior.wait(*args, **kwargs)


class FakeUsrbio:
    """A 3FS mount at ``mount`` (a directory with ``3fs-virt/iovs``) and the ``hf3fs_fuse`` package over it."""

    def __init__(self, mount: Path):
        self.mount = Path(mount)
        (self.mount / "3fs-virt" / "iovs").mkdir(parents=True, exist_ok=True)
        self.registered: set[int] = set()
        self.iovecs: list[tuple[str, str]] = []  # (link, the shared memory's name) of every iovec made
        self.rings: list[_Ioring] = []
        self.ios: list[dict] = []  # every io prepared
        self.fail_reads = 0  # an errno: the next reads fail with it (0: none)
        io = types.ModuleType("hf3fs_fuse.io")
        io.extract_mount_point = self.extract_mount_point
        io.register_fd = self.register_fd
        io.deregister_fd = self.deregister_fd
        io.make_iovec = self.make_iovec
        io.make_ioring = self.make_ioring
        io.iovec, io.ioring = _IovecWrapper, _IoringWrapper
        self.io = io
        self.package = types.ModuleType("hf3fs_fuse")
        self.package.io = io

    def install(self, monkeypatch) -> None:
        monkeypatch.setitem(sys.modules, "hf3fs_fuse", self.package)
        monkeypatch.setitem(sys.modules, "hf3fs_fuse.io", self.io)

    # --- the binding ----------------------------------------------------------------------------------------
    def extract_mount_point(self, path: str) -> str | None:
        p = Path(os.path.abspath(path))
        return str(self.mount) if p == self.mount or self.mount in p.parents else None

    def register_fd(self, fd: int, flags: int = 0) -> None:
        if self.extract_mount_point(self.path_of(fd)) is None:
            raise OSError(errno.EINVAL, f"fd {fd} is not a file of a 3FS mount")
        if fd in self.registered:
            raise OSError(errno.EEXIST, f"fd {fd} is already registered")
        self.registered.add(fd)

    def deregister_fd(self, fd: int) -> None:
        self.registered.discard(fd)

    def make_iovec(self, shm, hf3fs_mount_point, block_size=0, numa=-1):
        if str(hf3fs_mount_point) != str(self.mount):
            raise OSError(errno.EINVAL, f"{hf3fs_mount_point} is not a 3FS mount")
        target = os.path.normpath(f"/dev/shm/{shm.name}")
        link = f"{hf3fs_mount_point}/3fs-virt/iovs/{uuid.uuid4()}{f'.b{block_size}' if block_size > 0 else ''}"
        os.symlink(target, link)
        buf = memoryview(shm.buf).cast("B")
        if os.stat(link).st_size < buf.nbytes:  # the FUSE process maps the memory through the link
            raise OSError(errno.EINVAL, f"{target} is smaller than the iovec's buffer")
        self.iovecs.append((link, shm.name))
        return _IovecWrapper(_Iov(self, str(hf3fs_mount_point), link, buf), link)

    def make_ioring(
        self, hf3fs_mount_point, entries, for_read=True, io_depth=0, priority=None, timeout=None, numa=-1, flags=0
    ):
        if str(hf3fs_mount_point) != str(self.mount):
            raise OSError(errno.EINVAL, f"{hf3fs_mount_point} is not a 3FS mount")
        ring = _Ioring(self, str(hf3fs_mount_point), entries, for_read)
        self.rings.append(ring)
        return _IoringWrapper(ring)

    # --- the FUSE process ------------------------------------------------------------------------------------
    @staticmethod
    def path_of(fd: int) -> str:
        return os.readlink(f"/proc/self/fd/{fd}")

    def _serve(self, iov: _Iov, fd: int, off: int) -> int:
        if self.fail_reads:
            return -self.fail_reads
        try:
            data = os.pread(fd, iov.size, off)
            shm = os.open(iov.link, os.O_RDWR)  # the memory as the FUSE process sees it
            try:
                os.pwrite(shm, data, iov.base_off)
            finally:
                os.close(shm)
        except OSError as e:
            return -e.errno
        return len(data)
