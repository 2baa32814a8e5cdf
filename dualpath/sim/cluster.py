"""A simulated P/D cluster driven by the project's own scheduler: ``SchedulerCore`` and its policies, unmodified,
place every request; engines, storage and links are models on one event clock.

What is modelled (and what is not):
* Engines: one per ``prefill_tp`` GPUs of a prefill node (``decode_tp`` of a decode node; 1: one per GPU), grouped
  by node, each with ``EngineModel.with_tp``'s capacity: its ranks' KV tokens and their compute less the all-reduces
  (the scheduler sees fewer, bigger engines; a node's links are the same whatever the TP; an engine's KV moves
  through all its ranks' CNICs). Each group pulls from the scheduler about every ``pull_interval_s`` (group i of
  n first at i/n of the interval, each wait jittered by ``pull_jitter``: real groups' pulls are neither aligned
  nor phase-locked, they wait a fixed time after each reply) with load reports built like the real engines' (seq,
  tok, the node's storage read queue in tokens, free KV tokens, held requests, finished ones and the blocks they
  stored).
* A prefill GPU's HBM bounds the KV resident on it (``SimConfig.prefill_kv_budget_bytes``, by default what the
  model's weights leave: ``hardware.PrefillWeights``). A request's hit KV lands in its prefill GPU as it is read (the
  read is one flow ending there), so its room is taken when its read is issued to the node's storage queue (the
  read's destination) and given back when its prefill ends: all layers of its prompt (cached + new) for basic
  prefill, two layers (the one computing, the next arriving) for layerwise. A read whose KV does not fit waits, in
  assignment order, for earlier prefills on that engine to end; a single request larger than the budget is an
  error.
* A prefill engine runs its requests one at a time (no batching across requests) for ``CostModel.predict`` seconds,
  the form the real engines fit at start-up, the most urgent ready one next (``SamplingParams.priority``; FIFO
  within a priority, as the real engines batch). Layerwise prefill starts computing when the request's read starts and
  ends no earlier than one layer's compute after the read ends; whole-KV (``basic``) prefill starts after the read.
* A request's hit KV is one flow over every link its read path crosses (``links.PE_PATH`` / ``DE_PATH``, storage
  included), sharing links max-min fairly with all other flows: the fluid view of a layer-pipelined transfer.
  The reading node's storage client serves its read queue FIFO, ``reads_per_node`` requests at a time (the
  queue's bytes are the node's read_q). Miss-token KV (1-2% of a turn) is not moved, as in the paper's §4.2.
* A decode engine steps its running requests together: a step takes ``fixed + per_seq × batch + per_token × Σ
  context`` seconds and gives every running request one token; a request holds prompt + generation KV tokens.
* ``oracle`` reads no storage: hit KV is already in place (the paper's Oracle, an upper bound).
* Agent sessions (``dualpath.sim.sessions``): a round given as (append, gen, tool_s) is followed by a tool call of
  ``tool_s`` seconds before the next round is sent; ``prefetch`` and ``affinity`` turn on the scheduler's own session
  support (its ``session_prefetch`` and ``session_affinity``: turns name their sessions, the scheduler orders a
  session's stored KV read into an engine's DRAM buffer during the gap and places the next turn by it), and the
  engines' prefetchers are modelled; ``SimResult.sessions`` reports what they did (follow-up TTFT by prefetch, bytes,
  the working set).
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from dualpath.core.config import SchedulerConfig
from dualpath.core.geometry import LAYERWISE_RESIDENT_LAYERS
from dualpath.core.sessions import SessionHint
from dualpath.core.messages import EngineInfo, EngineLoad, Role, SubmitEvent, SubmitRequest
from dualpath.core.sampling_params import SamplingParams
from dualpath.sim.events import EventLoop
from dualpath.sim.hardware import EngineModel, Hardware, ModelPreset, engines_per_node
from dualpath.sim.links import DE_PATH, PE_PATH, cluster_links, path_route
from dualpath.sim.network import FlowNetwork
from dualpath.sim.sessions import Sessions
from dualpath.engines.batcher import CostModel
from dualpath.scheduler.core import SchedulerCore, request_of
from dualpath.scheduler.policies import make_policy

SYSTEMS = {  # name -> (scheduler mode, policy, layerwise, reads storage)
    "basic": ("basic", "dualpath", False, True),
    "layerwise": ("pe", "dualpath", True, True),
    "dualpath-rr": ("dualpath", "round-robin", True, True),
    "dualpath": ("dualpath", "dualpath", True, True),
    "oracle": ("dualpath", "dualpath", True, False),
}
_MIX = 0x9E3779B97F4A7C15  # odd: multiplying by it is a bijection of 64-bit integers
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SimConfig:
    hardware: Hardware
    model: ModelPreset
    engine: EngineModel
    prefill_nodes: int
    decode_nodes: int
    system: str = "dualpath"
    storage_bps: float = math.inf  # the storage system's aggregate read bandwidth (each node also has its SNIC)
    block_size: int = 64
    pull_interval_s: float = 0.1  # real engines pull every 20 ms; coarser here for speed (~1% of a turn)
    reads_per_node: int = 16  # a node's storage client keeps this many requests' reads in flight (FIFO queue)
    # A real engine waits the interval after each pull's reply, so its phase against other groups drifts with RPC
    # times: each wait here is the interval x U[1 - j, 1 + j]. Without drift one prefill group would always pull
    # first after the decode groups refill the queue, and take all of it (Algorithm 1 looks at the pulling group).
    pull_jitter: float = 0.2
    seed: int = 0
    every_pull: bool = False  # send every pull with every engine's report (same decisions, slower: for tests)
    scheduling_policy: str = "fcfs"  # SchedulerConfig's: "priority" orders the queues by the agents' priorities
    longest_first: bool = False  # each round's priority is minus its agent's rounds left (RolloutConfig's)
    # GPUs per engine (tensor parallelism) on prefill and decode nodes: each must divide ``hardware.gpus``
    prefill_tp: int = 1
    decode_tp: int = 1
    # layerwise systems: a DE-path read overlaps the prefill layer by layer (the paper's design); False: the prefill
    # starts once the decode engine's load has ended, as this runtime's engines do (DecodeEngine.Prepare answers
    # after its DE-side load)
    de_read_overlap: bool = True
    # agent sessions (dualpath.sim.sessions): the scheduler's session_prefetch (a session's stored KV read into an
    # engine's DRAM buffer during its tool gap) and session_affinity (its turns kept on their decode engine); each
    # engine's DRAM buffer is its node's / the node's engines (the paper's DS setting: 80 GB), of which prefetched
    # blocks take at most prefetch_share (the engines' EngineProcessConfig.prefetch_share)
    prefetch: bool = False
    affinity: bool = False
    buffer_bytes_per_node: float = 80e9
    prefetch_share: float = 0.5
    prefetch_chunk_blocks: int = 1  # blocks a prefetch reads per transfer (the runtime: one; more: fewer events)
    session_sample_s: float = 10.0  # how often the working set is sampled (runs with sessions)
    # a prefill GPU's HBM for resident KV; None: what the model's weights leave (ModelPreset.prefill_weights; a model
    # without them: no bound)
    prefill_kv_budget_bytes: float | None = None

    def __post_init__(self):
        if self.system not in SYSTEMS:
            raise ValueError(f"system must be one of {sorted(SYSTEMS)}, got {self.system!r}")
        _, policy, _, reads = SYSTEMS[self.system]
        if (self.prefetch or self.affinity) and (policy != "dualpath" or not reads):
            raise ValueError(
                f"prefetch and affinity need a system that reads storage with the paper's policy, not {self.system}"
            )
        if (
            self.prefetch_chunk_blocks < 1
            or self.buffer_bytes_per_node < 0
            or self.session_sample_s <= 0
            or not 0 <= self.prefetch_share <= 1
        ):
            raise ValueError(
                "prefetch_chunk_blocks >= 1, buffer_bytes_per_node >= 0, session_sample_s > 0 and prefetch_share in "
                "[0, 1]"
            )
        self.engines_per_node(Role.PREFILL), self.engines_per_node(Role.DECODE)  # refuse a TP the node cannot take

    def pe_kv_budget_bytes(self) -> float:
        """One prefill engine's HBM for resident KV: its GPUs' (an EP deployment over every prefill GPU)."""
        per_gpu = self.prefill_kv_budget_bytes
        if per_gpu is None:
            w = self.model.prefill_weights
            per_gpu = w.kv_budget_bytes(self.hardware, self.prefill_nodes * self.hardware.gpus) if w else math.inf
        return per_gpu * self.prefill_tp

    def tp(self, role: Role) -> int:
        return self.prefill_tp if role is Role.PREFILL else self.decode_tp

    def engines_per_node(self, role: Role) -> int:
        return engines_per_node(self.hardware, self.tp(role), role.value)


@dataclass(slots=True)  # the run reads and writes these fields millions of times
class Agent:
    """One trajectory: rounds of (appended tokens, generated tokens), each issued when the one before finished, or
    (appended, generated, tool_s): ``tool_s`` seconds after it (a tool call; 0: at once)."""

    index: int
    rounds: list[tuple]
    context: int = 0  # tokens before the next round's append
    next_round: int = 0
    finished_at: float = 0.0
    start: float = 0.0  # when its first round is submitted (online runs: the arrival time)
    priority: int = 0  # every round's SamplingParams.priority (unless SimConfig.longest_first)


@dataclass(slots=True)
class SimRequest:
    agent: Agent
    prompt: int
    gen: int
    submitted: float
    hit_tokens: int = 0
    de: str = ""
    prefill_done: float = 0.0
    generated: int = 0  # decode: settled at hand-off and at finish (while running: ``base`` + the engine's steps)
    done: float = 0.0
    base: int = 0  # decode: generated - the engine's steps, fixed while it runs
    priority: int = 0  # its SamplingParams.priority
    # sessions: whether it kept its last turn's (prefill, decode) engines, the buffer slots it holds until its prefill
    # ends ((prefetcher, slots) pairs), the hit blocks it took from a DRAM buffer, and whether the scheduler placed it
    # where its prefetch was (the "assigned" event's ``prefetched``)
    kept: tuple[bool, bool] = (False, False)
    buffer_slots: tuple | list = ()
    prefetched: int = 0
    on_prefetch: bool = False
    on_pe: bool = True  # it reads on the PE path
    resident_bytes: float = 0.0  # prefill: the KV it keeps in its prefill engine's HBM from read issue to prefill end


@dataclass(slots=True)
class SimEngine:
    info: EngineInfo
    gpu: tuple[str, int]  # (node, its first GPU's index) for link routes
    ranks: int = 1  # its GPUs: ``gpu`` and the next ranks - 1 of the node (tensor parallelism)
    running: dict[str, SimRequest] = field(default_factory=dict)  # decode: generating, as of ``seg_start``
    joining: list[tuple[str, SimRequest]] = field(default_factory=list)  # decode: join at the next step boundary
    held: dict[str, SimRequest] = field(default_factory=dict)  # admitted, not finished
    held_tokens: int = 0  # Σ tokens(held request) (decode: generation counted as it is settled)
    reserved: int = 0  # Σ prompt + gen over ``held``: the KV the engine has promised
    busy_until: float = 0.0
    # prefill: requests whose compute may start, a heap of (priority, order, work, request, read start, read end),
    # and whether the GPU runs one (its end event may be due at ``busy_until`` = now and not yet have fired)
    ready: list = field(default_factory=list)
    computing: bool = False
    compute_s: float = 0.0  # the compute time of the prefill it runs (or ran last)
    # Decode runs in segments of steps with a fixed membership: ``seg_steps`` steps from ``seg_start`` with
    # ``running`` as it was then, ending at the first finish (or earlier, at a step boundary, when a request joins).
    seg_start: float = 0.0
    seg_steps: int = 0
    seg_context: int = 0  # Σ prompt + generated over running at seg_start
    seg_version: int = 0  # a segment's end event is stale when the segment was cut short since
    # Settling a segment touches only what finishes: a running request has generated ``base + steps`` tokens and
    # finishes at ``steps == gen - base`` (the heap's key, then its join order), so Σ prompt + generated over
    # ``running`` is ``run_base + len(running) x steps``.
    steps: int = 0  # decode steps run so far, as of ``seg_start``
    run_base: int = 0  # Σ prompt + base over running
    finish: list = field(default_factory=list)  # heap of (step it finishes at, join order, work) over running
    finished: list[str] = field(default_factory=list)
    stored: list[bytes] = field(default_factory=list)
    # prefill: the KV resident in HBM (reads issued, prefills not ended), the assignments waiting for room (FIFO),
    # and the most it held
    resident: float = 0.0
    hbm_wait: deque = field(default_factory=deque)
    resident_peak: float = 0.0
    read_bytes: float = 0.0  # storage bytes completed since the last report
    reported: tuple = ()  # (seq, tok, reserved) as last reported
    dirty: bool = False  # touched since the last report (a cheap first test of ``ClusterSim._changed``)

    def tokens(self, req: SimRequest) -> int:
        """A request's part of the engine's reported load, as the real engines count it: a prefill engine the
        tokens it has still to compute (the misses), a decode engine the request's KV."""
        if self.info.role is Role.PREFILL:
            return req.prompt - req.hit_tokens
        return req.prompt + req.generated

    def admit(self, work: str, req: SimRequest) -> None:
        self.dirty = True
        self.held[work] = req
        self.held_tokens += self.tokens(req)
        self.reserved += req.prompt + req.gen

    def release(self, work: str) -> SimRequest:
        self.dirty = True
        req = self.held.pop(work)
        self.held_tokens -= self.tokens(req)
        self.reserved -= req.prompt + req.gen
        return req


