"""Moving KV between a paged cache, per-sequence token tensors, Layer Blocks and Full Block bytes.

A paged cache layer is ``[num_blocks, block_size, kv_elems]``: block ``b`` of that layer is one Layer Block,
contiguous. Full Block byte layout comes from ``dualpath.core.geometry.KVGeometry``; these functions only view it.

A cache may hold KV in a narrower dtype than the model computes in (8-bit floats): ``to_cache`` is the one place
values become the cache's, ``as_cached`` gives rows as the cache would hold them, in the model's dtype, and moves
between tensors of one cache dtype are byte copies.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dualpath.core.geometry import KVGeometry


FP8 = torch.float8_e4m3fn  # the 8-bit float of FP8 caches and weights
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the cache's ``dtype``: 8-bit floats saturate at their largest finite value (a large key stays
    large, never NaN), with scale 1 (vLLM's default KV scale)."""
    if x.dtype == dtype:
        return x
    if dtype.itemsize == 1:
        x = x.clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)


def as_cached(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``rows`` as a cache of ``dtype`` holds them, back in their own dtype: attention reads a batch's new rows
    this way, so a token's output is the same whether its keys were computed in this forward or loaded."""
    return rows if rows.dtype == dtype else to_cache(rows, dtype).to(rows.dtype)


def _index_copy(dst: torch.Tensor, ids: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[ids[i]] = src[i]`` along dim 0, ``src`` already in ``dst``'s dtype, as bytes (CPU torch has no
    ``index_copy_`` for 8-bit floats)."""
    dst.view(torch.uint8).index_copy_(0, ids, src.contiguous().view(torch.uint8))


def gather_tokens(cache_layer: torch.Tensor, block_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` tokens of a sequence whose blocks are ``block_ids``: ``[num_tokens, kv_elems]``."""
    if num_tokens == 0:
        return cache_layer.new_empty(0, cache_layer.shape[-1])
    block_size = cache_layer.shape[1]
    nb = -(-num_tokens // block_size)
    return cache_layer[block_ids[:nb]].reshape(-1, cache_layer.shape[-1])[:num_tokens]


def write_tokens(cache_layer: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, backend: str = "torch") -> None:
    """Write token rows ``kv [T, kv_elems]`` into flat slots ``block × block_size + offset``."""
    if backend == "triton":
        from dualpath.kernels import triton_kv

        rows = cache_layer.view(-1, cache_layer.shape[-1])  # rows as pieces
        return triton_kv.scatter_blocks(rows, slots, to_cache(kv, cache_layer.dtype).contiguous())
    _index_copy(cache_layer.view(-1, cache_layer.shape[-1]), slots, to_cache(kv, cache_layer.dtype))


def gather_blocks(cache_layer: torch.Tensor, block_ids: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """Layer Blocks of ``block_ids`` as one contiguous ``[n, block_size, kv_elems]`` tensor."""
    if backend == "triton":
        from dualpath.kernels import triton_kv

        return triton_kv.gather_blocks(cache_layer, block_ids)
    return cache_layer.index_select(0, block_ids)


def scatter_blocks(
    cache_layer: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor, backend: str = "torch"
) -> None:
    """Inverse of ``gather_blocks``."""
    if backend == "triton":
        from dualpath.kernels import triton_kv

        return triton_kv.scatter_blocks(cache_layer, block_ids, to_cache(blocks, cache_layer.dtype).contiguous())
    _index_copy(cache_layer, block_ids, to_cache(blocks, cache_layer.dtype))


def cache_dtype(geom: KVGeometry) -> torch.dtype:
    """The torch dtype of ``geom``'s KV elements."""
    return getattr(torch, geom.dtype)


def full_block_view(buf: torch.Tensor, geom: KVGeometry) -> torch.Tensor:
    """View raw bytes ``[n, full_block_bytes]`` (uint8) as ``[n, layers, block_size, kv_elems]``."""
    n = buf.numel() // geom.full_block_bytes
    return buf.view(cache_dtype(geom)).view(n, geom.num_layers, *geom.layer_block_shape)


def pack_full_blocks(layer_kv: Sequence[torch.Tensor], geom: KVGeometry) -> torch.Tensor:
    """Full Block bytes ``[n, full_block_bytes]`` (uint8) from per-layer token KV ``[n × block_size, kv_elems]``.

    Only whole blocks are packed: the caller passes a multiple of ``block_size`` tokens.
    """
    n_tokens = layer_kv[0].shape[0]
    if n_tokens % geom.block_size or len(layer_kv) != geom.num_layers:
        raise ValueError(f"need {geom.num_layers} layers of whole blocks, got {len(layer_kv)} x {n_tokens} tokens")
    n = n_tokens // geom.block_size
    stacked = torch.stack([to_cache(kv, cache_dtype(geom)).reshape(n, *geom.layer_block_shape) for kv in layer_kv], 1)
    return stacked.contiguous().view(torch.uint8).view(n, geom.full_block_bytes)


def layer_tokens_from_full(buf: torch.Tensor, layer: int, geom: KVGeometry) -> torch.Tensor:
    """One layer's token KV ``[n × block_size, kv_elems]`` out of Full Block bytes ``[n, full_block_bytes]``."""
    return full_block_view(buf, geom)[:, layer].reshape(-1, geom.kv_elems_per_token)


def cache_to_full_blocks(storage: torch.Tensor, block_ids: torch.Tensor, geom: KVGeometry) -> torch.Tensor:
    """Full Block bytes ``[n, full_block_bytes]`` (uint8, on the cache's device) of blocks ``block_ids`` of a
    layer-major paged cache ``storage [layers, num_blocks, block_size, kv_elems]``: one gather over every layer,
    then each block's layers side by side (not a gather and a host copy per layer)."""
    n = block_ids.numel()
    return (
        storage.index_select(1, block_ids).transpose(0, 1).contiguous().view(torch.uint8).view(n, geom.full_block_bytes)
    )


def full_blocks_to_cache(
    storage: torch.Tensor, block_ids: torch.Tensor, full: torch.Tensor, geom: KVGeometry, backend: str = "torch"
) -> None:
    """Inverse of ``cache_to_full_blocks``: Full Block bytes ``[n, full_block_bytes]`` (host or device) into blocks
    ``block_ids`` of every layer, in one copy to the cache's device."""
    layers = full_block_view(full.to(storage.device), geom).transpose(0, 1).contiguous()
    for layer in range(geom.num_layers):
        scatter_blocks(storage[layer], block_ids, layers[layer], backend)
