"""How much device memory a paged KV cache takes (``CacheConfig``): a size given in bytes or blocks, or, left at 0,
vLLM's rule on CUDA: the engine's share of the device (``gpu_memory_utilization`` of it) less what the engine
already holds (weights, workspace) and the activations of its largest forward, measured by running one. On a CPU
the automatic size is ``CPU_CACHE_BYTES``: host memory is shared with everything else there.
"""

from __future__ import annotations

import gc
import logging

import torch

from dualpath.core.config import CacheConfig
from dualpath.core.errors import ConfigError
from dualpath.core.geometry import KVGeometry
from dualpath.engines.kv_cache import PagedKVCache
from dualpath.engines.models.base import CausalLM, ForwardBatch
from dualpath.kernels.attention import PagedKV

log = logging.getLogger(__name__)

CPU_CACHE_BYTES = 1 << 30
GiB = float(1 << 30)


def cache_blocks(
    cfg: CacheConfig, geometry: KVGeometry, model: CausalLM, max_batched_tokens: int, device: torch.device | str
) -> int:
    """Blocks of the paged cache on ``device``: ``cfg.num_device_blocks``, else ``cfg.device_memory_bytes`` of
    them, else (0) the automatic size. Callers make the cache right after (nothing else allocates in between)."""
    device = torch.device(device)
    if cfg.num_device_blocks:
        return cfg.num_device_blocks
    if cfg.device_memory_bytes:
        return PagedKVCache.blocks_for_memory(geometry, cfg.device_memory_bytes)
    if device.type != "cuda":
        return PagedKVCache.blocks_for_memory(geometry, CPU_CACHE_BYTES)
    peak = forward_peak_bytes(model, geometry, max_batched_tokens, device)
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device)
    size = auto_cache_bytes(total, free, held, peak, cfg.gpu_memory_utilization, str(device))
    blocks = PagedKVCache.blocks_for_memory(geometry, size)
    log.info(
        "KV cache on %s: %.2f GiB, %d tokens (%.0f%% of %.1f GiB less %.2f GiB held and %.2f GiB of activations)",
        device,
        size / GiB,
        blocks * geometry.block_size,
        100 * cfg.gpu_memory_utilization,
        total / GiB,
        held / GiB,
        peak / GiB,
    )
    return blocks


def auto_cache_bytes(total: int, free: int, held: int, peak: int, utilization: float, device: str = "") -> int:
    """Bytes for the cache: ``utilization`` of the device's ``total`` less what this engine ``held`` (weights,
    workspace) and its forward's ``peak`` activations; refused (``ConfigError`` with the numbers) when that leaves
    nothing, or when it is more than is ``free`` now beside those activations (other processes hold the rest)."""
    size = int(utilization * total) - held - peak
    if size <= 0:
        raise ConfigError(
            f"no device memory left for the KV cache on {device}: {utilization:.2f} of {total / GiB:.1f} "
            f"GiB (--gpu-memory-utilization) less {held / GiB:.2f} GiB of weights and workspace and "
            f"{peak / GiB:.2f} GiB of activations; raise --gpu-memory-utilization, lower "
            "--max-num-batched-tokens, or give --cache-bytes"
        )
    if size > free - peak:
        raise ConfigError(
            f"{device} has {free / GiB:.2f} GiB free, less than the {(size + peak) / GiB:.2f} GiB the "
            f"KV cache and activations need at --gpu-memory-utilization {utilization:.2f} (other "
            f"processes hold {(total - free - held) / GiB:.2f} GiB): lower it, or give --cache-bytes"
        )
    return size


def forward_peak_bytes(model: CausalLM, geometry: KVGeometry, tokens: int, device: torch.device) -> int:
    """Device memory the largest forward allocates beyond what is held, measured on CUDA by running it
    (``largest_forward``; its cache is counted too, a small overestimate, and freed after)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    largest_forward(model, geometry, tokens, device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    gc.collect()
    torch.cuda.empty_cache()
    return peak


@torch.inference_mode()
def largest_forward(model: CausalLM, geometry: KVGeometry, tokens: int, device: torch.device | str) -> int:
    """Prefill ``tokens`` tokens in one forward, as prompts of at most the model's context (a sliding window's
    included), over a cache of their own; returns how many prompts. The model runs as ``parallel.steps``'
    ``forward_paged`` runs it (every layer over the paged cache), without an engine's runner, which sits above
    this module."""
    longest = model.config.context_limit() - 1
    lens = [min(longest, tokens - start) for start in range(0, tokens, longest)]
    cache = PagedKVCache(geometry, sum(geometry.num_blocks(n + 1) for n in lens), device)
    for i, n in enumerate(lens):
        cache.reserve(i, n + 1)
    slots = torch.tensor([s for i, n in enumerate(lens) for s in cache.slots(i, 0, n)], device=device)
    tables = torch.from_numpy(cache.padded_tables(list(range(len(lens))))).to(device)
    batch = ForwardBatch(tuple(0 for _ in lens), tuple(lens))
    with model.forward_pass(batch) as ctx:
        hidden = model.embed(torch.zeros(sum(lens), dtype=torch.long, device=device))
        for layer in range(model.config.num_layers):
            hidden, kv = model.forward_layer(layer, hidden, ctx, PagedKV(cache.layers[layer], tables, ctx.cached_lens))
            cache.write(layer, slots, kv, model.kernels)
    model.compute_logits(hidden[batch.last_token_indices()])
    return len(lens)