class BlockKeys:
    """Stored blocks' hashes, packed, for blocks ``first`` to ``last`` (exclusive) of an agent's context: the first
    8 bytes ``((agent + 1) << 32 | block) x MIX`` (mod 2^64: a bijection), the next the agent, so they are unique
    per (agent, position) and an agent's turns share their prefix blocks. Blocks are below 2^32, so the product is
    ``(agent + 1) x 2^32 x MIX + block x MIX``, and ``block x MIX`` comes from a table grown as contexts grow: one
    numpy operation a call (every turn's prompt keys are built here, ~1,000 blocks each)."""

    def __init__(self) -> None:
        self._mixed = np.zeros(0, dtype=np.uint64)  # block x MIX (mod 2^64) for blocks 0 .. len - 1

    def keys(self, agent: int, first: int, last: int) -> bytes:
        n = max(0, last - first)
        if first + n > len(self._mixed):
            size = max(first + n, 2 * len(self._mixed), 1024)
            self._mixed = np.arange(size, dtype=np.uint64) * np.uint64(_MIX)
        out = np.empty((n, 2), dtype="<u8")
        np.add(self._mixed[first : first + n], ((agent + 1) << 32) * _MIX & _MASK64, out=out[:, 0])  # wraps
        out[:, 1] = agent
        return out.tobytes()


