"""Paged KV cache in device memory: per layer ``[num_blocks, block_size, kv_elems]``, with block tables.

Block ``b`` of layer ``l`` is one Layer Block (``dualpath.core.geometry``), so moving a block to or from a Full
Block never needs a layout change. The allocator and the tables are the only owners of block ids.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Hashable

import numpy as np
import torch

from dualpath.core.allocator import BlockAllocator
from dualpath.core.geometry import KVGeometry
from dualpath.kernels.kv_move import cache_dtype, write_tokens


class PagedKVCache:
    """KV of many sequences in fixed-size blocks; a sequence's tokens live in the blocks of its table, in order."""

    def __init__(self, geometry: KVGeometry, num_blocks: int, device: str | torch.device = "cpu"):
        self.geometry = geometry
        self.device = torch.device(device)
        # One tensor, layer-major, so the whole cache is one registrable region (``LayerMajorBlocks`` layout).
        self.storage = torch.zeros(
            geometry.num_layers,
            num_blocks,
            *geometry.layer_block_shape,
            dtype=cache_dtype(geometry),
            device=self.device,
        )
        self.layers = list(self.storage.unbind(0))
        self.allocator = BlockAllocator(num_blocks)
        self._tables: dict[Hashable, list[int]] = {}
        # copies one block's every layer into another (a fork); a tensor-parallel engine's copies it on every rank
        self.copier: Callable[[int, int], None] = self._copy_block

    def _copy_block(self, src: int, dst: int) -> None:
        self.storage[:, dst].copy_(self.storage[:, src])

    @staticmethod
    def blocks_for_memory(geometry: KVGeometry, memory_bytes: int) -> int:
        return max(1, memory_bytes // geometry.full_block_bytes)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def num_free_tokens(self) -> int:
        return self.allocator.num_free * self.geometry.block_size

    def blocks_needed(self, seq: Hashable, num_tokens: int) -> int:
        """More blocks ``seq`` needs to hold ``num_tokens`` tokens in total."""
        return max(0, self.geometry.num_blocks(num_tokens) - len(self._tables.get(seq, ())))

    def reserve(self, seq: Hashable, num_tokens: int) -> None:
        """Grow ``seq``'s table to hold ``num_tokens`` tokens in total."""
        need = self.blocks_needed(seq, num_tokens)
        table = self._tables.setdefault(seq, [])
        if need:
            table.extend(self.allocator.allocate(need))

    def fork_blocks_needed(self, child: Hashable, shared_tokens: int, num_tokens: int) -> int:
        """More blocks of its own a fork at ``shared_tokens`` needs to hold ``num_tokens`` tokens in total."""
        return self.blocks_needed(child, self._own_tokens(shared_tokens, num_tokens))

    def reserve_fork(self, child: Hashable, shared_tokens: int, num_tokens: int) -> None:
        """Reserve ``child``'s own blocks before it forks (``fork``): all it needs for ``num_tokens`` tokens but
        the full blocks it will share."""
        self.reserve(child, self._own_tokens(shared_tokens, num_tokens))

    def _own_tokens(self, shared_tokens: int, num_tokens: int) -> int:
        return num_tokens - shared_tokens // self.geometry.block_size * self.geometry.block_size

    def fork(self, parent: Hashable, child: Hashable, shared_tokens: int) -> None:
        """``child`` continues ``parent``'s first ``shared_tokens`` tokens (their KV written): it shares the full
        blocks holding them and gets a copy of the partial one in its first own block (reserved by ``reserve_fork``,
        else allocated here). Raises ``OutOfBlocksError`` if that block is needed and none is free."""
        full, partial = divmod(shared_tokens, self.geometry.block_size)
        table = self._tables[parent]
        own = self._tables.get(child) or []
        if partial and not own:
            own = self.allocator.allocate(1)
        if partial:  # every layer at once: the cache is one layer-major tensor
            self.copier(table[full], own[0])
        self.allocator.share(table[:full])
        self._tables[child] = table[:full] + own

    def free(self, seq: Hashable) -> None:
        self.allocator.free(self._tables.pop(seq, []))

    def block_table(self, seq: Hashable) -> list[int]:
        return self._tables[seq]

    def slots(self, seq: Hashable, start: int, n: int) -> list[int]:
        """Flat slot indices (``block × block_size + offset``) of token positions ``[start, start + n)``, on the
        host: callers gather a batch's slots and copy them to the device once. Plain Python: a decode step asks for
        one slot per sequence, where array set-up would cost more than the answer."""
        bs, table, out = self.geometry.block_size, self._tables[seq], []
        pos, end = start, start + n
        while pos < end:
            block, offset = divmod(pos, bs)
            take = min(bs - offset, end - pos)
            first = table[block] * bs + offset
            out.extend(range(first, first + take))
            pos += take
        return out

    def block_tables(self, seqs: list[Hashable]) -> torch.Tensor:
        """Block tables of ``seqs`` as one ``[B, max_blocks]`` tensor, short rows padded with block 0."""
        return torch.from_numpy(self.padded_tables(seqs)).to(self.device)

    def padded_tables(self, seqs: list[Hashable]) -> np.ndarray:
        """``block_tables`` on the host (int64)."""
        tables = [self._tables[s] for s in seqs]
        out = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
        for row, t in zip(out, tables):
            row[: len(t)] = t
        return out

    def write(self, layer: int, slots: torch.Tensor, kv: torch.Tensor, backend: str = "torch") -> None:
        """New token rows ``kv`` into their ``slots`` of ``layer``; ``backend``: the model's kernels."""
        write_tokens(self.layers[layer], slots, kv, backend)

    def check(self) -> None:
        """Integrity: every used block is in as many tables as it has holders, and no free block is in one."""
        self.allocator.check()
        held = Counter(b for t in self._tables.values() for b in t)
        if set(held) != self.allocator.used or any(self.allocator.holders(b) != k for b, k in held.items()):
            raise AssertionError("block tables and allocator disagree")
