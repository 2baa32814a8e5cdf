"""The steps every rank of an engine runs together (``dualpath.engines.parallel.ranks.Ranks.run``), and each rank's state.

A step is a function ``step(state, *args)`` of plain arguments (numpy arrays, block ids, frozen configs), so rank 0
can send it down a pipe; it does on this rank what rank 0 does on its own: the forward over this rank's heads, the
moves between this rank's device KV and the engine's canonical host KV. At TP 1 the same functions run on rank 0
alone, so there is one code path.

KV under tensor parallelism: a rank's device KV (paged cache, prefill workspace) holds its heads only
(``dualpath.core.geometry.HeadShard``); everything the traffic manager touches (DRAM buffer, prefill staging, storage,
transfers) keeps the canonical row of every head, in shared memory the engine's ranks map. A rank reads its heads'
part of each Layer Block from there and writes it back (the first replica of a replicated head only).
"""

from __future__ import annotations

import hashlib
from typing import Callable

import numpy as np
import torch

from dualpath.core.errors import CheckpointError, DualPathError
from dualpath.core.geometry import HeadShard, KVGeometry
from dualpath.engines.graphs import DecodeGraphs, make_decode_graphs
from dualpath.engines.kv_cache import PagedKVCache
from dualpath.engines.models.base import ForwardBatch
from dualpath.kernels.attention import PagedKV, consecutive_tables
from dualpath.kernels.kv_move import (
    cache_dtype,
    cache_to_full_blocks,
    full_block_view,
    full_blocks_to_cache,
    to_cache,
    write_tokens,
)
from dualpath.traffic.memory import HostMemory


class StepAborted(Exception):
    """Rank 0 could not go on with a step (a layer's KV failed to arrive): every rank leaves it at the same point."""


