"""A free list of fixed-size slots (paged-cache blocks, DRAM buffer slots): every id is free or has one owner.

A used id may be shared (``share``; the paged cache's forked sequences hold their common prompt blocks once): it
counts its holders and returns to the free list when the last one frees it."""

from __future__ import annotations

from typing import Hashable

from dualpath.core.errors import OutOfBlocksError


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._owner: dict[int, Hashable] = {}
        self._extra: dict[int, int] = {}  # shared ids -> holders beyond the first

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

    def share(self, blocks: list[int]) -> None:
        """One more holder for each of ``blocks`` (used ids); each holder frees them once."""
        if any(b not in self._owner for b in blocks):
            raise ValueError("only used blocks can be shared")
        for b in blocks:
            self._extra[b] = self._extra.get(b, 0) + 1

    def holders(self, block: int) -> int:
        return (1 + self._extra.get(block, 0)) if block in self._owner else 0

    def free(self, blocks: list[int]) -> None:
        """One holder lets go of each of ``blocks``; an id with no holder left is free again."""
        if len(set(blocks)) != len(blocks) or any(b not in self._owner for b in blocks):
            raise ValueError(f"blocks {blocks} freed but not allocated (or twice)")
        for b in reversed(blocks):  # the next allocation gets them back in this order: runs stay runs
            if self._extra.get(b):
                self._extra[b] -= 1
                if not self._extra[b]:
                    del self._extra[b]
                continue
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
        if (
            len(free) != len(self._free)
            or free & self._owner.keys()
            or len(free) + len(self._owner) != self.num_blocks
            or not self._extra.keys() <= self._owner.keys()
        ):
            raise AssertionError(
                f"allocator corrupt: {len(self._free)} free, {len(self._owner)} used, {self.num_blocks} total"
            )
