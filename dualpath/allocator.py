"""A free list of fixed-size slots (paged-cache blocks, DRAM buffer slots): every id is free or has one owner."""
from __future__ import annotations

from typing import Hashable

from dualpath.errors import OutOfBlocksError


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._owner: dict[int, Hashable] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> set[int]:
        return set(self._owner)

    def allocate(self, n: int, owner: Hashable = None) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} blocks, {len(self._free)} free of {self.num_blocks}")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._owner[b] = owner
        return out

    def free(self, blocks: list[int]) -> None:
        for i, b in enumerate(blocks):
            if b not in self._owner or b in blocks[:i]:
                raise ValueError(f"block {b} freed but not allocated")
        for b in reversed(blocks):  # the next allocation gets them back in this order: runs stay runs
            del self._owner[b]
            self._free.append(b)

    def owned_by(self, owner: Hashable) -> list[int]:
        return [b for b, o in self._owner.items() if o == owner]

    def owners(self) -> dict[Hashable, list[int]]:
        out: dict[Hashable, list[int]] = {}
        for b, o in self._owner.items():
            out.setdefault(o, []).append(b)
        return out

    def check(self) -> None:
        """Raise if any id is lost, duplicated or both free and used."""
        free = set(self._free)
        if len(free) != len(self._free) or free & self._owner.keys() or \
                len(free) + len(self._owner) != self.num_blocks:
            raise AssertionError(f"allocator corrupt: {len(self._free)} free, {len(self._owner)} used, "
                                 f"{self.num_blocks} total")
