"""The decode engine: receives prompt KV into its DRAM buffer, moves it into its paged device cache, decodes with
continuous batching, streams tokens to the submitter, and writes every Full Block that fills to storage.

Admission is memory-exact: ``Prepare`` reserves device blocks for the prompt and the whole generation budget, and
buffer slots for the prompt, or refuses. For the DE read path it also loads the hit blocks from storage into those
slots (the prefill engine then reads them layer by layer). ``PrefillDone`` hands the sequence to the decode loop,
which owns the paged cache and the running batch. A request of ``n`` choices (parallel sampling) arrives once: its
prompt's KV lands in choice 0's blocks, choices 1.. fork them (sharing the full blocks, copying the partial one into
blocks they reserved at ``Prepare``) and decode as sequences of their own; each choice's end is streamed as it
comes. Stop strings end a choice here too (the tokenizer loads on the first request that has them), so a choice that
met one stops taking decode steps while the others go on. A request's stream ends only after its blocks are stored
and reported, so the next turn finds them.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from dualpath.core.errors import DualPathError, OutOfBlocksError, RankLostError, RequestError
from dualpath.core.faults import failpoint
from dualpath.core.geometry import BlockHash, block_hashes, choice_blocks
from dualpath.core.messages import (
    Ack,
    PrefillDone as PrefillDoneMsg,
    PrepareReply,
    PrepareRequest,
    RequestRef,
    Role,
    TokenEvent,
    unpack_keys,
    unpack_tokens,
)
from dualpath.core.sampling_params import SamplingParams
from dualpath.engines.engine import Engine
from dualpath.engines.local import LocalEngine
from dualpath.engines.sampler import TokenLogprob
from dualpath.engines.sequence import Sequence, choice_id
from dualpath.engines.streams import StreamHub
from dualpath.engines.parallel.steps import alloc_cache, buffer_to_cache, cache_size, cache_to_buffer, copy_block
from dualpath.kernels.kv_move import cache_to_full_blocks

log = logging.getLogger(__name__)
HAND_BACK_STORE_S = 10.0  # how long a stopping engine waits for the blocks it is storing before handing replies back


@dataclass
class Choice:
    """One of a request's ``n`` sequences and what of it is stored."""

    seq: Sequence
    hashes: list[BlockHash]  # chained hashes of the blocks persisted so far (the prompt's shared by all)
    persisted: int  # leading blocks written (or being written) to storage
    done: bool = False  # finished and its blocks freed


@dataclass
class Held:
    """A request between ``Prepare`` and its end."""

    work_id: str
    num_prompt_tokens: int
    slots: list[int]
    n: int = 1
    choices: list[Choice] = field(default_factory=list)
    stores: list[Future] = field(default_factory=list)
    cancelled: bool = False
    info: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.num_prompt_tokens + sum(len(c.seq.output_ids) for c in self.choices)

    @property
    def unfinished(self) -> int:
        return sum(not c.done for c in self.choices)