@dataclass
class SimResult:
    jct_s: float
    turns: int
    storage_read_bytes: dict[str, float]
    ttft_s: list[float]
    link_bytes: dict[str, float]
    tpot_s: list[float] = field(default_factory=list)  # per request: decode time per token after the first
    ttft_at: list[float] = field(default_factory=list)  # when each ttft_s entry's first token came
    tpot_at: list[float] = field(default_factory=list)  # when each tpot_s entry's request finished
    ttft_agent: list[int] = field(default_factory=list)  # whose turn each ttft_s entry is (the agent's index)
    sessions: dict = field(default_factory=dict)  # runs with sessions: dualpath.sim.sessions.Sessions.summary


class ClusterSim:
    def __init__(
        self,
        cfg: SimConfig,
        rounds_per_agent: list[list[tuple[int, int]]],
        starts: list[float] | None = None,
        priorities: list[int] | None = None,
        first_rounds: list[int] | None = None,
    ):
        """``starts``: when each agent sends its first round (default 0); ``priorities``: each agent's; and
        ``first_rounds``: the round each agent starts at (default 0), its earlier rounds' context already stored (an
        agent met mid-trajectory: a short run sees agents at every stage, as a long one's steady state does)."""
        self.cfg = cfg
        mode, policy, self.layerwise, self.reads = SYSTEMS[cfg.system]
        nodes = [f"p{i}" for i in range(cfg.prefill_nodes)] + [f"d{i}" for i in range(cfg.decode_nodes)]
        caps = cluster_links(cfg.hardware, nodes)
        if math.isfinite(cfg.storage_bps):  # else reads do not cross it
            caps["storage"] = cfg.storage_bps
        caps.update({f"{n}/storage_read": cfg.hardware.read_bps for n in nodes})  # what a node's client reads
        self.loop = EventLoop(FlowNetwork(caps))
        self.block_keys = BlockKeys().keys  # block_keys, faster
        gaps = any(len(r) > 2 and r[2] > 0 for rs in rounds_per_agent for r in rs)
        self.sessions = Sessions(self, self.block_keys) if cfg.prefetch or cfg.affinity or gaps else None
        self.core = SchedulerCore(
            SchedulerConfig(
                kv_store="/nonexistent",
                mode=mode,
                policy=policy,
                heartbeat_timeout_s=1e12,
                max_queued_requests=10**9,
                scheduling_policy=cfg.scheduling_policy,
                session_prefetch=cfg.prefetch,
                session_affinity=cfg.affinity,
            ),
            make_policy(policy),
            clock=lambda net=self.loop.net: net.now,
        )
        # one engine's timings and KV per role: a TP engine is one engine of its ranks' capacity
        self.models = {role: cfg.engine.with_tp(cfg.tp(role)) for role in (Role.PREFILL, Role.DECODE)}
        self.pe_model, self.de_model = self.models[Role.PREFILL], self.models[Role.DECODE]
        self.engines: dict[str, SimEngine] = {}
        self.groups: dict[str, list[SimEngine]] = {}  # node -> its engines (a group pulls for all of them)
        for node in nodes:
            for i in range(cfg.engines_per_node(self._role(node))):
                self._register(node, i)
        self.agents = [
            Agent(i, r, start=starts[i] if starts else 0.0, priority=priorities[i] if priorities else 0)
            for i, r in enumerate(rounds_per_agent)
        ]
        for a, k in zip(self.agents, first_rounds or ()):
            if 0 < k < len(a.rounds):
                a.next_round, a.context = k, sum(r[0] + r[1] for r in a.rounds[:k])
                self.core.index.add_packed(self.block_keys(a.index, 0, a.context // cfg.block_size))
                if self.sessions is not None:
                    self.sessions.joined(a)
        self.unfinished = sum(1 for a in self.agents if a.rounds)  # pulls go on while any agent has rounds left
        self.by_id: dict[str, SimRequest] = {}  # submitted, not yet assigned: by request id (a run keeps no history)
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.ttft_at: list[float] = []
        self.ttft_agent: list[int] = []
        self.tpot_at: list[float] = []
        self.prefill_busy_s = 0.0  # GPU seconds of prefill compute, all prefill GPUs (an engine's: x its ranks)
        self.pe_kv_budget = cfg.pe_kv_budget_bytes()
        self.hbm_waits: list[float] = []  # seconds each assignment that found no HBM room waited for it
        self.read_bytes: dict[str, float] = {}
        self.reading: dict[str, set[str]] = {}  # node -> its storage reads in flight (flow ids)
        self.read_queue: dict[str, deque] = {}  # node -> reads waiting for a slot: (flow, bytes, route, loaded)
        self.queued_bytes: dict[str, float] = {}
        self.reported_q: dict[str, int] = {}  # group -> the read queue its last report gave
        self._sampling: dict[tuple[int, int], dict] = {}  # (generation length, priority) -> sampling parameters
        self._routes: dict[tuple, tuple] = {}  # (path, prefill GPU, decode GPU) -> the links a read crosses
        self.turns = 0
        self._joined = 0  # requests that joined a decode batch (their join order)
        self._ready_order = itertools.count()  # the order prefill work became ready (ties within a priority)
        self.rng = random.Random(cfg.seed)

    # --- set-up -----------------------------------------------------------------------------------------------
    @staticmethod
    def _role(node: str) -> Role:
        return Role.PREFILL if node.startswith("p") else Role.DECODE

    def _register(self, node: str, i: int) -> None:
        """The node's engine ``i``, on GPUs ``i x tp`` .. ``i x tp + tp - 1``; id ``node-i``."""
        cfg, role = self.cfg, self._role(node)
        e, tp = self.models[role], cfg.tp(role)
        read_tokens = cfg.hardware.read_bps / cfg.model.kv_bytes_per_token
        beta = e.prefill.tokens_in(5.0)  # as the real prefill engines report it
        info = EngineInfo(
            f"{node}-{i}",
            role,
            node,
            "sim",
            "sim",
            {},
            [],
            0,
            0,
            cfg.block_size,
            e.num_layers,
            "00" * 16,
            e.decode_kv_tokens if role is Role.DECODE else 10**9,
            max_model_len=10**8,
            group_id=node,
            alpha_tokens=int(3.0 * read_tokens),
            beta_tokens=beta if role is Role.PREFILL else 0,
        )
        self.core.register(info)
        self.engines[info.engine_id] = SimEngine(info, (node, i * tp), tp)
        self.groups.setdefault(node, []).append(self.engines[info.engine_id])

    # --- agents -----------------------------------------------------------------------------------------------
    def _submit(self, agent: Agent) -> None:
        append, gen = agent.rounds[agent.next_round][:2]
        prompt = agent.context + append
        bs = self.cfg.block_size
        keys = self.block_keys(agent.index, 0, prompt // bs)
        rid = f"a{agent.index}.r{agent.next_round}"
        if self.sessions is not None:
            self.sessions.submitted(agent, rid, self.loop.now)
        priority = agent.next_round - len(agent.rounds) if self.cfg.longest_first else agent.priority
        req = SimRequest(agent, prompt, gen, self.loop.now, priority=priority)
        self.by_id[rid] = req
        sampling = self._sampling.get((gen, priority))
        if sampling is None:  # one per (generation length, priority): building and checking them cost ~10 us a turn
            sampling = self._sampling[gen, priority] = SamplingParams(
                max_tokens=gen, ignore_eos=True, priority=priority
            ).to_dict()
        session = SessionHint(f"a{agent.index}") if self.sessions is not None and self.sessions.tracked else None
        self.core.submit(
            SubmitRequest(rid, bytes(4 * prompt), sampling, block_hashes=keys, session=session),
            lambda ev, r=req: self._on_event(ev, r),
            trust_hashes=True,
        )

    def _on_event(self, ev: SubmitEvent, req: SimRequest) -> None:
        if ev.kind == "finished":
            agent = req.agent
            agent.context = req.prompt + req.gen
            done = agent.rounds[agent.next_round]
            agent.next_round += 1
            self.turns += 1
            gap = done[2] if len(done) > 2 else 0.0
            if self.sessions is not None:
                self.sessions.ended(agent, ev.request_id, self.loop.now)
            if agent.next_round < len(agent.rounds):
                if gap > 0:  # the agent's tool runs
                    self.loop.after(gap, lambda: self._submit(agent))
                else:
                    self._submit(agent)
            else:
                agent.finished_at = self.loop.now
                self.unfinished -= 1
        elif ev.kind == "assigned":
            req.on_prefetch = ev.prefetched
        elif ev.kind == "failed":
            raise RuntimeError(f"simulated request {ev.request_id} failed: {ev.error}")

    # --- pulls ------------------------------------------------------------------------------------------------
    def _pull(self, group: str) -> None:
        """A group's pull. Left out, with the same decisions (a test compares): the reports of engines unchanged
        since their last one (the scheduler keeps the last), and the whole pull when no report is left and the
        scheduler has nothing queued the group could take."""
        members, every = self.groups[group], self.cfg.every_pull
        read_q = self._read_q_tokens(group)  # a group is a node: one engine reports the node's queue
        new_q = every or read_q != self.reported_q.get(group)
        loads = [
            self._load(e, read_q if i == 0 else 0)
            for i, e in enumerate(members)
            if every or (e.dirty and self._changed(e)) or (i == 0 and new_q)
        ]
        if loads and loads[0].engine_id == members[0].info.engine_id:
            self.reported_q[group] = read_q
        sessions = self.sessions
        if every or loads or not self.core.idle_for(group) or (sessions is not None and sessions.needs_pull(members)):
            reply = self.core.pull(group, loads, members[0].info.engine_id)
            if reply.prefetch:
                sessions.order(reply.prefetch)
            for eid, work in reply.assignments.items():
                for a in work:
                    self._start_prefill(self.engines[eid], a)
        if self.unfinished:
            wait = self.cfg.pull_interval_s * (1 + self.cfg.pull_jitter * (2 * self.rng.random() - 1))
            self.loop.after(wait, lambda: self._pull(group))

    def _read_q_tokens(self, node: str) -> int:
        """The node's storage read queue (waiting and in flight). The scheduler sums its engines' reports per
        node, so one engine of the group reports it and the others 0."""
        reading = self.reading.get(node)
        left = self.queued_bytes.get(node, 0.0) + (self.loop.net.remaining_total(reading) if reading else 0)
        return int(left / self.cfg.model.kv_bytes_per_token)

    @staticmethod
    def _changed(e: SimEngine) -> bool:
        """Whether the engine's report would differ from its last one (an unchanged one may be left out of a
        pull: the scheduler keeps the last report, so its decisions are the same)."""
        return bool(e.finished or e.stored or e.read_bytes) or e.reported != (len(e.held), e.held_tokens, e.reserved)

    def _load(self, e: SimEngine, read_q_tokens: int) -> EngineLoad:
        e.dirty = False
        finished, e.finished = e.finished, []
        stored, e.stored = b"".join(e.stored), []
        read, e.read_bytes = e.read_bytes, 0.0
        e.reported = (len(e.held), e.held_tokens, e.reserved)
        return EngineLoad(
            e.info.engine_id,
            len(e.held),
            e.held_tokens,
            read_q_tokens,
            e.info.capacity_tokens - e.reserved,
            request_ids=list(e.held),
            finished=finished,
            stored_keys=stored,
            storage_read_bytes=int(read),
        )

    # --- prefill ----------------------------------------------------------------------------------------------
    def _start_prefill(self, pe: SimEngine, a) -> None:
        rid = request_of(a.request_id)
        req = self.by_id.pop(rid)
        req.de = a.decode.engine_id
        req.hit_tokens = a.num_hit_blocks * self.cfg.block_size
        de = self.engines[req.de]
        pe.admit(a.request_id, req)
        de.admit(a.request_id, req)
        req.resident_bytes = self._resident_bytes(req)
        if req.resident_bytes > self.pe_kv_budget:
            raise ValueError(
                f"{a.request_id}: a {req.prompt}-token prompt keeps {req.resident_bytes / 1e9:.2f} GB of KV resident, "
                f"over a prefill engine's HBM budget of {self.pe_kv_budget / 1e9:.2f} GB"
            )
        if pe.hbm_wait or pe.resident + req.resident_bytes > self.pe_kv_budget:
            pe.hbm_wait.append((a, req, self.loop.now))  # FIFO: a later, smaller one does not pass it
            return
        self._read_hit(pe, de, a, req)

    def _resident_bytes(self, req: SimRequest) -> float:
        """The KV a request keeps in its prefill GPU's HBM: every layer of its prompt (basic), or two layers."""
        kv = req.prompt * self.cfg.model.kv_bytes_per_token
        return kv if not self.layerwise else kv * LAYERWISE_RESIDENT_LAYERS / self.pe_model.num_layers

    def _read_hit(self, pe: SimEngine, de: SimEngine, a, req: SimRequest) -> None:
        """Its KV has room in the prefill engine's HBM: read its hit (or, nothing to read, queue its compute)."""
        pe.resident += req.resident_bytes
        pe.resident_peak = max(pe.resident_peak, pe.resident)
        block_bytes = self.cfg.block_size * self.cfg.model.kv_bytes_per_token
        hit_bytes = a.num_hit_blocks * block_bytes
        reader = pe if a.path.value == "pe" else de
        prefetched = 0
        if self.sessions is not None:
            prefetched = self.sessions.placed(req, pe, de, reader is pe)
        if not self.reads or hit_bytes == 0:
            self._compute(pe, a.request_id, req, self.loop.now, self.loop.now)
            return
        node = reader.info.node_id
        route = self._route(reader is pe, pe, de)
        stored = hit_bytes - prefetched * block_bytes  # what is read from storage
        parts = [self.loop.now, self.loop.now, (stored > 0) + (prefetched > 0)]  # read start, end, parts to go
        overlap = reader is pe or self.cfg.de_read_overlap

        def part_done(start: float | None = None):
            if start is not None:
                parts[0] = start
            parts[1], parts[2] = self.loop.now, parts[2] - 1
            if not parts[2]:
                self._compute(pe, a.request_id, req, parts[0] if overlap else parts[1], parts[1])

        if prefetched:  # from the reader's DRAM buffer: the path's links after the buffer
            self.loop.transfer(
                f"buffer:{a.request_id}", prefetched * block_bytes, self._buffer_route(route, node), part_done
            )
        if stored <= 0:
            return

        def loaded(start: float):
            reader.read_bytes += stored
            reader.dirty = True
            self.read_bytes[node] = self.read_bytes.get(node, 0.0) + stored
            part_done(start)

        self.read_queue.setdefault(node, deque()).append((f"read:{a.request_id}", stored, route, loaded))
        self.queued_bytes[node] = self.queued_bytes.get(node, 0.0) + stored
        self._issue_reads(node)

    def _route(self, on_pe: bool, pe: SimEngine, de: SimEngine) -> tuple:
        """The links a read crosses: its path's, and the reading node's storage client (and storage system)."""
        key = (on_pe, pe.gpu, de.gpu)  # a role's engines all have the same ranks
        if key not in self._routes:
            node = (pe.gpu if on_pe else de.gpu)[0]
            self._routes[key] = (
                path_route(PE_PATH if on_pe else DE_PATH, pe.gpu, de.gpu, pe.ranks, de.ranks)
                + ((f"{node}/storage_read", 1.0),)
                + ((("storage", 1.0),) if math.isfinite(self.cfg.storage_bps) else ())
            )
        return self._routes[key]

    def _buffer_route(self, route: tuple, node: str) -> tuple:
        """A read path's links after the reading node's DRAM buffer: no storage, no storage NIC, one DRAM crossing
        less (the storage NIC's write into the buffer)."""
        out = []
        for link, f in route:
            if link in (f"{node}/snic", f"{node}/storage_read", "storage"):
                continue
            if link == f"{node}/dram":
                f -= 1
            if f > 0:
                out.append((link, f))
        return tuple(out)

    def _issue_reads(self, node: str) -> None:
        """A node's storage client reads its queue FIFO, ``reads_per_node`` requests at a time."""
        queue, reading = self.read_queue.get(node), self.reading.setdefault(node, set())
        while queue and len(reading) < self.cfg.reads_per_node:
            flow, size, route, loaded = queue.popleft()
            self.queued_bytes[node] -= size
            reading.add(flow)

            def done(flow=flow, loaded=loaded, start=self.loop.now):
                reading.discard(flow)
                self._issue_reads(node)
                if self.sessions is not None and not reading:  # the node's storage client is idle: prefetch
                    self.sessions.pump(node)
                loaded(start)

            self.loop.transfer(flow, size, route, done)

    def _compute(self, pe: SimEngine, work: str, req: SimRequest, read_start: float, read_end: float) -> None:
        """Queue the request's prefill on its engine, which runs one at a time: the most urgent ready one next, in the
        order they became ready within a priority (the real engine's batch order: ``PrefillEngine._batchable``)."""
        heapq.heappush(pe.ready, (req.priority, next(self._ready_order), work, req, read_start, read_end))
        if not pe.computing:
            self._next_prefill(pe)

    def _next_prefill(self, pe: SimEngine) -> None:
        """Start the engine's next prefill; when it may start depends on the prefill kind."""
        _, _, work, req, read_start, read_end = heapq.heappop(pe.ready)
        t = self.pe_model.prefill.predict([(req.hit_tokens, req.prompt - req.hit_tokens)])
        if self.layerwise:  # layers compute as they arrive: done one layer after the read at the earliest
            begin = max(pe.busy_until, read_start)
            end = max(begin + t, read_end + t / self.pe_model.num_layers)
        else:
            begin = max(pe.busy_until, read_end)
            end = begin + t
        pe.busy_until = max(end, self.loop.now)
        pe.computing, pe.compute_s = True, t
        self.prefill_busy_s += t * pe.ranks
        self.loop.at(pe.busy_until, lambda: self._prefilled(pe, work))

    def prefill_busy_by(self, t: float) -> float:
        """GPU seconds of prefill compute done by ``t`` (a run stopped there): ``prefill_busy_s`` counts a prefill
        whole when it starts, so one still running at ``t`` counts only what of it can lie before ``t``."""
        past = sum(
            min(pe.compute_s, pe.busy_until - t) * pe.ranks
            for pe in self.engines.values()
            if pe.computing and pe.busy_until > t
        )
        return self.prefill_busy_s - past

    def _prefilled(self, pe: SimEngine, work: str) -> None:
        pe.computing = False
        pe.resident -= pe.held[work].resident_bytes
        self._hand_off(pe, work)
        while pe.hbm_wait and pe.resident + pe.hbm_wait[0][1].resident_bytes <= self.pe_kv_budget:
            a, req, since = pe.hbm_wait.popleft()
            self.hbm_waits.append(self.loop.now - since)
            self._read_hit(pe, self.engines[req.de], a, req)
        if pe.ready:
            self._next_prefill(pe)

    def _hand_off(self, pe: SimEngine, work: str) -> None:
        req = pe.release(work)
        req.prefill_done = self.loop.now
        self.ttft.append(self.loop.now - req.submitted)
        if self.sessions is not None:
            self.sessions.prefilled(req, self.loop.now - req.submitted)
        self.ttft_at.append(self.loop.now)
        self.ttft_agent.append(req.agent.index)
        de = self.engines[req.de]
        req.generated = 1
        de.held_tokens += 1
        de.dirty = True
        de.joining.append((work, req))
        if not de.running and len(de.joining) == 1:  # idle: a segment starts now
            self._segment_end(de, de.seg_version)
        else:
            self._cut_segment(de)

    # --- decode -----------------------------------------------------------------------------------------------
    def _steps_end(self, de: SimEngine, n: int) -> float:
        """When the current segment's first ``n`` steps are done: step j takes s0 + c·j (the context grows by the
        batch each step), so n steps take n·s0 + c·n(n-1)/2."""
        e, batch = self.de_model, len(de.running)
        s0, c = e.decode_step(batch, de.seg_context), e.decode_per_token_s * batch
        return de.seg_start + n * s0 + c * n * (n - 1) / 2

    def _cut_segment(self, de: SimEngine) -> None:
        """A request waits to join: end the segment at the boundary of the step in progress (the first n in
        [1, seg_steps] with steps_end(n) > now; a waiting joiner has made that cut already)."""
        if len(de.joining) > 1 or de.seg_steps <= 1:
            return
        e, batch, x = self.de_model, len(de.running), self.loop.now + 1e-12 - de.seg_start
        s0, c = e.decode_step(batch, de.seg_context), e.decode_per_token_s * batch
        # n·s0 + c·n(n-1)/2 = x solved for n, then stepped to the exact boundary (steps_end is increasing in n)
        if c > 0:
            root = ((s0 - c / 2) ** 2 + 2 * c * x) ** 0.5 / c - (s0 - c / 2) / c
        else:
            root = x / s0 if s0 > 0 else de.seg_steps  # steps that take no time: the segment ends now anyway
        n = min(max(1, math.ceil(root)), de.seg_steps)
        while n > 1 and self._steps_end(de, n - 1) > self.loop.now + 1e-12:
            n -= 1
        while n < de.seg_steps and self._steps_end(de, n) <= self.loop.now + 1e-12:
            n += 1
        if n < de.seg_steps:  # else the segment ends at that boundary anyway
            de.seg_steps, de.seg_version = n, de.seg_version + 1
            self.loop.at(self._steps_end(de, n), lambda v=de.seg_version: self._segment_end(de, v))

    def _segment_end(self, de: SimEngine, version: int) -> None:
        """At a step boundary: settle the segment's tokens, finish what is done, admit joiners, plan the next."""
        if version != de.seg_version:
            return
        if de.running:
            de.dirty = True
            de.steps += de.seg_steps
            de.held_tokens += de.seg_steps * len(de.running)
            self._finish_due(de)
        for work, req in de.joining:
            self._joined += 1
            de.running[work] = req
            req.base = req.generated - de.steps
            de.run_base += req.prompt + req.base
            heapq.heappush(de.finish, (req.gen - req.base, self._joined, work))
        de.joining.clear()
        de.seg_version += 1
        if not de.running:
            de.seg_steps = 0
            return
        de.seg_start, de.seg_context = self.loop.now, de.run_base + len(de.running) * de.steps
        de.seg_steps = max(1, de.finish[0][0] - de.steps)
        self.loop.at(self._steps_end(de, de.seg_steps), lambda v=de.seg_version: self._segment_end(de, v))

    def _finish_due(self, de: SimEngine) -> None:
        """Release the running requests whose last token the settled steps produced, in join order."""
        bs, due = self.cfg.block_size, []
        while de.finish and de.finish[0][0] <= de.steps:
            due.append(heapq.heappop(de.finish))
        for _, _, work in sorted(due, key=lambda d: d[1]) if len(due) > 1 else due:
            req = de.running.pop(work)
            req.generated = req.base + de.steps
            de.run_base -= req.prompt + req.base
            de.release(work)
            de.finished.append(work)
            req.done = self.loop.now
            self.tpot.append((self.loop.now - req.prefill_done) / max(req.gen - 1, 1))
            self.tpot_at.append(self.loop.now)
            # what storage lacks: blocks after the hit part, up to the last full one
            de.stored.append(self.block_keys(req.agent.index, req.hit_tokens // bs, (req.prompt + req.gen) // bs))

    # --- run --------------------------------------------------------------------------------------------------
    def run(
        self, until: float = math.inf, progress: Callable[[float, int], None] | None = None, every_s: float = 50.0
    ) -> SimResult:
        """Simulate to the end (or to ``until``); ``progress(simulated time, turns done)`` is called every ``every_s``
        simulated seconds."""
        for agent in self.agents:
            if agent.rounds:
                self.loop.at(agent.start, lambda a=agent: self._submit(a))
        groups = sorted(self.groups)
        for i, group in enumerate(groups):  # real groups' pull timers are not aligned: spread their phases
            self.loop.at(self.cfg.pull_interval_s * i / len(groups), lambda g=group: self._pull(g))
        if self.sessions is not None:
            self.loop.at(0.0, self.sessions.sample)
        thresholds = gc.get_threshold()
        # A large cluster keeps ~10^6 objects in flight (requests, timers' closures); the default thresholds run a
        # full collection over them every few thousand turns: 15-25% of the run at 48P96D. The sim makes little
        # cyclic garbage, so collecting rarely costs only a little memory.
        gc.set_threshold(50_000, 20, 20)
        try:
            t = 0.0
            while progress is not None and t + every_s < until and not self.loop.idle:
                t += every_s
                self.loop.run(t)
                progress(self.loop.now, self.turns)
            self.loop.run(until)
        finally:
            gc.set_threshold(*thresholds)
        jct = max((a.finished_at for a in self.agents), default=0.0)
        return SimResult(
            jct,
            self.turns,
            dict(self.read_bytes),
            self.ttft,
            dict(self.loop.net.carried),
            self.tpot,
            self.ttft_at,
            self.tpot_at,
            self.ttft_agent,
            self.sessions.summary() if self.sessions is not None else {},
        )


@dataclass(frozen=True)
class Slo:
    """The paper's online service objective. It states thresholds, not the statistic: means are used here."""

    ttft_s: float = 4.0
    tpot_s: float = 0.05

    def holds(self, r: SimResult, since: float = 0.0) -> bool:
        """Whether the means over requests whose first token (TTFT) or last token (TPOT) came at ``since`` or
        later meet the objective."""
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        ttft = [x for x, t in zip(r.ttft_s, r.ttft_at) if t >= since]
        tpot = [x for x, t in zip(r.tpot_s, r.tpot_at) if t >= since]
        return mean(ttft) <= self.ttft_s and mean(tpot) <= self.tpot_s


def online_capacity(
    cfg: SimConfig,
    pool: list[list[tuple[int, int]]],
    duration_s: float,
    slo: Slo = Slo(),
    iters: int = 8,
    seed: int = 0,
    start: float = 1.0,
    warmup_s: float = 0.0,
) -> dict:
    """The highest agent arrival rate (agents/s, Poisson over ``duration_s``) at which ``slo`` holds over the
    requests served from ``warmup_s`` to ``duration_s`` (the run stops there: requests still waiting are what an
    overloaded rate leaves behind, and a finite window admits a little more than the sustainable rate): doubling
    from ``start`` to find a rate that fails, then bisection. Agent i replays ``pool[i % len(pool)]``."""
    tried: dict[float, bool] = {}

    def ok(aps: float) -> bool:
        gaps = np.random.default_rng(seed).exponential(1.0 / aps, size=int(aps * duration_s * 2) + 1)
        starts = [float(t) for t in np.cumsum(gaps) if t < duration_s]
        r = ClusterSim(cfg, [pool[i % len(pool)] for i in range(len(starts))], starts).run(until=duration_s)
        tried[aps] = slo.holds(r, since=warmup_s)
        return tried[aps]

    lo, hi = 0.0, start
    while ok(hi):
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise ValueError("the SLO holds at any arrival rate: the workload is too small")
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return {"agents_per_s": lo, "tried": sorted(tried.items())}


def summarize(sim: ClusterSim, r: SimResult) -> dict:
    """One run's summary row: JCT, throughput, TTFT/TPOT, storage reads per node and their balance, busiest link."""
    from dualpath.scheduler.balance import max_over_avg

    caps = sim.loop.net.capacity
    util = {k: v / (caps[k] * r.jct_s) for k, v in r.link_bytes.items() if r.jct_s > 0 and k != "storage"}
    busiest = max(util, key=util.get) if util else ""
    ends = sorted(a.finished_at for a in sim.agents if a.rounds and a.finished_at > 0)
    half = ends[len(ends) // 2] if ends else 0.0  # till half the agents are done the cluster is still full
    cfg = sim.cfg
    return {
        "system": cfg.system,
        "prefill_nodes": cfg.prefill_nodes,
        "decode_nodes": cfg.decode_nodes,
        "prefill_tp": cfg.prefill_tp,
        "decode_tp": cfg.decode_tp,
        "prefill_engines": cfg.prefill_nodes * cfg.engines_per_node(Role.PREFILL),
        "decode_engines": cfg.decode_nodes * cfg.engines_per_node(Role.DECODE),
        "agents": len(sim.agents),
        "jct_s": r.jct_s,
        "turns": r.turns,
        "turns_per_s": r.turns / r.jct_s if r.jct_s else 0.0,
        "busy_turns_per_s": sum(1 for t in r.tpot_at if t <= half) / half if half else 0.0,
        "ttft_p50_s": float(np.median(r.ttft_s)) if r.ttft_s else 0.0,
        "ttft_mean_s": float(np.mean(r.ttft_s)) if r.ttft_s else 0.0,
        "tpot_mean_s": float(np.mean(r.tpot_s)) if r.tpot_s else 0.0,
        "storage_read_bytes": {n: r.storage_read_bytes.get(n, 0.0) for n in sim.groups},
        "storage_read_max_over_avg": max_over_avg([r.storage_read_bytes.get(n, 0.0) for n in sim.groups])
        if sim.reads
        else 0.0,
        "busiest_link": busiest,
        "busiest_utilization": util.get(busiest, 0.0),
        **_hbm_summary(sim),
    }


def _hbm_summary(sim: ClusterSim) -> dict:
    """The prefill engines' HBM bound: its size, the most resident KV an engine held, and how many turns waited for
    room (and how long, on average)."""
    peak = max((e.resident_peak for e in sim.engines.values() if e.info.role is Role.PREFILL), default=0.0)
    waits = sim.hbm_waits
    return {
        "prefill_kv_budget_bytes": sim.pe_kv_budget if math.isfinite(sim.pe_kv_budget) else None,
        "prefill_resident_peak_bytes": peak,
        "hbm_waited_turns": len(waits),
        "hbm_wait_mean_s": sum(waits) / len(waits) if waits else 0.0,
    }


def engine_for(args) -> EngineModel:
    """The model preset's calibrated engine timings (one GPU's), with any of them overridden by the options."""
    from dataclasses import replace

    from dualpath.sim.hardware import MODELS

    e = MODELS[args.model].engine
    if args.prefill_tps:
        e = replace(e, prefill=CostModel(0.0, 1.0 / args.prefill_tps, 0.0))
    if args.decode_step_ms:
        e = replace(e, decode_fixed_s=args.decode_step_ms / 1e3, decode_per_seq_s=0.0, decode_per_token_s=0.0)
    if args.decode_kv_tokens:
        e = replace(e, decode_kv_tokens=args.decode_kv_tokens)
    if getattr(args, "tp_comm", None) is not None:
        e = replace(e, tp_comm=args.tp_comm)
    return replace(e, num_layers=args.layers) if args.layers else e


def progress_printer(label: str, wall_every_s: float = 10.0, out=None) -> Callable[[float, int], None]:
    """A ``ClusterSim.run(progress=...)`` callback: one line (to stderr) at most every ``wall_every_s`` seconds of
    wall time, so a long run shows where it is and a short one stays quiet."""
    start = last = time.perf_counter()

    def report(t: float, turns: int) -> None:
        nonlocal last
        now = time.perf_counter()
        if now - last >= wall_every_s:
            last = now
            print(
                f"  ... {label}: {t:,.0f} simulated s, {turns:,} turns, {now - start:,.0f} s",
                file=out or sys.stderr,
                flush=True,
            )

    return report


def storage_bps(gbps: float | None) -> float:
    """The storage system's aggregate read rate from an option: None or 0, unlimited (each node's storage client
    still reads at most its own rate)."""
    return gbps * 1e9 / 8 if gbps else math.inf


def simulate_systems(args, hw: Hardware) -> list[dict]:
    """``dualpath simulate``: the trace the options describe, run once per system; one summary row each."""
    from dualpath.rollout.tracegen import trace_shapes
    from dualpath.sim.hardware import MODELS

    rounds, _ = trace_shapes(args.preset, args.agents, args.scale, args.turns_scale, args.seed)
    storage = storage_bps(args.storage_gbps)
    rows = []
    for system in args.systems.split(","):
        cfg = SimConfig(
            hw,
            MODELS[args.model],
            engine_for(args),
            args.prefill,
            args.decode,
            system,
            storage,
            pull_interval_s=args.pull_interval,
            prefill_tp=args.prefill_tp,
            decode_tp=args.decode_tp,
        )
        sim = ClusterSim(cfg, rounds)
        rows.append(summarize(sim, sim.run(progress=progress_printer(system))))
        if args.online_seconds > 0:
            found = online_capacity(cfg, rounds, args.online_seconds, warmup_s=args.online_seconds / 2)
            rows[-1]["online_agents_per_s"] = found["agents_per_s"]
    return rows
