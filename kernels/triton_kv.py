"""Triton kernels that move Layer Blocks between a paged cache layer and a contiguous buffer, for any block list:
transfers and storage writes then move one large contiguous piece instead of one piece per block.

A paged cache layer is ``[num_blocks, block_size, kv_elems]``, each block contiguous; the buffer is
``[n, block_size, kv_elems]``. One program copies ``CHUNK`` elements of one block.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096


@triton.jit
def _move_kernel(src_ptr, dst_ptr, ids_ptr, block_elems, GATHER: tl.constexpr, CHUNK: tl.constexpr):
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
    block_elems = src[0].numel()
    if not (src.is_contiguous() and dst.is_contiguous()) or src.dtype != dst.dtype:
        raise ValueError("block moves need contiguous tensors of one dtype")
    if len(block_ids):
        _move_kernel[(len(block_ids), triton.cdiv(block_elems, CHUNK))](src, dst, block_ids, block_elems,
                                                                        GATHER=gather, CHUNK=CHUNK)


def gather_blocks(cache_layer: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Blocks ``block_ids`` of ``cache_layer`` into ``out`` (``[n, block_size, kv_elems]``, made if not given)."""
    if out is None:
        out = cache_layer.new_empty(len(block_ids), *cache_layer.shape[1:])
    _launch(cache_layer, out, block_ids, gather=True)
    return out


def scatter_blocks(cache_layer: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """Inverse of ``gather_blocks``: ``blocks[i]`` into block ``block_ids[i]`` (ids distinct)."""
    _launch(blocks.to(cache_layer.dtype).contiguous(), cache_layer, block_ids, gather=False)
