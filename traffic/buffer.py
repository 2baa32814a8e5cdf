"""The DRAM buffer of an engine: a registered arena of Full Block slots.

Storage reads land here, and peers read and write Layer Blocks here. The arena is host memory the engine's
transport can expose to peers (shared memory for ``shm``) and page-locked when CUDA is present. Slots are
allocated per owner (a request id) so a leak names the request that leaked.
"""

from __future__ import annotations

import threading
from typing import Callable, Hashable

import torch

from dualpath.core.allocator import BlockAllocator
from dualpath.core.errors import OutOfBlocksError
from dualpath.core.geometry import FullBlockSlots, KVGeometry
from dualpath.traffic.memory import HostMemory
from dualpath.traffic.strided_copy import copy_rows, slot_runs


class BufferPool:
    def __init__(self, geometry: KVGeometry, num_slots: int, memory: HostMemory):
        layout = FullBlockSlots(geometry, num_slots)
        if memory.nbytes < layout.nbytes:
            raise ValueError(f"buffer memory of {memory.nbytes} bytes cannot hold {num_slots} Full Blocks")
        self.geometry, self.layout, self.memory = geometry, layout, memory
        self.allocator = BlockAllocator(num_slots)
        self._lock = threading.Condition()  # request threads allocate (and wait) while storage callbacks free
        # frees up to k slots held for later (prefetched session KV) when a request needs them; called with the
        # lock held (re-entrant), before a request waits
        self.reclaimer: Callable[[int], int] | None = None
        self.waiting = 0  # requests waiting for slots
        self.freed = 0  # slots freed so far: whether the buffer moves (``allocate_while_moving``)

    @property
    def num_slots(self) -> int:
        return self.layout.num_slots

    @property
    def num_free(self) -> int:
        with self._lock:
            return self.allocator.num_free

    def allocate(self, n: int, owner: Hashable, wait_s: float = 0.0, reclaim: bool = True) -> list[int]:
        """``n`` slots for ``owner``; takes slots held for later first (``reclaimer``, unless not ``reclaim``), then
        waits up to ``wait_s`` for others to free theirs (requests in flight free theirs as their KV moves on), then
        raises ``OutOfBlocksError`` — at once if the arena is smaller."""
        with self._lock:
            if reclaim and self.reclaimer is not None and self.allocator.num_free < n:
                self.reclaimer(n - self.allocator.num_free)
            if n <= self.num_slots and self.allocator.num_free < n and wait_s > 0:
                self.waiting += 1  # (slots held for later are not taken while a request waits)
                try:
                    self._lock.wait_for(lambda: self.allocator.num_free >= n, timeout=wait_s)
                finally:
                    self.waiting -= 1
            return self.allocator.allocate(n, owner)

    def allocate_while_moving(
        self, n: int, owner: Hashable, window_s: float, go_on: Callable[[], bool] = lambda: True
    ) -> list[int]:
        """``allocate`` for work that would rather queue than fail: it waits ``window_s`` at a time for as long as
        each window freed some slot (the work ahead is moving on) and ``go_on()``. Raises ``OutOfBlocksError`` when
        a whole window freed nothing (a stuck buffer is an error, not a hang), ``go_on()`` is False, or ``n`` exceeds
        the arena."""
        while True:
            freed = self.freed
            try:
                return self.allocate(n, owner, window_s)
            except OutOfBlocksError:
                if n > self.num_slots or self.freed == freed or not go_on():
                    raise

    def free(self, slots: list[int]) -> None:
        with self._lock:
            self.allocator.free(slots)
            self.freed += len(slots)
            self._lock.notify_all()

    def free_owner(self, owner: Hashable) -> int:
        with self._lock:
            slots = self.allocator.owned_by(owner)
            self.allocator.free(slots)
            self.freed += len(slots)
            self._lock.notify_all()
            return len(slots)

    def slot_bytes(self, slot: int) -> torch.Tensor:
        """The Full Block bytes of ``slot`` (a view)."""
        fb = self.geometry.full_block_bytes
        return self.memory.tensor[slot * fb : (slot + 1) * fb]

    def full_blocks(self, slots: list[int]) -> torch.Tensor:
        """The Full Block bytes of ``slots`` ``[len(slots), full_block_bytes]``, gathered in the given order into a
        fresh tensor."""
        fb = self.geometry.full_block_bytes
        whole = self.memory.tensor[: self.layout.nbytes].view(self.num_slots, fb)
        return whole.index_select(0, torch.as_tensor(slots, dtype=torch.long))

    def layer_to_device(
        self, slots: list[int], layer: int, out: torch.Tensor, stream: "torch.cuda.Stream | None" = None
    ) -> None:
        """Copy ``layer`` of ``slots`` into ``out`` (contiguous ``[len(slots) × block_size, kv_elems]``, any device),
        one strided copy per run of consecutive slots (``dualpath.traffic.strided_copy``); on CUDA issued on ``stream``
        from pinned memory, without blocking the host. The caller orders ``stream`` after whatever last used
        ``out`` on another stream (``LayerCopies`` does, by slot events): the copies do not wait for it."""
        self._move_layer(slots, layer, out, to_host=False, stream=stream)

    def layer_from_device(self, slots: list[int], layer: int, rows: torch.Tensor) -> None:
        """Inverse of ``layer_to_device``: whole blocks of token rows into ``layer`` of ``slots``; done on return."""
        self._move_layer(slots, layer, rows.contiguous(), to_host=True)

    def _move_layer(
        self,
        slots: list[int],
        layer: int,
        tensor: torch.Tensor,
        to_host: bool,
        stream: "torch.cuda.Stream | None" = None,
    ) -> None:
        g = self.geometry
        if not tensor.is_contiguous() or tensor.numel() * tensor.element_size() != len(slots) * g.layer_block_bytes:
            raise ValueError(
                f"{len(slots)} Layer Blocks need a contiguous tensor of {len(slots) * g.layer_block_bytes}"
                f" bytes, got {tuple(tensor.shape)} {tensor.dtype}"
            )
        flat = tensor.view(torch.uint8).reshape(len(slots), g.layer_block_bytes)
        for i, first, n in slot_runs(slots):
            copy_rows(
                self.memory, self.layout.offset(first, layer), g.full_block_bytes, flat[i : i + n], to_host, stream
            )

    def check(self) -> None:
        with self._lock:
            self.allocator.check()

    def leaks(self) -> dict[Hashable, list[int]]:
        """Owners still holding slots (call when nothing should be in flight)."""
        with self._lock:
            return self.allocator.owners()