class RankState:
    """One rank's part of an engine: its model shard, its device KV, and its mappings of the canonical host KV."""

    def __init__(self, model, comm, device: str, spec=None):
        self.model, self.comm, self.device, self.spec = model, comm, torch.device(device), spec
        self.shard: HeadShard | None = model.kv_shard
        self.kv: dict[str, torch.Tensor] = {}  # device KV of this rank's heads: prefill workspaces
        self.host: dict[str, torch.Tensor] = {}  # canonical host KV: "buffer" (Full Block bytes), workspace staging
        self.cache: PagedKVCache | None = None
        self.hidden: torch.Tensor | None = None  # the last forward's hidden states
        self.graphs: DecodeGraphs | None = None  # decode steps over ``cache`` (``make_graphs``)
        self._mapped: list[HostMemory] = []

    @property
    def sharded(self) -> bool:
        """Whether this rank's KV rows are a part of the canonical ones (so they move through host staging)."""
        return self.shard is not None and not self.shard.whole

    def local(self, g: KVGeometry) -> KVGeometry:
        return self.shard.local_geometry(g) if self.shard is not None else g

    def device_of(self, rank: int) -> str:
        return self.spec.device(rank) if self.spec is not None else "?"

    def attach(self, name: str, nbytes: int) -> torch.Tensor:
        mem = HostMemory.attach(name, nbytes)
        self._mapped.append(mem)
        return mem.tensor

    def agreed(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` (rank 0's part of a step: waiting for KV); every rank goes on only if it succeeded, else
        rank 0 raises its error and the others ``StepAborted``."""
        if self.comm is None:
            fn()
            return
        error = None
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - raised below, after the others know
            error = e
        if not self.comm.agree(error is None):
            raise error if error is not None else StepAborted()

    def together(self, fn: Callable[[], object]):
        """Run ``fn`` (a part of a step that may fail on bad input: an adapter's or a checkpoint's files) on every
        rank and return this rank's result when all succeed; else rank 0 raises its own error or the first failing
        rank's (a ``CheckpointError`` naming it) and the others ``StepAborted``: no rank dies of it."""
        try:
            result, error = fn(), None
        except Exception as e:  # noqa: BLE001 - every rank learns of it below
            result, error = None, e
        if self.comm is None:
            if error is not None:
                raise error
            return result
        failed = [
            (r, text)
            for r, text in enumerate(self.comm.gather_objects(None if error is None else str(error)))
            if text is not None
        ]
        if not failed:
            return result
        if self.comm.rank != 0:
            raise StepAborted()
        if error is not None:
            raise error
        raise CheckpointError(f"tensor-parallel rank {failed[0][0]}: {failed[0][1]}")

    def put_rows(self, canonical: torch.Tensor, index, local: torch.Tensor) -> None:
        """This rank's heads of ``local [T, local elems]`` into rows ``index`` of host ``canonical [N, elems]``
        (first replicas only), then wait until every rank has written."""
        if self.shard.primary:
            local = to_cache(local, canonical.dtype).cpu()
            if canonical.dtype.itemsize == 1:  # CPU torch cannot index-put 8-bit floats: their bytes instead
                canonical, local = canonical.view(torch.uint8), local.view(torch.uint8)
            self.shard.put(canonical, index, local)
        self.comm.agree(True)

    def close(self) -> None:
        for mem in self._mapped:
            mem.close()
        self._mapped = []
        if self.comm is not None:
            self.comm.close()


class LayerHooks:
    """What rank 0 does around each layer of a prefill besides computing (the KV pipeline); the others' do
    nothing. ``before`` may raise (a layer's KV failed to arrive): every rank leaves the step."""

    def begin(self) -> None:
        pass

    def before(self, layer: int) -> None:
        pass

    def after(self, layer: int, slot: int) -> None:
        pass


# --- set-up ---------------------------------------------------------------------------------------------------
def alloc_workspace(
    st: RankState, key: str, g: KVGeometry, slots: int, blocks: int, stage: tuple[str, int] | None
) -> torch.Tensor:
    """A prefill workspace ``[slots, blocks, block_size, local elems]`` on this rank's device, and (sharded) the
    map of its canonical host staging ``stage`` (shared memory name, bytes)."""
    st.kv[key] = torch.zeros(slots, blocks, *st.local(g).layer_block_shape, dtype=cache_dtype(g), device=st.device)
    if stage is not None:
        st.host[key] = (
            st.attach(*stage)[: slots * blocks * g.layer_block_bytes]
            .view(cache_dtype(g))
            .view(slots, blocks, *g.layer_block_shape)
        )
    return st.kv[key]


def alloc_cache(st: RankState, g: KVGeometry, num_blocks: int) -> PagedKVCache:
    """The paged cache of this rank's heads: the same block ids on every rank (rank 0's allocator owns them)."""
    st.cache = PagedKVCache(st.local(g), num_blocks, st.device)
    return st.cache


def cache_size(st: RankState, cfg, g: KVGeometry, max_batched_tokens: int) -> int:
    """Blocks the paged cache takes on this rank's device (``dualpath.engines.memory.cache_blocks``: its activation peak is
    measured by a forward every rank runs)."""
    from dualpath.engines.memory import cache_blocks

    return cache_blocks(cfg, st.local(g), st.model, max_batched_tokens, st.device)


def attach_buffer(st: RankState, name: str, nbytes: int) -> None:
    """The engine's DRAM buffer (canonical Full Blocks), mapped (rank 0 holds it already)."""
    if "buffer" not in st.host:
        st.host["buffer"] = st.attach(name, nbytes)


# --- forwards ---------------------------------------------------------------------------------------------------
@torch.inference_mode()
def prefill_layers(
    st: RankState,
    g: KVGeometry,
    batch: ForwardBatch,
    ids: np.ndarray,
    slots: np.ndarray,
    bases: list[int],
    counts: list[int],
    key: str,
    hooks: LayerHooks | None = None,
) -> torch.Tensor:
    """A prefill batch through every layer over workspace ``key`` (sequence i's cached KV in blocks ``bases[i]``
    onwards, its new tokens' rows at ``slots``); returns the last hidden states."""
    model, hooks = st.model, hooks or LayerHooks()
    ids, slots = torch.from_numpy(np.stack([ids, slots])).to(st.device)  # one copy; none in the layer loop
    tables = consecutive_tables(bases, counts, st.device)
    ws, stage, used = st.kv[key], st.host.get(key), max(b + n for b, n in zip(bases, counts))
    host_slots = slots.cpu() if stage is not None else None  # where staged rows go: once, not per layer
    with model.forward_pass(batch) as ctx:
        hidden = model.embed(ids)
        st.agreed(hooks.begin)
        for layer in range(g.num_layers):
            st.agreed(lambda: hooks.before(layer))
            slot = layer % ws.shape[0]
            if stage is not None:  # this rank's heads of the layer's cached KV, from the canonical staging
                ws[slot, :used].copy_(st.shard.take(stage[slot, :used]))
            hidden, kv = model.forward_layer(layer, hidden, ctx, PagedKV(ws[slot], tables, ctx.cached_lens))
            write_tokens(ws[slot], slots, kv, model.kernels)  # the batch at once, not per sequence
            if stage is not None:
                st.put_rows(stage[slot].view(-1, g.kv_elems_per_token), host_slots, kv)
            hooks.after(layer, slot)
    st.hidden = hidden
    return hidden


@torch.inference_mode()
def forward_paged(
    st: RankState, batch: ForwardBatch, ids: np.ndarray, slots: np.ndarray, tables: np.ndarray, rows: list[int] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A forward over sequences whose earlier KV is in this rank's paged cache (block ``tables``, one row each),
    the new rows written at ``slots``: (hidden states of every fed token, logits of ``rows`` of them, all if
    None)."""
    model, cache = st.model, st.cache
    ids, slots = torch.from_numpy(np.stack([ids, slots])).to(st.device)
    tables = torch.from_numpy(tables).to(st.device)
    with model.forward_pass(batch) as ctx:
        hidden = model.embed(ids)
        for layer in range(model.config.num_layers):
            paged = PagedKV(cache.layers[layer], tables, ctx.cached_lens)
            hidden, kv = model.forward_layer(layer, hidden, ctx, paged)
            cache.write(layer, slots, kv, model.kernels)
    st.hidden = hidden
    return hidden, model.compute_logits(hidden if rows is None else hidden[rows])


@torch.inference_mode()
def forward_whole(st: RankState, batch: ForwardBatch, ids: np.ndarray) -> torch.Tensor:
    """Logits of every position of sequences with nothing cached (``CausalLM.forward_all``; checks, scoring)."""
    return st.model.forward_all(torch.from_numpy(ids).to(st.device), batch, all_logits=True)[0]


@torch.inference_mode()
def logits_of(st: RankState, hidden: torch.Tensor) -> torch.Tensor:
    """Logits of hidden-state rows rank 0 holds (prompt logprobs): the rows travel with the step."""
    return st.model.compute_logits(hidden.to(st.device))


@torch.inference_mode()
def time_forward(st: RankState, g: KVGeometry, items: list[tuple[int, int]]) -> float:
    """Seconds of one forward of synthetic (cached, new) sequences over random cached KV (a prefill engine's
    start-up profile)."""
    import time

    lg, model = st.local(g), st.model
    counts = [g.num_blocks(c) for c, _ in items]
    firsts = [sum(counts[:i]) for i in range(len(items))]
    layer_kv = (0.1 * torch.randn(max(sum(counts), 1), *lg.layer_block_shape, device=st.device)).to(cache_dtype(g))
    tables = consecutive_tables(firsts, counts, st.device)
    gen = torch.Generator().manual_seed(len(items))  # every rank feeds the same tokens
    ids = torch.randint(0, model.config.vocab_size, (sum(n for _, n in items),), generator=gen).to(st.device)
    batch = ForwardBatch(tuple(c for c, _ in items), tuple(n for _, n in items))
    t = time.perf_counter()
    with model.forward_pass(batch) as ctx:
        cached = PagedKV(layer_kv, tables, ctx.cached_lens)
        h = model.embed(ids)
        for layer in range(model.config.num_layers):
            h, _ = model.forward_layer(layer, h, ctx, cached)
    if st.device.type == "cuda":
        torch.cuda.synchronize(st.device)
    return time.perf_counter() - t


# --- KV between the paged cache and the DRAM buffer ---------------------------------------------------------------
def _buffer_blocks(st: RankState, g: KVGeometry, slots: list[int]) -> torch.Tensor:
    """Canonical Full Blocks of buffer ``slots`` viewed ``[n, layers, block_size, elems]`` (a fresh tensor)."""
    whole = st.host["buffer"][: (max(slots) + 1) * g.full_block_bytes].view(-1, g.full_block_bytes)
    return full_block_view(whole.index_select(0, torch.as_tensor(slots, dtype=torch.long)), g)


def buffer_to_cache(st: RankState, g: KVGeometry, table: list[int], slots: list[int]) -> None:
    """Full Blocks in buffer ``slots`` into cache blocks ``table`` (this rank's heads of them)."""
    blocks = _buffer_blocks(st, g, slots)
    if st.sharded:
        blocks = st.shard.take(blocks).contiguous()
    lg = st.local(g)
    full_blocks_to_cache(
        st.cache.storage,
        torch.tensor(table, device=st.device),
        blocks.view(torch.uint8).view(len(slots), lg.full_block_bytes),
        lg,
        st.model.kernels,
    )


def cache_to_buffer(st: RankState, g: KVGeometry, table: list[int], slots: list[int]) -> None:
    """Cache blocks ``table`` into buffer ``slots`` as canonical Full Blocks: each rank writes its heads (sharded
    engines only; one device's cache is copied out whole by ``dualpath.kernels.kv_move.cache_to_full_blocks``)."""
    lg = st.local(g)
    local = cache_to_full_blocks(st.cache.storage, torch.tensor(table, device=st.device), lg).cpu()
    whole = full_block_view(st.host["buffer"][: (max(slots) + 1) * g.full_block_bytes], g)
    st.put_rows(
        whole.view(whole.shape[0], -1, g.kv_elems_per_token),
        torch.as_tensor(slots),  # a slot: its rows
        full_block_view(local, lg).reshape(len(slots), -1, lg.kv_elems_per_token),
    )


def copy_block(st: RankState, src: int, dst: int) -> None:
    """Every layer of cache block ``src`` into ``dst`` (a fork's copy of its parent's partial block)."""
    st.cache.storage[:, dst].copy_(st.cache.storage[:, src])


# --- weights and adapters -----------------------------------------------------------------------------------------
def load_adapter(st: RankState, path: str) -> str:
    """The PEFT LoRA adapter at ``path`` on every rank (each its cut of it, ``dualpath.engines.lora``), or on none:
    ``CheckpointError`` when any rank cannot load it. Returns its identity (the same on every rank: its files')."""
    had = set(st.model.adapters)
    try:
        return st.together(lambda: st.model.add_adapter(path))
    except BaseException:
        for digest in set(st.model.adapters) - had:  # a rank that loaded it drops it: all ranks or none
            del st.model.adapters[digest]
        raise


def update_weights(st: RankState, model_dir: str, quantize) -> str:
    """Checkpoint ``model_dir``'s weights in place of the loaded ones on every rank. Every rank checks the
    checkpoint against its part before any copies: a ``CheckpointError`` leaves the old weights on all of them. A
    failure while copying raises ``DualPathError`` (the weights are then a mix: the engine stops). Returns the
    sha256 of every byte read (under tensor parallelism, of the ranks' digests of their parts, in rank order)."""
    from dualpath.engines.models import open_update

    ckpt = st.together(lambda: open_update(st.model, model_dir, quantize))
    try:
        digest = st.together(lambda: st.model.reload_weights(ckpt))
    except StepAborted:
        raise
    except Exception as e:  # noqa: BLE001 - this rank or another copied a part of the new weights
        raise DualPathError(f"loading {model_dir}'s weights failed halfway ({e})") from None
    if st.comm is None:
        return digest
    return hashlib.sha256(",".join(st.comm.gather_objects(digest)).encode()).hexdigest()


# --- decode graphs ------------------------------------------------------------------------------------------------
def make_graphs(
    st: RankState, max_batch: int, max_model_len: int, enforce_eager: bool, capture: bool = True
) -> DecodeGraphs | None:
    """Each rank's decode steps over its cache, captured as CUDA graphs (``dualpath.engines.graphs``; the collectives inside
    are captured too, so ranks replay in step as they run eagerly); on every rank or on none, so a step is a graph
    replay on all of them or eager on all. ``capture`` False: the graphs' static buffers run eagerly (CPU tests)."""
    if capture:
        graphs = make_decode_graphs(st.model, st.cache, max_batch, max_model_len, enforce_eager)
    else:
        graphs = (
            DecodeGraphs(st.model, st.cache, max_batch, max_model_len, capture=False) if st.model.dp is None else None
        )
    if st.comm is not None and not st.comm.agree(graphs is not None):
        graphs = None
    st.graphs = graphs
    return graphs


@torch.inference_mode()
def decode_graph(
    st: RankState,
    tokens: list[int],
    positions: list[int],
    slots: list[int],
    tables: list[list[int]],
    adapters: list[str],
) -> torch.Tensor:
    """One decode step from the rank's graphs (rank 0 checked that they fit): the logits ``[n, vocab]``."""
    return st.graphs.run(tokens, positions, slots, tables, adapters)


STEPS = {
    f.__name__: f
    for f in (
        alloc_workspace,
        alloc_cache,
        cache_size,
        attach_buffer,
        prefill_layers,
        forward_paged,
        forward_whole,
        logits_of,
        time_forward,
        buffer_to_cache,
        cache_to_buffer,
        copy_block,
        load_adapter,
        update_weights,
        make_graphs,
        decode_graph,
    )
}
