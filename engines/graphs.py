"""Decode steps replayed from CUDA graphs.

A decode step launches the same few kernels per layer whatever the batch holds; launched one by one from Python
they cost more than the GPU work of a small batch. ``DecodeGraphs`` captures the whole step (embedding, every
layer with its KV write, the logits) once per padded batch size when the engine starts, and replays it: per step
the host only fills two static input buffers. Prefill is never captured: its per-layer transfer hooks wait on
KV arriving from storage or peers.

Invariants the captured step relies on:
- no host work depends on the batch: cached lengths are a device tensor (``CausalLM.begin_decode``), and decode
  attention sizes its splits on the device (its grid depends on the batch size only);
- the model has none either (``CausalLM.graph_safe``: on the Triton kernels, including fused MoE);
- padding rows repeat row 0 (token, position, block table, slot, adapter) and write row 0's own KV row to row 0's
  slot, so they change nothing that row 0 does not;
- the cache tensors never move and hold nothing while graphs are captured (the warm-up writes slot 0).

LoRA: the adapters the model holds when the graphs are captured (up to ``MAX_GRAPH_ADAPTERS``, the first loaded)
get a second graph per batch size, which runs each of them over every row and keeps its product on its own rows
(``AdapterRows.mask``, from a static row of adapter numbers). Steps of the base model alone replay the plain
graphs, so they pay nothing for adapters; a step with an adapter loaded later runs eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from dualpath.engines.kv_cache import PagedKVCache
from dualpath.engines.lora import AdapterRows
from dualpath.engines.models.base import CausalLM
from dualpath.kernels.attention import PagedKV

log = logging.getLogger(__name__)

# each adapter in the LoRA graphs costs every step that uses any adapter its two small GEMMs per projection, over
# every row: a bound on what a step pays for adapters it does not use
MAX_GRAPH_ADAPTERS = 4


def graph_batch_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, then every 16 up to ``max_batch`` (itself included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


def use_decode_graphs(model: CausalLM, device: torch.device, enforce_eager: bool) -> bool:
    """Capture decode steps on CUDA when the model's step can be captured (``graph_safe``), unless asked not to."""
    # (data-parallel attention: each forward syncs with the group's engines first, host work a graph cannot hold)
    return not enforce_eager and device.type == "cuda" and model.graph_safe and model.dp is None


def make_decode_graphs(
    model: CausalLM, cache: PagedKVCache, max_batch: int, max_model_len: int, enforce_eager: bool
) -> DecodeGraphs | None:
    """An engine's decode graphs, or None where they do not apply or fail to capture (then decode runs eagerly,
    slower but right, and the log says why)."""
    if not use_decode_graphs(model, cache.device, enforce_eager):
        return None
    try:
        return DecodeGraphs(model, cache, max_batch, max_model_len)
    except Exception as e:  # noqa: BLE001 - a capture failure costs speed, never the engine
        log.warning("decode steps run eagerly: capturing CUDA graphs failed: %s: %s", type(e).__name__, e)
        return None


class DecodeGraphs:
    """One decode step per padded batch size, captured (``capture``: on CUDA) or run eagerly on the same static
    buffers (CPU tests of everything but the capture). The owner calls ``run`` from one thread."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, max_batch: int, max_model_len: int, capture: bool = True):
        self.model, self.cache, self.capture = model, cache, capture
        self.sizes = graph_batch_sizes(max_batch)
        self.max_blocks = -(-(max_model_len + 1) // cache.geometry.block_size)
        self.adapters = tuple(model.adapters)[:MAX_GRAPH_ADAPTERS]  # identities; row value i + 1 is adapters[i]
        n, dev = self.sizes[-1], cache.device
        # token, position, slot, KV source row, adapter number (0: the base model)
        self.inputs = torch.zeros(5, n, dtype=torch.long, device=dev)
        self.tables = torch.zeros(n, self.max_blocks, dtype=torch.long, device=dev)
        self.logits = torch.zeros(n, model.config.vocab_size, dtype=torch.float32, device=dev)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (size, with LoRA) -> graph
        if capture:
            self._capture_all()

    def fits(self, num_seqs: int, longest_table: int, adapters=()) -> bool:
        """Whether a step of ``num_seqs`` rows, tables up to ``longest_table`` blocks and rows under ``adapters``
        (identities, "" for the base model) has a graph."""
        return (
            num_seqs <= self.sizes[-1]
            and longest_table <= self.max_blocks
            and all(a in self.adapters for a in adapters if a)
        )

    @torch.inference_mode()
    def run(
        self, tokens: list[int], positions: list[int], slots: list[int], tables: list[list[int]], adapters=()
    ) -> torch.Tensor:
        """Logits ``[n, vocab]`` of one decode step (valid until the next ``run``); the caller checked ``fits``."""
        n = len(tokens)
        size = next(s for s in self.sizes if s >= n)
        pad = size - n
        numbers = [self.adapters.index(a) + 1 if a else 0 for a in adapters] or [0] * n
        rows = [
            tokens + tokens[:1] * pad,
            positions + positions[:1] * pad,
            slots + slots[:1] * pad,
            list(range(n)) + [0] * pad,
            numbers + numbers[:1] * pad,
        ]
        self.inputs[:, :size].copy_(torch.tensor(rows), non_blocking=True)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        self.tables[:size, :width].copy_(torch.tensor(padded + padded[:1] * pad), non_blocking=True)
        lora = any(numbers)
        if self.capture:
            self.graphs[size, lora].replay()
        else:
            self._step(size, lora)
        return self.logits[:n]

    def _step(self, size: int, lora: bool = False) -> None:
        """The captured step: reads only the static buffers, writes the KV and ``self.logits``."""
        m, cache = self.model, self.cache
        tokens, positions, slots, source, numbers = self.inputs[:, :size]
        ctx = m.begin_decode(positions)
        if lora:
            dtype = m.embed_tokens.dtype
            ctx.lora = tuple(
                AdapterRows(m.adapters[a], None, (numbers == i + 1).to(dtype)[:, None])
                for i, a in enumerate(self.adapters)
            )
        hidden = m.embed(tokens)
        for layer in range(m.config.num_layers):
            paged = PagedKV(cache.layers[layer], self.tables[:size], ctx.cached_lens)
            hidden, kv = m.forward_layer(layer, hidden, ctx, paged)
            cache.write(layer, slots, kv.index_select(0, source), m.kernels)
        self.logits[:size].copy_(m.compute_logits(hidden))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        if self.cache.num_free_blocks != self.cache.allocator.num_blocks:
            raise RuntimeError("decode graphs are captured before the KV cache holds anything")
        start, pool = time.perf_counter(), None
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            for lora in (False, True) if self.adapters else (False,):
                self._step(size, lora)  # warm-up: compiles the kernels, sets up cuBLAS
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                # thread_local: engine threads touching CUDA meanwhile (transports, storage) do not void the capture
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self._step(size, lora)
                pool = graph.pool() if pool is None else pool
                self.graphs[size, lora] = graph
        torch.cuda.synchronize()
        log.info(
            "captured %d decode graphs (batch sizes %s%s) in %.1f s",
            len(self.graphs),
            ",".join(map(str, self.sizes)),
            f"; LoRA adapters {len(self.adapters)}" if self.adapters else "",
            time.perf_counter() - start,
        )
