"""The decode engine: receives prompt KV into its DRAM buffer, moves it into its paged device cache, decodes with
continuous batching, streams tokens to the submitter, and writes every Full Block that fills to storage.

Admission is memory-exact: ``Prepare`` reserves device blocks for the prompt and the whole generation budget, and
buffer slots for the prompt, or refuses. For the DE read path it also loads the hit blocks from storage into
those slots (the prefill engine then reads them layer by layer). ``PrefillDone`` hands the sequence to the decode
loop, which owns the paged cache and the running batch. A request's stream ends only after its blocks are stored
and reported, so the next turn finds them.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from dualpath.errors import DualPathError, OutOfBlocksError
from dualpath.geometry import BlockHash, block_hashes
from dualpath.messages import Ack, PrefillDone as PrefillDoneMsg, PrepareReply, PrepareRequest, RequestRef, Role, \
    TokenEvent, unpack_keys, unpack_tokens
from dualpath.sampling_params import SamplingParams
from engines.engine import Engine
from engines.kv_cache import PagedKVCache
from engines.local import LocalEngine
from engines.sampler import TokenLogprob
from engines.sequence import Sequence
from engines.streams import StreamHub
from kernels.kv_move import cache_to_full_blocks, full_blocks_to_cache

log = logging.getLogger(__name__)


@dataclass
class Held:
    """A request between ``Prepare`` and its end."""

    work_id: str
    num_prompt_tokens: int
    slots: list[int]
    seq: Sequence | None = None
    hashes: list[BlockHash] = field(default_factory=list)  # chained hashes of the blocks persisted so far
    persisted: int = 0  # leading blocks written (or being written) to storage
    stores: list[Future] = field(default_factory=list)
    cancelled: bool = False
    info: dict = field(default_factory=dict)


class DecodeEngine(Engine):
    role = Role.DECODE

    def setup(self) -> None:
        c = self.cfg.engine.cache
        blocks = c.num_device_blocks or PagedKVCache.blocks_for_memory(self.geometry, c.device_memory_bytes)
        self.cache = PagedKVCache(self.geometry, blocks, self.device)
        self.local = LocalEngine(self.model, self.cache, self.cfg.engine.max_num_seqs,
                                 self.cfg.engine.max_num_batched_tokens, self.max_model_len, free_finished=False,
                                 enforce_eager=self.cfg.engine.enforce_eager)
        self.lock = threading.RLock()  # the paged cache and the held table
        self.held_: dict[str, Held] = {}
        self.inbox: queue.Queue = queue.Queue()
        self.streams = StreamHub(self.server.loop)

    def capacity_tokens(self) -> int:
        return self.cache.allocator.num_blocks * self.geometry.block_size

    def free_tokens(self) -> int:
        with self.lock:
            return self.cache.num_free_blocks * self.geometry.block_size

    def held(self) -> dict[str, int]:
        with self.lock:
            return {w: h.num_prompt_tokens + (len(h.seq.output_ids) if h.seq else 0) for w, h in self.held_.items()}

    # --- admission ------------------------------------------------------------------------------------------
    async def Prepare(self, req: PrepareRequest, ctx) -> PrepareReply:
        """Reserve (on the RPC pool: it takes the cache lock), then await the DE-side load on the loop, so
        requests waiting for storage hold no thread and never delay ``PrefillDone`` of others."""
        loop = asyncio.get_running_loop()
        reply, load = await loop.run_in_executor(self.server.pool, self._reserve, req)
        if load is None:
            return reply
        results = await asyncio.wait_for(asyncio.wrap_future(load), self.cfg.transport.op_timeout_s * 4)
        return replace(reply, num_loaded_blocks=next((i for i, e in enumerate(results) if e is not None), len(results)))

    def _reserve(self, req: PrepareRequest) -> tuple[PrepareReply, Future | None]:
        """Device blocks for the prompt and the generation budget, buffer slots for the prompt, and the storage
        read of the DE-side hit blocks started: ``(the reply, the load or None)``."""
        g = self.geometry
        total = min(req.num_prompt_tokens + req.max_tokens, self.max_model_len)
        with self.lock:
            if req.request_id in self.held_:
                return PrepareReply(False, error=f"{req.request_id} is already held"), None
            if self.cache.blocks_needed(req.request_id, total) > self.cache.num_free_blocks:
                return PrepareReply(False, error=f"no device memory for {total} tokens"), None
            try:
                slots = self.buffer.allocate(g.num_blocks(req.num_prompt_tokens), req.request_id)
            except OutOfBlocksError as e:
                return PrepareReply(False, error=f"buffer full: {e}"), None
            self.cache.reserve(req.request_id, total)
            self.held_[req.request_id] = Held(req.request_id, req.num_prompt_tokens, slots)
        if not req.load_keys:
            return PrepareReply(True, slots, 0), None
        first, keys = req.first_load_block, unpack_keys(req.load_keys)
        return PrepareReply(True, slots, 0), self.traffic.load(keys, slots[first:first + len(keys)])

    def Release(self, ref: RequestRef, ctx) -> Ack:
        self.inbox.put(("drop", ref.request_id, ref.reason))
        return Ack()

    def PrefillDone(self, msg: PrefillDoneMsg, ctx) -> Ack:
        with self.lock:
            if msg.request_id not in self.held_:
                return Ack(False, f"{msg.request_id} is not held here")
        self.inbox.put(("admit", msg))
        return Ack()

    def on_cancel(self, work_id: str, reason: str) -> None:
        self.inbox.put(("drop", work_id, reason))

    # --- the decode loop ------------------------------------------------------------------------------------
    def loop(self) -> None:
        while not self.stopping.is_set():
            self._drain_inbox(block=not self.local.running)
            if self.local.running:
                self._step()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if item[0] == "admit":
                self._admit(item[1])
            else:
                self._drop(item[1], item[2])
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _admit(self, msg: PrefillDoneMsg) -> None:
        """Prompt KV: buffer -> paged cache; persist the prompt's new full blocks; start decoding."""
        g = self.geometry
        params = SamplingParams.from_dict(msg.sampling)
        if not self.guides_ready(params, lambda: self.inbox.put(("admit", msg))):
            return
        with self.lock:
            h = self.held_.get(msg.request_id)
            if h is None or h.cancelled:
                return
            table = torch.tensor(self.cache.block_table(msg.request_id)[:len(h.slots)], device=self.device)
            full_blocks_to_cache(self.cache.storage, table, self.buffer.full_blocks(h.slots), g, self.model.kernels)
        gen = None
        if msg.generator_state:
            gen = torch.Generator()  # requests' generators live on the host (engines.sampler)
            gen.set_state(torch.from_numpy(np.frombuffer(bytes.fromhex(msg.generator_state), dtype=np.uint8).copy()))
        prompt = unpack_tokens(msg.tokens)
        seq = Sequence(msg.request_id, prompt, params, gen, num_computed=len(prompt))
        lp = TokenLogprob(msg.first_logprob["token_id"], msg.first_logprob["logprob"],
                          tuple(tuple(x) for x in msg.first_logprob["top"])) if msg.first_logprob else None
        try:
            seq.guide = self.guides.guide_for(params)  # the prefill engine's first token replays through it
            seq.append(msg.first_token, lp, self.local.eos_ids, self.max_model_len)
        except DualPathError as e:
            self.outbox.add("failed", [msg.request_id, f"structured output: {e}"])
            self._drop(msg.request_id, f"structured output: {e}")
            return
        h.seq = seq
        h.info = {"num_prompt_tokens": len(prompt), "num_cached_tokens": msg.num_cached_tokens,
                  "path": msg.path, "storage_bytes": msg.storage_bytes, "prompt_logprobs": msg.prompt_logprobs}
        n_full = len(prompt) // g.block_size
        h.hashes = block_hashes(prompt, self.fingerprint, g.block_size)
        first_new = msg.num_cached_tokens // g.block_size
        if n_full > first_new:
            keys = h.hashes[first_new:n_full]
            fut = self.traffic.store(keys, [self.buffer.slot_bytes(s) for s in h.slots[first_new:n_full]])
            h.stores.append(_with_keys(fut, keys))
            fut.add_done_callback(lambda _f, w=msg.request_id: self.buffer.free_owner(w))
        else:
            self.buffer.free_owner(msg.request_id)
        h.persisted = n_full
        self.outbox.add("started", msg.request_id)
        self.report_soon()
        self._emit(seq, [msg.first_token])
        if seq.finished:
            self._finish(h)
        else:
            with self.lock:
                self.local.admit_prefilled(seq)

    def _step(self) -> None:
        with self.lock:
            before = {s.seq_id: len(s.output_ids) for s in self.local.running}
            running = list(self.local.running)
            try:
                finished = self.local.step()
            except Exception as e:  # noqa: BLE001 - fail the batch, keep the engine
                log.exception("decode step failed")
                for s in running:
                    self.outbox.add("failed", [s.seq_id, f"decode step failed: {e}"])
                    self.inbox.put(("drop", s.seq_id, f"decode step failed: {e}"))
                self.local.running.clear()
                self.report_soon()
                return
        for s in running:
            self._emit(s, s.output_ids[before[s.seq_id]:])
            self._persist(self.held_[s.seq_id])
        for s in finished:
            self._finish(self.held_[s.seq_id])

    def _persist(self, h: Held) -> None:
        """Write every block of ``h`` whose KV is complete and not yet written."""
        g, seq = self.geometry, h.seq
        full = min(seq.num_computed, seq.num_tokens) // g.block_size
        if full <= h.persisted:
            return
        tokens = seq.token_ids
        parent = h.hashes[h.persisted - 1] if h.persisted else None
        new_keys = block_hashes(tokens[h.persisted * g.block_size:full * g.block_size], self.fingerprint,
                                g.block_size, parent=parent)
        with self.lock:
            table = torch.tensor(self.cache.block_table(h.work_id)[h.persisted:full], device=self.device)
            blocks = cache_to_full_blocks(self.cache.storage, table, g)
        blocks = blocks.cpu()  # one copy of every layer, outside the lock
        h.hashes.extend(new_keys)
        h.stores.append(_with_keys(self.traffic.store(new_keys, list(blocks)), new_keys))
        h.persisted = full

    def _finish(self, h: Held) -> None:
        """Persist the last full blocks, then report and close the stream from a helper thread, so the decode
        loop never waits for storage."""
        self._persist(h)
        with self.lock:
            if h.seq in self.local.running:
                self.local.running.remove(h.seq)
            self.cache.free(h.work_id)
        threading.Thread(target=self._close, args=(h,), daemon=True, name=f"close-{h.work_id}").start()

    def _close(self, h: Held) -> None:
        error = ""
        for fut in h.stores:
            try:
                keys, results = fut.result(self.cfg.transport.op_timeout_s * 4)
                self.outbox.add("stored_keys", *[k for k, e in zip(keys, results) if e is None])
            except Exception as e:  # noqa: BLE001 - storing is best effort; the answer still stands
                log.warning("%s: storing blocks failed: %s", h.work_id, e)
        with self.lock:
            self.held_.pop(h.work_id, None)
        self.buffer.free_owner(h.work_id)
        self.outbox.add("finished", h.work_id)
        self.report_now()  # stored blocks are indexed before the submitter can send the next turn
        reason = h.seq.finish_reason.value if h.seq.finish_reason else "abort"
        self.streams.put(h.work_id, TokenEvent(h.work_id, finish_reason=reason, error=error, **h.info))

    def _drop(self, work_id: str, reason: str) -> None:
        with self.lock:
            h = self.held_.pop(work_id, None)
            if h is None:  # never prepared here; a submitter may already be waiting on its stream
                self.streams.put(work_id, TokenEvent(work_id, finish_reason="abort", error=reason))
                return
            h.cancelled = True
            if h.seq is not None and h.seq in self.local.running:
                self.local.running.remove(h.seq)
            self.cache.free(work_id)
        self.buffer.free_owner(work_id)
        self.streams.put(work_id, TokenEvent(work_id, finish_reason="abort", error=reason))
        log.info("%s dropped: %s", work_id, reason)

    # --- streams --------------------------------------------------------------------------------------------
    def _emit(self, seq: Sequence, tokens: list[int]) -> None:
        lps = seq.logprobs[len(seq.output_ids) - len(tokens):]
        for tok, lp in zip(tokens, lps):
            self.streams.put(seq.seq_id, TokenEvent(seq.seq_id, tok, lp.__dict__ if lp is not None else None))

    async def Stream(self, ref: RequestRef, ctx):
        """Tokens of ``ref.request_id`` (a work id) as they come; the submitter hanging up cancels it."""
        ended = False
        try:
            async for ev in self.streams.events(ref.request_id):
                ended = bool(ev.finish_reason)
                yield ev
        finally:
            if not ended and not self.stopping.is_set():
                self.inbox.put(("drop", ref.request_id, "client disconnected"))


def _with_keys(fut: Future, keys: list[BlockHash]) -> Future:
    """A future resolving to ``(keys, per-key results)``."""
    out: Future = Future()
    fut.add_done_callback(lambda f: out.set_result((keys, f.result())) if f.exception() is None
                          else out.set_exception(f.exception()))
    return out
