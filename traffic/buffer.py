"""The DRAM buffer of an engine: a registered arena of Full Block slots.

Storage reads land here, and peers read and write Layer Blocks here. The arena is host memory the engine's
transport can expose to peers (shared memory for ``shm``) and page-locked when CUDA is present. Slots are
allocated per owner (a request id) so a leak names the request that leaked.
"""
from __future__ import annotations

import threading
from typing import Hashable

import torch

from dualpath.allocator import BlockAllocator
from dualpath.geometry import FullBlockSlots, KVGeometry
from traffic.memory import HostMemory


class BufferPool:
    def __init__(self, geometry: KVGeometry, num_slots: int, memory: HostMemory):
        layout = FullBlockSlots(geometry, num_slots)
        if memory.nbytes < layout.nbytes:
            raise ValueError(f"buffer memory of {memory.nbytes} bytes cannot hold {num_slots} Full Blocks")
        self.geometry, self.layout, self.memory = geometry, layout, memory
        self.allocator = BlockAllocator(num_slots)
        self._lock = threading.Lock()  # request threads allocate while storage callbacks free

    @property
    def num_slots(self) -> int:
        return self.layout.num_slots

    @property
    def num_free(self) -> int:
        with self._lock:
            return self.allocator.num_free

    def allocate(self, n: int, owner: Hashable) -> list[int]:
        with self._lock:
            return self.allocator.allocate(n, owner)

    def free(self, slots: list[int]) -> None:
        with self._lock:
            self.allocator.free(slots)

    def free_owner(self, owner: Hashable) -> int:
        with self._lock:
            slots = self.allocator.owned_by(owner)
            self.allocator.free(slots)
            return len(slots)

    def slot_bytes(self, slot: int) -> torch.Tensor:
        """The Full Block bytes of ``slot`` (a view)."""
        fb = self.geometry.full_block_bytes
        return self.memory.tensor[slot * fb:(slot + 1) * fb]

    def full_blocks(self, slots: list[int]) -> torch.Tensor:
        """The Full Block bytes of ``slots`` ``[len(slots), full_block_bytes]``, gathered in the given order into a
        fresh tensor."""
        fb = self.geometry.full_block_bytes
        whole = self.memory.tensor[:self.layout.nbytes].view(self.num_slots, fb)
        return whole.index_select(0, torch.as_tensor(slots, dtype=torch.long))

    def layer_rows(self, slots: list[int], layer: int) -> torch.Tensor:
        """Token rows ``[len(slots) × block_size, kv_elems]`` of ``layer`` in ``slots``, gathered in the given order
        into a fresh tensor."""
        g = self.geometry
        lb = g.layer_block_bytes
        dtype = getattr(torch, g.dtype)
        parts = [self.memory.tensor[self.layout.offset(s, layer):self.layout.offset(s, layer) + lb] for s in slots]
        flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        return flat.view(dtype).view(len(slots) * g.block_size, g.kv_elems_per_token)

    def check(self) -> None:
        with self._lock:
            self.allocator.check()

    def leaks(self) -> dict[Hashable, list[int]]:
        """Owners still holding slots (call when nothing should be in flight)."""
        with self._lock:
            return self.allocator.owners()
