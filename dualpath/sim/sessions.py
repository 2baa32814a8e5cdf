"""Agent sessions in the cluster simulator (issue 51): tool gaps between turns, the runtime scheduler's own session
support, and a model of each engine's prefetcher. ``ClusterSim`` drives it when ``SimConfig.prefetch`` or
``affinity`` is on, or a round has a tool gap.

**Gaps.** A round's next turn is submitted ``tool_s`` after the round ends (when the scheduler learns it finished),
as the rollout runner's agents sleep through their tool calls.

**The scheduler's part is the scheduler's code**, run unmodified like every other decision of the simulator. With
``prefetch`` or ``affinity`` each turn names its agent's session (``SubmitRequest.session``, as the runner's
``sessions`` option does), and ``SimConfig.prefetch`` / ``affinity`` are the scheduler's ``session_prefetch`` /
``session_affinity``. So ``SchedulerCore`` and its ``SessionBook`` measure the gaps (``GapEstimator``), remember each
session's last engines and hand the policy an ``Affinity``; a turn's end is told as the runner's submitter tells it
(``TurnEnd``: a tool now runs unless it was the agent's last round; ``Sessions.ended`` runs ``SchedulerCore.end_turn``'s
steps with the simulator's block keys in place of hashing its placeholder tokens). What follows is theirs:

* *when*: ``end + max(0, q20(gap) - 1.5 x load time)`` (``prefetch_at``; the load time at the slower alpha of the
  turn's two nodes: ``_read_seconds``), ordered on the first pull after that and handed to the target engine with its
  group's next pull (``_order_prefetches``; a pull the simulator would leave out as idle is made when one is due);
* *where* (``_prefetch_engine``): the session's last decode engine; with a single prefill group, its last prefill or
  decode engine, the one whose node has the shorter read queue (``shorter_queue``); PE and Basic modes: the prefill
  side only, DE mode: the decode side only;
* *the next turn* (``dualpath.scheduler.policy`` / ``paper``): phase 1 keeps the last decode engine's group while it
  holds at most ``AFFINITY_SLACK`` x the groups' mean (with affinity on, or a prefetch ordered); phase 2 prefers the
  engine the prefetch went to (with affinity and no prefetch: the last decode engine) among the engines under Z, and
  Algorithm 1 the prefill engine holding it among the class it chose (``preferred``); a turn on the prefetch's engine
  reads on that side (``prefetched_side``) and its prefetched tokens are not charged to a read queue.

**The engines' part is modelled here** (``Prefetcher``: ``dualpath.traffic.prefetch.Prefetcher``, one per engine):

* An order's blocks are read leading block first; a block the engine holds already is only kept longer. Reads go
  ``prefetch_chunk_blocks`` at a time (the runtime reads one block at a time; chunks bound the events at scale), one
  chunk per engine in flight, started only while the node's storage client has no demand read queued or in flight;
  an order still waiting for the demand reads past its hold time is dropped (the runtime's ``_wait_idle``). A read
  needs a free buffer slot and stays within ``prefetch_share`` of the buffer's slots, else the rest of the order is
  skipped. Prefetch reads cross the node's storage link and storage NIC into its DRAM, and count as storage reads.
* Read blocks stay in the buffer after use, least recently used first: a later turn reading on that engine (on its
  side of the path) takes every block of its hit that the engine holds from DRAM, whether or not the scheduler placed
  it there for a prefetch, and reads only the others from storage. A block is freed ``hold_s`` after it was read or
  last ordered again (wasted if no turn used it), or when demand needs its slot.
* Demand slots are the runtime engines': a placed turn holds its prompt's blocks in its decode engine's buffer and,
  on the PE path, in its prefill engine's, until its prefill ends. Taking them frees prefetched blocks, least
  recently used first (``BufferPool``'s reclaimer); demand never waits here (past the buffer it overcommits).

Reported (``SimResult.sessions``): follow-up turns' TTFT, split by whether the scheduler placed them where their
prefetch was (the runtime's ``prefetched`` flag), and the share of their hit KV served from DRAM; prefetch bytes read,
used, wasted (and why) and still held; extra storage reads as a fraction of the hit KV loaded; engines kept; the
scheduler's session counters; and the working set over time: the KV stored for the sessions still running, and the
DRAM buffers' demand and prefetched bytes.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from dualpath.core.messages import PrefetchOrder
from dualpath.scheduler.sessions_policy import GapPrior

if TYPE_CHECKING:
    from dualpath.sim.cluster import Agent, ClusterSim, SimEngine, SimRequest

KEY_BITS = 24  # a held block's key: agent << KEY_BITS | block index (contexts stay far below 2^24 blocks)
_KEY_BYTES = 16  # the simulator's packed block keys: (mixed position, agent), little-endian u64 each


@dataclass
class _Order:
    agent: int
    blocks: int  # leading blocks of the session's context
    hold_s: float
    until: float  # still waiting for demand reads past this: dropped
    next: int = 0  # the next block to look at
    waited: bool = False  # it waited for the node's demand reads since it last read


class Prefetcher:
    """One engine's prefetcher and buffer slots (see the module docstring). ``ready``: held blocks, least recently
    used first, each ``[until, used]``."""

    __slots__ = ("engine", "node", "slots", "max_slots", "orders", "ready", "expiry", "per_agent", "reading", "demand")

    def __init__(self, engine: "SimEngine", slots: int, max_slots: int):
        self.engine, self.node = engine, engine.info.node_id
        self.slots, self.max_slots = slots, max_slots
        self.orders: deque[_Order] = deque()
        self.ready: OrderedDict[int, list] = OrderedDict()
        self.expiry: list[tuple[float, int]] = []  # heap of (until, key); stale entries skipped
        self.per_agent: dict[int, int] = {}  # blocks held per agent
        self.reading = 0  # blocks of the chunk in flight
        self.demand = 0  # slots held by placed turns

    @property
    def free(self) -> int:
        return self.slots - self.demand - len(self.ready) - self.reading


class Sessions:
    """A simulation's sessions: gaps, the engines' prefetchers and buffers, and what they cost and gained."""

    def __init__(self, sim: "ClusterSim", block_keys: Callable[[int, int, int], bytes]):
        """``block_keys(agent, first, last)``: the simulator's packed keys of an agent's blocks ``first`` to ``last``."""
        cfg = sim.cfg
        self.sim, self.cfg, self.block_keys = sim, cfg, block_keys
        self.tracked = cfg.prefetch or cfg.affinity  # turns name their sessions: the scheduler's support is on
        self.prefetching = cfg.prefetch and sim.reads
        self.block_bytes = cfg.block_size * cfg.model.kv_bytes_per_token
        self.prior = GapPrior()  # the gaps as the scheduler measures them (every session's, for the report)
        self.ended_at: dict[int, float] = {}  # agent -> its last turn's end, until its next is submitted
        self.stored: dict[int, int] = {}  # agent -> its stored blocks (the working set's part)
        self.last: dict[int, tuple[str, str]] = {}  # agent -> the (prefill, decode) engines of its last turn
        self.engines: dict[str, Prefetcher] = {}  # made as the engines are first met
        self.by_node: dict[str, list[Prefetcher]] = {}
        self._flows = itertools.count()
        self.samples: list[tuple[float, float, float, float]] = []  # (t, storage, buffers' demand, prefetched)
        self.total = [0.0, 0.0, 0.0]  # now: storage, buffers' demand, buffers' prefetched (bytes)
        self.peak = [0.0, 0.0, 0.0]  # their highest, at any moment
        self.bytes = dict.fromkeys(("read", "used", "wasted", "served"), 0.0)
        self.wasted_by = dict.fromkeys(("expired", "reclaimed"), 0.0)
        self.counts = dict.fromkeys(
            (
                "orders",
                "ordered_blocks",
                "read_blocks",
                "refreshed_blocks",
                "skipped_blocks",
                "no_room",
                "dropped",
                "expired_blocks",
                "reclaimed_blocks",
                "full",
                "partial",
            ),
            0,
        )
        self.hit_bytes = 0.0  # hit KV loaded by turns, from storage or a buffer
        # per follow-up turn: (when its first token came, TTFT, the share of its hit KV served from DRAM, whether the
        # scheduler placed it where its prefetch was, whether it kept its last prefill engine, its last decode engine,
        # its agent, its round, whether it read on the PE path)
        self.turns: list[tuple[float, float, float, bool, bool, bool, int, int, bool]] = []

    def prefetcher(self, e: "SimEngine") -> Prefetcher:
        p = self.engines.get(e.info.engine_id)
        if p is None:
            cfg = self.cfg
            slots = int(cfg.buffer_bytes_per_node / cfg.engines_per_node(e.info.role) // self.block_bytes)
            p = self.engines[e.info.engine_id] = Prefetcher(e, slots, int(slots * cfg.prefetch_share))
            self.by_node.setdefault(p.node, []).append(p)
        return p

    # --- turns ------------------------------------------------------------------------------------------------
    def joined(self, agent: "Agent") -> None:
        """An agent met mid-trajectory: its context so far is stored."""
        blocks = self.stored[agent.index] = agent.context // self.cfg.block_size
        self._add(0, blocks * self.block_bytes)

    def submitted(self, agent: "Agent", rid: str, now: float) -> None:
        """A turn is sent: the gap since the last one ended is measured (the scheduler does the same)."""
        end = self.ended_at.pop(agent.index, None)
        if end is not None:
            self.prior.observe(now - end)

    def ended(self, agent: "Agent", rid: str, now: float) -> None:
        """A turn ended (the scheduler was told): its blocks are stored; its submitter tells the scheduler the session
        now waits for a tool unless that was its last round (``TurnEnd``), and the scheduler plans the prefetch."""
        bs = self.cfg.block_size
        blocks = agent.context // bs
        self._add(0, (blocks - self.stored.get(agent.index, 0)) * self.block_bytes)
        self.stored[agent.index] = blocks
        last = agent.next_round >= len(agent.rounds)
        if last:  # the session's KV leaves the working set
            self._add(0, -blocks * self.block_bytes)
            self.stored.pop(agent.index)
        else:
            self.ended_at[agent.index] = now
        if not self.tracked:
            return
        core = self.sim.core
        keys = self.block_keys(agent.index, 0, blocks)
        with core.lock:  # SchedulerCore.end_turn, the simulator's block keys for the hashes of the context
            s = core.sessions.turn_end(rid, b"", keys, not last, None, core.clock())
            if s is not None:
                core._plan_prefetch(s)

    def placed(self, req: "SimRequest", pe: "SimEngine", de: "SimEngine", on_pe: bool) -> int:
        """A turn's prefill starts (on the PE path: ``on_pe``): its engines take their demand slots, and the reading
        engine serves what it holds of the turn's hit; how many hit blocks it serves (the rest come from storage)."""
        bs, agent = self.cfg.block_size, req.agent.index
        if req.agent.next_round:
            last = self.last.get(agent)
            req.kept = (last[0] == pe.info.engine_id, last[1] == de.info.engine_id) if last else (False, False)
        self.last[agent] = (pe.info.engine_id, de.info.engine_id)
        n = -(-req.prompt // bs)  # the prompt's blocks, as the engines hold them
        slots = [(self.prefetcher(de), n)] + ([(self.prefetcher(pe), n)] if on_pe else [])
        for p, k in slots:
            self._take(p, k)
        req.buffer_slots = slots
        req.on_pe = on_pe
        hit = req.hit_tokens // bs
        self.hit_bytes += hit * self.block_bytes
        served = self._served(self.prefetcher(pe if on_pe else de), agent, hit) if self.prefetching else 0
        req.prefetched = served
        return served

    def prefilled(self, req: "SimRequest", ttft: float) -> None:
        """A turn's prefill ended: its demand slots are freed; a follow-up turn's TTFT is recorded."""
        for p, k in req.buffer_slots:
            p.demand -= k
            self._add(1, -k * self.block_bytes)
        req.buffer_slots = ()
        if req.agent.next_round:  # (not yet moved on: the round this request is)
            hit = req.hit_tokens // self.cfg.block_size
            share = req.prefetched / hit if hit else 0.0
            if hit and req.prefetched:
                self.counts["full" if req.prefetched >= hit else "partial"] += 1
            a = req.agent
            self.turns.append(
                (self.sim.loop.now, ttft, share, req.on_prefetch, *req.kept, a.index, a.next_round, req.on_pe)
            )

    # --- the engines' prefetchers -----------------------------------------------------------------------------
    def needs_pull(self, engines) -> bool:
        """Whether a pull of a group (``engines``) the simulator would leave out as idle must be made: a prefetch is
        due to be ordered, or one waits for one of these engines."""
        if not self.tracked:
            return False
        core = self.sim.core
        if core.prefetch_for and any(e.info.engine_id in core.prefetch_for for e in engines):
            return True
        due = core.sessions._due  # (a peek: ``due`` pops what it returns)
        return bool(due) and due[0][0] <= core.clock()

    def order(self, orders: dict[str, list[PrefetchOrder]]) -> None:
        """A pull's reply brought prefetch orders for engines of the group."""
        now = self.sim.loop.now
        for eid, batch in orders.items():
            p = self.prefetcher(self.sim.engines[eid])
            for o in batch:
                n = len(o.keys) // _KEY_BYTES
                agent = int.from_bytes(o.keys[8:16], "little")  # the sim's keys name their agent
                p.orders.append(_Order(agent, n, o.hold_s, now + o.hold_s))
                self.counts["orders"] += 1
                self.counts["ordered_blocks"] += n
            self._pump(p)

    def pump(self, node: str) -> None:
        """The node's storage client has no demand read left: its engines' prefetchers go on."""
        for p in self.by_node.get(node, ()):
            self._pump(p)

    def _pump(self, p: Prefetcher) -> None:
        """Start the engine's next prefetch chunk, unless one is in flight or the node has demand reads."""
        if p.reading or not p.orders or not self.prefetching:
            return
        sim, now = self.sim, self.sim.loop.now
        busy = bool(sim.read_queue.get(p.node) or sim.reading.get(p.node))
        self._expire(p)
        while p.orders:
            o = p.orders[0]
            key0 = o.agent << KEY_BITS
            while o.next < o.blocks and (key0 | o.next) in p.ready:  # held already: kept longer
                self._refresh(p, key0 | o.next, now + o.hold_s)
                o.next += 1
            if o.next >= o.blocks:
                p.orders.popleft()
                continue
            if busy or (o.waited and now > o.until):
                if now <= o.until:
                    o.waited = True
                    return  # demand reads first: the node's next idle moment pumps again
                self.counts["dropped"] += 1
                self._skip(p, o)
                continue
            o.waited = False
            n, limit = 1, min(self.cfg.prefetch_chunk_blocks, o.blocks - o.next)
            while n < limit and (key0 | (o.next + n)) not in p.ready:
                n += 1
            n = min(n, p.max_slots - len(p.ready) - p.reading, p.free)
            if n <= 0:  # no free slot, or the prefetch share is full
                self.counts["no_room"] += 1
                self._skip(p, o)
                continue
            self._read(p, o, n)
            return

    def _skip(self, p: Prefetcher, o: _Order) -> None:
        """The rest of the order is not read (a hit is a leading run: past a missing block it would not be used)."""
        self.counts["skipped_blocks"] += o.blocks - o.next
        p.orders.popleft()

    def _read(self, p: Prefetcher, o: _Order, n: int) -> None:
        sim, size, first = self.sim, n * self.block_bytes, o.next
        o.next += n
        p.reading = n
        self.bytes["read"] += size
        self.counts["read_blocks"] += n
        node, e = p.node, p.engine

        def done():
            p.reading = 0
            sim.read_bytes[node] = sim.read_bytes.get(node, 0.0) + size  # storage reads, as the engines report them
            e.read_bytes += size
            e.dirty = True
            until, key0 = sim.loop.now + o.hold_s, o.agent << KEY_BITS
            for b in range(first, first + n):
                p.ready[key0 | b] = [until, False]
                heapq.heappush(p.expiry, (until, key0 | b))
            p.per_agent[o.agent] = p.per_agent.get(o.agent, 0) + n
            self._add(2, size)
            self._pump(p)

        sim.loop.transfer(f"prefetch:{next(self._flows)}", size, self._route(node), done)

    def _route(self, node: str) -> tuple:
        """Storage -> the node's DRAM buffer: its storage client, its storage NIC, one DRAM write."""
        route = ((f"{node}/snic", 1.0), (f"{node}/dram", 1.0), (f"{node}/storage_read", 1.0))
        return route + ((("storage", 1.0),) if "storage" in self.sim.loop.net.capacity else ())

    def _refresh(self, p: Prefetcher, key: int, until: float) -> None:
        e = p.ready[key]
        if until > e[0]:
            e[0] = until
            heapq.heappush(p.expiry, (until, key))
        p.ready.move_to_end(key)
        self.counts["refreshed_blocks"] += 1

    def _served(self, p: Prefetcher, agent: int, hit: int) -> int:
        """The hit blocks ``p``'s engine holds (each becomes the most recently used)."""
        if not p.per_agent.get(agent):
            return 0
        self._expire(p)
        n, key0, ready = 0, agent << KEY_BITS, p.ready
        for b in range(hit):
            e = ready.get(key0 | b)
            if e is None:
                continue
            ready.move_to_end(key0 | b)
            n += 1
            if not e[1]:
                e[1] = True
                self.bytes["used"] += self.block_bytes
        self.bytes["served"] += n * self.block_bytes
        return n

    def _take(self, p: Prefetcher, n: int) -> None:
        """Demand takes ``n`` slots: prefetched blocks go first when the free ones are too few, least recently used
        first."""
        self._expire(p)
        short = n - p.free
        if short > 0:
            gone = list(itertools.islice(p.ready, short))
            for key in gone:
                self._drop(p, key, "reclaimed")
            self.counts["reclaimed_blocks"] += len(gone)
        p.demand += n
        self._add(1, n * self.block_bytes)

    def _expire(self, p: Prefetcher) -> None:
        """Free the blocks whose hold time is over (the runtime looks about once a second; here: when it matters)."""
        now, heap = self.sim.loop.now, p.expiry
        while heap and heap[0][0] <= now:
            until, key = heapq.heappop(heap)
            e = p.ready.get(key)
            if e is not None and e[0] == until:
                self.counts["expired_blocks"] += 1
                self._drop(p, key, "expired")

    def _drop(self, p: Prefetcher, key: int, why: str) -> None:
        e = p.ready.pop(key)
        agent = key >> KEY_BITS
        left = p.per_agent[agent] - 1
        if left:
            p.per_agent[agent] = left
        else:
            del p.per_agent[agent]
        self._add(2, -self.block_bytes)
        if not e[1]:
            self.bytes["wasted"] += self.block_bytes
            self.wasted_by[why] += self.block_bytes

    # --- the working set ------------------------------------------------------------------------------------
    def _add(self, kind: int, delta: float) -> None:
        """Bytes in storage (``kind`` 0), the buffers' demand (1) or the buffers' prefetched blocks (2) change."""
        self.total[kind] += delta
        if self.total[kind] > self.peak[kind]:
            self.peak[kind] = self.total[kind]

    def sample(self) -> None:
        """Record the working set now, and again ``session_sample_s`` later while any agent has rounds left."""
        sim = self.sim
        for p in self.engines.values():
            self._expire(p)
        self.samples.append((sim.loop.now, *self.total))
        if sim.unfinished:
            sim.loop.after(self.cfg.session_sample_s, self.sample)

    def summary(self, since: float = 0.0) -> dict:
        """Follow-up turns' TTFT (the turns whose first token came at ``since`` or later), prefetch bytes and counts,
        affinity, the working set (all of the run)."""
        for p in self.engines.values():
            self._expire(p)
        turns = [x for x in self.turns if x[0] >= since]
        t = np.array([x[1] for x in turns], dtype=np.float64)
        share = np.array([x[2] for x in turns], dtype=np.float64)
        flag = np.array([x[3] for x in turns], dtype=bool)

        def stats(mask) -> dict:
            xs = t[mask]
            return {
                "turns": int(len(xs)),
                "ttft_p50_s": float(np.median(xs)) if len(xs) else 0.0,
                "ttft_p90_s": float(np.quantile(xs, 0.9)) if len(xs) else 0.0,
                "ttft_mean_s": float(xs.mean()) if len(xs) else 0.0,
            }

        if not self.samples or self.samples[-1][0] < self.sim.loop.now:
            self.samples.append((self.sim.loop.now, *self.total))  # the end
        hit = self.hit_bytes
        b = self.bytes
        held = sum(len(p.ready) for p in self.engines.values()) * self.block_bytes
        unused = sum(not e[1] for p in self.engines.values() for e in p.ready.values()) * self.block_bytes
        inflight = sum(p.reading for p in self.engines.values()) * self.block_bytes
        counters = self.sim.core.counters
        return {
            "follow_up": stats(np.ones(len(t), dtype=bool)),
            # placed where the scheduler ordered its prefetch (the runtime rounds' ``prefetched``)
            "follow_up_prefetched": stats(flag),
            "follow_up_not_prefetched": stats(~flag),
            "follow_up_from_dram": stats(share >= 1.0),  # every hit block served from a buffer
            "follow_up_partly_from_dram": stats((share > 0) & (share < 1.0)),
            "prefetched_fraction": float(flag.mean()) if len(flag) else 0.0,
            "dram_share_of_hits": float(share.mean()) if len(share) else 0.0,
            "kept_prefill_engine": float(np.mean([x[4] for x in turns])) if turns else 0.0,
            "kept_decode_engine": float(np.mean([x[5] for x in turns])) if turns else 0.0,
            "prefetch_issued_bytes": b["read"],
            "prefetch_used_bytes": b["used"],
            "prefetch_wasted_bytes": b["wasted"],
            "prefetch_held_bytes_at_end": held,
            # read = used + wasted + held unused + in flight
            "prefetch_held_unused_bytes_at_end": unused,
            "prefetch_inflight_bytes_at_end": inflight,
            "prefetch_served_bytes": b["served"],  # hit KV taken from buffers (a block used twice counts twice)
            "prefetch_wasted_by": dict(self.wasted_by),
            "prefetch_counts": dict(self.counts),
            "scheduler": {k: v for k, v in counters.items() if k.startswith(("session_", "prefetch_"))},
            "hit_bytes": hit,
            "storage_bytes_for_hits": hit - b["served"] + b["read"],  # demand reads + every prefetch read
            "extra_storage_read_fraction": b["wasted"] / hit if hit else 0.0,
            "gap_prior_median_s": self.prior.median() or 0.0,
            "gaps_observed": self.prior.count,
            "working_set_peak_bytes": {
                "storage": self.peak[0],
                "dram_demand": self.peak[1],
                "dram_prefetch": self.peak[2],
            },
            "working_set": [
                {"t": r[0], "storage_bytes": r[1], "dram_demand_bytes": r[2], "dram_prefetch_bytes": r[3]}
                for r in self.samples
            ],
        }