class DecodeEngine(Engine):
    role = Role.DECODE

    def setup(self) -> None:
        e = self.cfg.engine
        blocks = self.ranks.run(cache_size, e.cache, self.geometry, e.max_num_batched_tokens)
        self.cache = self.ranks.run(alloc_cache, self.geometry, blocks)  # rank 0's: of its heads, under TP
        if self.ranks.size > 1:
            self.cache.copier = lambda src, dst: self.ranks.run(copy_block, src, dst)
        self.local = LocalEngine(
            self.model,
            self.cache,
            e.max_num_seqs,
            e.max_num_batched_tokens,
            self.max_model_len,
            free_finished=False,
            enforce_eager=e.enforce_eager,
            speculative=e.speculative,
            ranks=self.ranks,
        )
        self.lock = threading.RLock()  # the paged cache and the held table
        self.held_: dict[str, Held] = {}
        # dropped before their hand-off: work id -> when its buffer slots are reused without word from its prefill
        # engine (``_drop``); bounded by the longest a write or storage read into them may take
        self.settling: dict[str, float] = {}
        self.settle_s = self.cfg.transport.op_timeout_s * 4
        self.steps = 0  # decode steps run (with work)
        self.inbox: queue.Queue = queue.Queue()
        self.streams = StreamHub(self.server.loop)

    def capacity_tokens(self) -> int:
        return self.cache.allocator.num_blocks * self.geometry.block_size

    def free_tokens(self) -> int:
        with self.lock:
            return self.cache.num_free_blocks * self.geometry.block_size

    def held(self) -> dict[str, int]:
        with self.lock:
            return {w: h.tokens for w, h in self.held_.items()}

    def admission_lock(self) -> threading.RLock:
        return self.lock

    def spec_stats(self) -> dict[str, int]:
        return dict(self.local.spec_stats) if self.cfg.engine.speculative.num_tokens else {}

    # --- admission ------------------------------------------------------------------------------------------
    async def Prepare(self, req: PrepareRequest, ctx) -> PrepareReply:
        """Reserve (on the RPC pool: it takes the cache lock), then await the DE-side load on the loop, so
        requests waiting for storage hold no thread and never delay ``PrefillDone`` of others. A full buffer is
        waited out on the loop (up to the transport's op timeout): under load, prompts queue here rather than
        fail."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.transport.op_timeout_s  # well inside the caller's timeout
        while True:
            try:
                reply, load = await loop.run_in_executor(self.server.pool, self._reserve, req)
                break
            except OutOfBlocksError as e:  # buffer slots free as held prompts move on to the cache and storage
                if loop.time() > deadline or self.geometry.num_blocks(req.num_prompt_tokens) > self.buffer.num_slots:
                    return PrepareReply(False, error=f"buffer full: {e}")
                await asyncio.sleep(0.02)
        if load is None:
            return reply
        results = await asyncio.wait_for(asyncio.wrap_future(load), self.cfg.transport.op_timeout_s * 4)
        return replace(reply, num_loaded_blocks=next((i for i, e in enumerate(results) if e is not None), len(results)))

    def _reserve(self, req: PrepareRequest) -> tuple[PrepareReply, Future | None]:
        """Device blocks for the prompt and every choice's generation budget (choices 1.. will share the prompt's
        full blocks: they reserve the rest), buffer slots for the prompt, and the storage read of the DE-side hit
        blocks started: ``(the reply, the load or None)``."""
        g, rid, n_prompt = self.geometry, req.request_id, req.num_prompt_tokens
        total = min(n_prompt + req.max_tokens, self.max_model_len)
        forks = [choice_id(rid, i) for i in range(1, req.n)]
        with self.lock:
            if rid in self.held_:
                return PrepareReply(False, error=f"{rid} is already held"), None
            if self.updating:
                return PrepareReply(False, error="the decode engine is loading new weights"), None
            if self.stopping.is_set():
                return PrepareReply(False, error="the decode engine is stopping"), None
            if choice_blocks(g.block_size, n_prompt, total, req.n) > self.cache.num_free_blocks:  # holds none yet
                return PrepareReply(False, error=f"no device memory for {req.n} x {total} tokens"), None
            slots = self.buffer.allocate(g.num_blocks(n_prompt), rid)  # full: Prepare waits and asks again
            self.cache.reserve(rid, total)
            for f in forks:
                self.cache.reserve_fork(f, n_prompt, total)
            self.held_[rid] = Held(rid, n_prompt, slots, req.n)
        if not req.load_keys:
            return PrepareReply(True, slots, 0), None
        first, keys = req.first_load_block, unpack_keys(req.load_keys)
        load = self.traffic.load(keys, slots[first : first + len(keys)])
        failpoint("decode.loading")
        return PrepareReply(True, slots, 0), load

    def Release(self, ref: RequestRef, ctx) -> Ack:
        """Its prefill engine ended it, and nothing of it is in flight any more (its buffer slots may be reused)."""
        self.inbox.put(("release", ref.request_id, ref.reason))
        return Ack()

    def PrefillDone(self, msg: PrefillDoneMsg, ctx) -> Ack:
        failpoint("decode.handoff")
        with self.lock:
            if msg.request_id not in self.held_:
                return Ack(False, f"{msg.request_id} is not held here")
        self.inbox.put(("admit", msg))
        return Ack()

    def on_cancel(self, work_id: str, reason: str) -> None:
        self.inbox.put(("drop", work_id, reason))

    def on_preempt(self, work_id: str) -> None:
        self.inbox.put(("preempt", work_id))

    # --- the decode loop ------------------------------------------------------------------------------------
    def loop(self) -> None:
        served = False  # data-parallel attention: the last turn served the group's forward (so wait for nothing)
        while not self.stopping.is_set():
            self._drain_inbox(block=not self.local.has_work() and not served)
            if self.settling:
                self._settle_overdue()
            if self.local.has_work():
                self._step()
            elif self.dp is not None:  # serve the group's forwards (``dualpath.engines.parallel.dp``)
                served = self.dp.idle()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if item[0] == "admit":
                self._admit(item[1])
            elif item[0] == "preempt":
                self._preempt(item[1])
            else:
                self._drop(item[1], item[2], settled=item[0] == "release")
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _admit(self, msg: PrefillDoneMsg) -> None:
        """Prompt KV: buffer -> paged cache, shared by every choice; persist the prompt's new full blocks; start
        decoding each choice from its first token."""
        g, rid = self.geometry, msg.request_id
        params = SamplingParams.from_dict(msg.sampling)
        if not self.guides_ready(params, lambda: self.inbox.put(("admit", msg)), stop_strings=True):
            return
        try:
            self.model.check_adapter(params.adapter)
        except RequestError as e:
            self.outbox.add("failed", [rid, str(e)])
            self._drop(rid, str(e))
            return
        if params.stop and self.local.tokenizer is None:  # stop strings end a choice here (None: the load failed,
            self.local.tokenizer = self._tokenizer  # and the frontend's match cancels the request as before)
        prompt = unpack_tokens(msg.tokens)
        with self.lock:
            h = self.held_.get(rid)
            if h is None or h.cancelled:
                return
            seqs = self._prompt_to_cache(h, msg, prompt, params)
        try:
            for s, tok, lp in zip(seqs, msg.first_tokens, msg.first_logprobs):
                s.guide = self.guides.guide_for(params, s.resumed)  # the prefill engine's first token replays too
                s.append(tok, _logprob(lp), self.local.eos_ids, self.max_model_len)
        except DualPathError as e:
            self.outbox.add("failed", [rid, f"structured output: {e}"])
            self._drop(rid, f"structured output: {e}")
            return
        hashes = block_hashes(prompt, self.fingerprint, g.block_size, salt=params.cache_salt, adapter=params.adapter)
        h.choices = [Choice(s, list(hashes), len(prompt) // g.block_size) for s in seqs]
        h.info = {
            "num_prompt_tokens": len(prompt),
            "num_cached_tokens": msg.num_cached_tokens,
            "path": msg.path,
            "storage_bytes": msg.storage_bytes,
        }
        self._store_prompt(h, hashes, msg.num_cached_tokens // g.block_size)
        self.outbox.add("started", rid)
        # the scheduler knows the reply streams before its first token leaves: a weight update's abort then ends it
        # (from a reply it believes has not started, it would requeue it, and the client go on on the new weights)
        self.report_now(timeout=1.0)
        for c in h.choices:
            with self.lock:
                running = not c.seq.finished and self.local.admit_prefilled(c.seq)
            # the prompt's logprobs (when asked) and the request's numbers on each choice's first event
            self._emit(c.seq, c.seq.output_ids[params.num_resumed_tokens :], msg.prompt_logprobs, h.info)
            if not running:
                self._finish(h, c)

    def _prompt_to_cache(
        self, h: Held, msg: PrefillDoneMsg, prompt: list[int], params: SamplingParams
    ) -> list[Sequence]:
        """The prompt's KV from the buffer into choice 0's blocks, the other choices forked off them (under the
        lock): every choice's sequence, its prompt computed."""
        self.ranks.run(buffer_to_cache, self.geometry, self.cache.block_table(h.work_id)[: len(h.slots)], h.slots)
        first = Sequence.choices(h.work_id, prompt, params, _generators(msg, params.n))
        seqs, first.forks = [first, *first.forks], []
        for s in seqs:
            if s.index:
                self.cache.fork(h.work_id, s.seq_id, len(prompt))
            s.num_computed = len(prompt)
        return seqs

    def _store_prompt(self, h: Held, hashes: list[BlockHash], first_new: int) -> None:
        """Write the prompt's full blocks from ``first_new`` on (those not loaded from storage) from the buffer;
        its slots are free once written."""
        n_full = h.choices[0].persisted
        if n_full > first_new:
            keys = hashes[first_new:n_full]
            fut = self.traffic.store(keys, [self.buffer.slot_bytes(s) for s in h.slots[first_new:n_full]])
            seq, bs = h.choices[0].seq, self.geometry.block_size
            parent = hashes[first_new - 1] if first_new else None
            h.stores.append(self._indexed(fut, keys, parent, seq.token_ids[first_new * bs : n_full * bs], seq))
            fut.add_done_callback(lambda _f, w=h.work_id: self.buffer.free_owner(w))
        else:
            self.buffer.free_owner(h.work_id)

    def _step(self) -> None:
        self.steps += 1
        if self.steps == 10:
            failpoint("decode.decoding")
        with self.lock:
            self.local.promote()  # the rows this step decodes, so their tokens are emitted below
            before = {s.seq_id: len(s.output_ids) for s in self.local.running}
            running = list(self.local.running)
            try:
                finished = self.local.step()
            except RankLostError:  # the engine stops; its replies move on from the tokens they have (``leave``)
                raise
            except Exception as e:  # noqa: BLE001 - fail the batch, keep the engine
                log.exception("decode step failed")
                for w in dict.fromkeys(s.group for s in running):
                    self.outbox.add("failed", [w, f"decode step failed: {e}"])
                    self.inbox.put(("drop", w, f"decode step failed: {e}"))
                self.local.running.clear()
                self.report_soon()
                return
        for s in running:
            self._emit(s, s.output_ids[before[s.seq_id] :])  # (a finished one's ending token says so)
            h = self.held_[s.group]
            self._persist(h, h.choices[s.index])
        for s in finished:
            h = self.held_[s.group]
            self._finish(h, h.choices[s.index])

    def _persist(self, h: Held, c: Choice) -> None:
        """Write every block of choice ``c`` whose KV is complete and not yet written."""
        g, seq = self.geometry, c.seq
        full = min(seq.num_computed, seq.num_tokens) // g.block_size
        if full <= c.persisted:
            return
        tokens = seq.token_ids
        parent = c.hashes[c.persisted - 1] if c.persisted else None
        with self.lock:
            table = self.cache.block_table(seq.seq_id)[c.persisted : full]
            blocks = self._full_blocks(table, (seq.seq_id, c.persisted))
        if blocks is None:
            return
        new_keys = block_hashes(
            tokens[c.persisted * g.block_size : full * g.block_size],
            self.fingerprint,
            g.block_size,
            parent=parent,
            salt=seq.params.cache_salt,
            adapter=seq.params.adapter,
        )
        c.hashes.extend(new_keys)
        fut = self.traffic.store(new_keys, blocks)
        if self.ranks.size > 1:  # the blocks were gathered in buffer slots of their own
            fut.add_done_callback(lambda _f, owner=(seq.seq_id, c.persisted): self.buffer.free_owner(owner))
        h.stores.append(
            self._indexed(fut, new_keys, parent, tokens[c.persisted * g.block_size : full * g.block_size], seq)
        )
        c.persisted = full

    def _full_blocks(self, table: list[int], owner) -> list[torch.Tensor] | None:
        """Canonical Full Blocks of cache blocks ``table``, to store. One device: copied out of the cache at once.
        Tensor parallelism: every rank writes its heads into buffer slots held by ``owner`` until stored; None
        when the buffer has no room now (the blocks are stored at a later step)."""
        if self.ranks.size == 1:
            return list(
                cache_to_full_blocks(self.cache.storage, torch.tensor(table, device=self.device), self.geometry).cpu()
            )
        try:
            slots = self.buffer.allocate(len(table), owner)
        except OutOfBlocksError:
            return None
        self.ranks.run(cache_to_buffer, self.geometry, table, slots)
        return [self.buffer.slot_bytes(s) for s in slots]

    def _finish(self, h: Held, c: Choice) -> None:
        """Persist the choice's last full blocks and free its own (shared ones go with the last holder). The
        request's last choice is reported and its stream closed from a helper thread, so the decode loop never
        waits for storage; an earlier one's end is streamed at once."""
        self._persist(h, c)
        c.done = True
        with self.lock:
            self.local.release(c.seq)
            self.cache.free(c.seq.seq_id)
        if h.unfinished:
            self.streams.put(h.work_id, self._finish_event(h, c, final=False))
            return
        threading.Thread(target=self._close, args=(h, c), daemon=True, name=f"close-{h.work_id}").start()

    def _finish_event(self, h: Held, c: Choice, final: bool) -> TokenEvent:
        reason = c.seq.finish_reason.value if c.seq.finish_reason else "abort"
        return TokenEvent(h.work_id, finish_reason=reason, index=c.seq.index, final=final, **h.info)

    def _indexed(
        self, fut: Future, keys: list[BlockHash], parent: BlockHash | None, tokens: list[int], seq: Sequence
    ) -> Future:
        """``fut`` (a store of ``keys``) done once the keys it wrote are in the outbox: each as soon as it is
        written, not when its request ends, so a reply whose engine dies mid-way is found again (and loaded) by
        its continuation (``dualpath.client``). The blocks written are published too (KV events: ``parent``, the
        block before the first; ``tokens``, theirs; ``seq``, whose)."""
        out: Future = Future()

        def done(f: Future) -> None:
            if f.exception() is not None:
                out.set_exception(f.exception())
                return
            ok = [e is None for e in f.result()]
            self.outbox.add("stored_keys", *[k for k, stored in zip(keys, ok) if stored])
            self.kv_events.stored(keys, parent, tokens, seq.params.adapter, ok)
            out.set_result(None)

        fut.add_done_callback(done)
        return out

    def _close(self, h: Held, last: Choice) -> None:
        for fut in h.stores:
            try:
                fut.result(self.cfg.transport.op_timeout_s * 4)
            except Exception as e:  # noqa: BLE001 - storing is best effort; the answer still stands
                log.warning("%s: storing blocks failed: %s", h.work_id, e)
        with self.lock:
            self.held_.pop(h.work_id, None)
        self.buffer.free_owner(h.work_id)
        self.outbox.add("finished", h.work_id)
        self.report_now()  # stored blocks are indexed before the submitter can send the next turn
        self.streams.put(h.work_id, self._finish_event(h, last, final=True))

    def leave(self) -> None:
        """Stopping (SIGTERM: a rolling restart, a drained node) hands every reply still held back to its
        submitter, to go on on another decode engine from the tokens it has (``dualpath.client`` moves it): the full
        blocks each has are stored and indexed first, so its continuation loads them; then the scheduler is told
        this engine is leaving, and each stream ends saying so (``TokenEvent.engine_lost``)."""
        with self.lock:  # the decode loop has returned: nothing below races a step
            held = [h for h in self.held_.values() if not h.cancelled]
        for h in held:
            for c in h.choices:
                if not c.done and not self.ranks.lost:  # (a lost rank's heads cannot be stored: recomputed)
                    self._persist(h, c)
        _await_stores([f for h in held for f in h.stores], "stopping")
        super().leave()
        why = f"decode engine {self.engine_id} is stopping"
        for h in held:
            self.streams.put(h.work_id, TokenEvent(h.work_id, finish_reason="abort", error=why, engine_lost=True))
        if held:
            log.info("stopping: %d request(s) handed back to their submitters to go on elsewhere", len(held))

    def _drop(self, work_id: str, reason: str, settled: bool = False) -> None:
        """End ``work_id``. ``settled``: its prefill engine says nothing of it is in flight. Otherwise, before its
        hand-off, that engine may still be writing its prompt's KV into its buffer slots (and a storage read may
        still be landing there): they stay out of use until that engine's ``Release``, or ``settle_s``."""
        with self.lock:
            h = self.held_.get(work_id)
        if settled:
            self._settle(work_id)
        if h is not None:
            in_flight = not settled and not h.choices
            self._free(h, keep_buffer=in_flight)
            if in_flight:
                self.settling[work_id] = time.monotonic() + self.settle_s
            log.info("%s dropped: %s", work_id, reason)
        # (never prepared here, too: a submitter may already be waiting on its stream)
        self.streams.put(work_id, TokenEvent(work_id, finish_reason="abort", error=reason))

    def _settle(self, work_id: str) -> None:
        if self.settling.pop(work_id, None) is not None:
            self.buffer.free_owner(work_id)

    def _settle_overdue(self) -> None:
        now = time.monotonic()
        for work_id in [w for w, at in self.settling.items() if at <= now]:
            log.warning(
                "%s: no word from its prefill engine in %.0f s; its buffer slots are reused", work_id, self.settle_s
            )
            self._settle(work_id)

    def _free(self, h: Held, keep_buffer: bool = False) -> None:
        """Forget ``h``: its rows leave the batch, its device blocks are free, and its buffer slots unless
        ``keep_buffer``."""
        with self.lock:
            self.held_.pop(h.work_id, None)
            h.cancelled = True
            for c in h.choices:
                self.local.release(c.seq)
            for i in range(h.n):
                self.cache.free(choice_id(h.work_id, i))
        if not keep_buffer:
            self.buffer.free_owner(h.work_id)

    def _preempt(self, work_id: str) -> None:
        """Hand a reply back (priority scheduling needs its memory for a more urgent request): the full blocks its
        choices have are stored, its memory is freed at once, and once the blocks are indexed its stream ends telling
        the submitter to go on from what it delivered (``TokenEvent.preempted``; ``dualpath.client`` continues it)."""
        with self.lock:
            h = self.held_.get(work_id)
            if h is None or h.cancelled or not h.choices or not h.unfinished:
                return  # it ended meanwhile (or is not generating yet: the scheduler names only started ones)
        for c in h.choices:  # (the decode loop calls this: no step races it)
            if not c.done:
                self._persist(h, c)
        self._free(h)
        threading.Thread(target=self._hand_back, args=(h,), daemon=True, name=f"preempt-{work_id}").start()

    def _hand_back(self, h: Held) -> None:
        why = f"preempted on decode engine {self.engine_id} for a more urgent request"
        try:
            _await_stores(h.stores, "preempting")
            self.outbox.add("failed", [h.work_id, why])
            self.report_now()  # the scheduler drops it and indexes its blocks before its continuation arrives
        finally:  # whatever happened, the reader learns to go on
            self.streams.put(
                h.work_id, TokenEvent(h.work_id, finish_reason="abort", error=why, engine_lost=True, preempted=True)
            )
        log.info("%s handed back: %s", h.work_id, why)

    # --- streams --------------------------------------------------------------------------------------------
    def _emit(
        self, seq: Sequence, tokens: list[int], prompt_logprobs: list[dict] | None = None, info: dict | None = None
    ) -> None:
        """Stream ``tokens``, the last of ``seq``'s: the first carries ``prompt_logprobs`` and ``info`` (a first
        event's), a token that ended the choice its reason (``TokenEvent.ending``)."""
        lps = seq.logprobs[len(seq.output_ids) - len(tokens) :]
        ending = seq.finish_reason.value if seq.finish_reason else ""
        for k, (tok, lp) in enumerate(zip(tokens, lps)):
            self.streams.put(
                seq.group,
                TokenEvent(
                    seq.group,
                    tok,
                    lp.__dict__ if lp is not None else None,
                    index=seq.index,
                    prompt_logprobs=None if k else prompt_logprobs,
                    ending=ending if k == len(tokens) - 1 else "",
                    **(info if info and not k else {}),
                ),
            )

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


def _await_stores(stores: list[Future], why: str) -> None:
    """Wait (``HAND_BACK_STORE_S`` in all) for the stores of replies being handed back, so their continuations
    load what they generated; what is not stored by then is computed again."""
    deadline = time.monotonic() + HAND_BACK_STORE_S
    for fut in stores:
        try:
            fut.result(max(0.0, deadline - time.monotonic()))
        except Exception as e:  # noqa: BLE001 - what is not stored is computed again by the continuation
            log.warning("%s: a store did not finish (%s); its blocks will be computed again", why, e)


def _generators(msg: PrefillDoneMsg, n: int) -> list[torch.Generator | None]:
    """Each choice's generator, where the prefill engine's left off (on the host, as in ``dualpath.engines.sampler``)."""
    if not msg.generator_states:
        return [None] * n
    out = []
    for state in msg.generator_states:
        gen = torch.Generator()
        gen.set_state(torch.from_numpy(np.frombuffer(bytes.fromhex(state), dtype=np.uint8).copy()))
        out.append(gen)
    return out


def _logprob(d: dict | None) -> TokenLogprob | None:
    return TokenLogprob(d["token_id"], d["logprob"], tuple(tuple(x) for x in d["top"]), d.get("rank", 0)) if d else None
