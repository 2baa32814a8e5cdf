"""A Triton kernel that moves pieces of a paged cache layer ``[num_blocks, block_size, kv_elems]`` by index:

- Layer Blocks between the cache and a contiguous buffer ``[n, block_size, kv_elems]``, for any block list, so
  transfers and storage writes move one large contiguous piece instead of one piece per block;
- a forward's new token rows into their cache slots, every layer (a row is a piece of the layer viewed as
  ``[slots, kv_elems]``: whole-row copies, where ``index_copy_`` computes an offset per element).

One program copies up to ``CHUNK`` elements of one piece.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


CHUNK = 4096


@triton.jit
def _move_kernel(src_ptr, dst_ptr, ids_ptr, block_elems, GATHER: tl.constexpr, CHUNK: tl.constexpr):
    """Piece ``i`` of the buffer from (``GATHER``) or to piece ``ids[i]`` of the cache, chunk ``c``."""
    i, c = tl.program_id(0), tl.program_id(1)
    block = tl.load(ids_ptr + i).to(tl.int64)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ok = offs < block_elems
    if GATHER:
        src, dst = src_ptr + block * block_elems, dst_ptr + i.to(tl.int64) * block_elems
    else:
        src, dst = src_ptr + i.to(tl.int64) * block_elems, dst_ptr + block * block_elems
    tl.store(dst + offs, tl.load(src + offs, mask=ok), mask=ok)


def _launch(src: torch.Tensor, dst: torch.Tensor, block_ids: torch.Tensor, gather: bool) -> None:
    block_elems = math.prod(src.shape[1:])
    if not (src.is_contiguous() and dst.is_contiguous()) or src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
        raise ValueError(
            f"cannot move pieces {tuple(src.shape)} -> {tuple(dst.shape)} ({src.dtype} -> {dst.dtype}):"
            " moves need contiguous tensors of one dtype and piece shape"
        )
    if src.element_size() == 1:  # 8-bit floats move as bytes (no float8 type needed on older GPUs)
        src, dst = src.view(torch.uint8), dst.view(torch.uint8)
    if len(block_ids):
        chunk = min(CHUNK, triton.next_power_of_2(block_elems))  # a 512-element row: 512, not 4096 mostly masked
        _move_kernel[(len(block_ids), triton.cdiv(block_elems, chunk))](
            src, dst, block_ids, block_elems, GATHER=gather, CHUNK=chunk
        )


def gather_blocks(cache_layer: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Blocks ``block_ids`` of ``cache_layer`` into ``out`` (``[n, block_size, kv_elems]``, made if not given)."""
    if out is None:
        out = cache_layer.new_empty(len(block_ids), *cache_layer.shape[1:])
    _launch(cache_layer, out, block_ids, gather=True)
    return out


def scatter_blocks(cache_layer: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """Inverse of ``gather_blocks``: ``blocks[i]`` into block ``block_ids[i]`` (ids distinct), ``blocks`` contiguous
    and already the cache's values (``dualpath.kernels.kv_move.to_cache``, which the callers in ``kv_move`` apply:
    this module stays below it)."""
    if blocks.dtype != cache_layer.dtype or not blocks.is_contiguous():
        raise ValueError(f"blocks must be contiguous {cache_layer.dtype} (to_cache first), not {blocks.dtype}")
    _launch(blocks, cache_layer, block_ids, gather=False)
