"""Host memory that transfers can address.

Private memory is an anonymous mapping; shared memory is a file under ``/dev/shm`` that a peer process on the
same host maps by name (the ``shm`` transport and 3FS USRBIO both need that). On CUDA hosts the mapping can be
page-locked so host <-> device copies run at full speed. Everything is exposed as a flat ``uint8`` torch tensor,
so one copy routine moves bytes between any two places, host or device.
"""

from __future__ import annotations

import mmap
import os
import secrets

import torch

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "dualpath-"  # + "<creator pid>-<12 hex digits>"


def remove_segments(pid: int) -> int:
    """Unlink the shared segments a process created, once it is gone: a killed engine cannot unlink its own, and
    each leaked one keeps its bytes in RAM until reboot. Its supervisor, which knows the pid is dead, calls this.
    Returns how many were removed."""
    removed = 0
    for name in os.listdir(SHM_DIR):
        if name.startswith(f"{SEGMENT_PREFIX}{pid}-"):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed += 1
            except FileNotFoundError:
                pass
    return removed


class HostMemory:
    """``nbytes`` of page-aligned host memory, optionally shared by name and/or pinned."""

    def __init__(self, nbytes: int, shared: bool = False, pin: bool = False, name: str | None = None):
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        self.nbytes = nbytes
        self.owner = True
        self.name: str | None = None
        if shared:
            self.name = name or f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
            fd = os.open(os.path.join(SHM_DIR, self.name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, nbytes)
                self._mmap = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)
        else:
            self._mmap = mmap.mmap(-1, nbytes)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.pinned = pin and self._pin()

    @classmethod
    def attach(cls, name: str, nbytes: int) -> "HostMemory":
        """Map a peer's shared memory by name (this process does not own it: closing only unmaps)."""
        self = cls.__new__(cls)
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            if os.fstat(fd).st_size < nbytes:
                raise ValueError(f"shared memory {name} is smaller than {nbytes} bytes")
            self._mmap = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.nbytes, self.owner, self.name, self.pinned = nbytes, False, name, False
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        return self

    def _pin(self) -> bool:
        if not torch.cuda.is_available():
            return False
        err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
        return int(err) == 0

    @property
    def address(self) -> int:
        return self.tensor.data_ptr()

    def close(self) -> None:
        if self._mmap is None:
            return
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        del self.tensor
        try:
            self._mmap.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes when it does
            pass
        self._mmap = None
        if self.owner and self.name:
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat ``uint8`` view (no copy)."""
    if not t.is_contiguous():
        raise ValueError("only contiguous tensors can be registered for transfers")
    return t.view(torch.uint8).reshape(-1) if t.numel() else t.new_empty(0, dtype=torch.uint8)
