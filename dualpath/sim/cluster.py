"""A simulated P/D cluster driven by the project's own scheduler: ``SchedulerCore`` and its policies, unmodified,
place every request; engines, storage and links are models on one event clock.

What is modelled (and what is not):
* Engines: one per GPU, grouped by node; each group pulls from the scheduler every ``pull_interval_s`` (group i
  of n first at i/n of the interval: pulls are not aligned in a real cluster either) with load reports built like
  the real engines' (seq, tok, the node's storage read queue in tokens, free KV tokens, held requests, finished
  ones and the blocks they stored).
* A prefill GPU runs its requests one at a time (no batching across requests) for ``CostModel.predict`` seconds,
  the form the real engines fit at start-up. Layerwise prefill starts computing when the request's read starts and
  ends no earlier than one layer's compute after the read ends; whole-KV (``basic``) prefill starts after the read.
* A request's hit KV is one flow over every link its read path crosses (``links.PE_PATH`` / ``DE_PATH``, storage
  included), sharing links max-min fairly with all other flows: the fluid view of a layer-pipelined transfer.
  Miss-token KV (1-2% of a turn) is not moved, as in the paper's §4.2.
* A decode GPU steps its running requests together: a step takes ``fixed + per_seq × batch + per_token × Σ
  context`` seconds and gives every running request one token; a request holds prompt + generation KV tokens.
* ``oracle`` reads no storage: hit KV is already in place (the paper's Oracle, an upper bound).
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

from dualpath.config import SchedulerConfig
from dualpath.messages import EngineInfo, EngineLoad, Role, SubmitEvent, SubmitRequest
from dualpath.sampling_params import SamplingParams
from dualpath.sim.events import EventLoop
from dualpath.sim.hardware import Hardware, ModelPreset
from dualpath.sim.links import DE_PATH, PE_PATH, cluster_links, path_route
from dualpath.sim.network import FlowNetwork
from engines.batcher import CostModel
from scheduler.core import SchedulerCore
from scheduler.policy import make_policy

SYSTEMS = {  # name -> (scheduler mode, policy, layerwise, reads storage)
    "basic": ("basic", "dualpath", False, True),
    "layerwise": ("pe", "dualpath", True, True),
    "dualpath-rr": ("dualpath", "round-robin", True, True),
    "dualpath": ("dualpath", "dualpath", True, True),
    "oracle": ("dualpath", "dualpath", True, False),
}
_MIX = 0x9E3779B97F4A7C15  # odd: multiplying by it is a bijection of 64-bit integers


@dataclass(frozen=True)
class EngineModel:
    """A GPU's timing: prefill by the engines' cost model, decode steps, and KV token capacities."""

    prefill: CostModel
    decode_fixed_s: float
    decode_per_seq_s: float
    decode_per_token_s: float  # per cached token attended, per step
    decode_kv_tokens: int  # KV tokens a decode GPU holds
    num_layers: int

    def decode_step(self, batch: int, context_tokens: int) -> float:
        return self.decode_fixed_s + self.decode_per_seq_s * batch + self.decode_per_token_s * context_tokens


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
    pull_interval_s: float = 0.05

    def __post_init__(self):
        if self.system not in SYSTEMS:
            raise ValueError(f"system must be one of {sorted(SYSTEMS)}, got {self.system!r}")


@dataclass
class Agent:
    """One trajectory: rounds of (appended tokens, generated tokens), issued back to back."""

    index: int
    rounds: list[tuple[int, int]]
    context: int = 0  # tokens before the next round's append
    next_round: int = 0
    finished_at: float = 0.0
    start: float = 0.0  # when its first round is submitted (online runs: the arrival time)


@dataclass
class SimRequest:
    agent: Agent
    prompt: int
    gen: int
    submitted: float
    hit_tokens: int = 0
    de: str = ""
    prefill_done: float = 0.0
    generated: int = 0


@dataclass
class SimEngine:
    info: EngineInfo
    gpu: tuple[str, int]  # (node, index) for link routes
    running: dict[str, SimRequest] = field(default_factory=dict)  # decode: generating
    held: dict[str, SimRequest] = field(default_factory=dict)  # admitted, not finished
    busy_until: float = 0.0
    stepping: bool = False
    finished: list[str] = field(default_factory=list)
    stored: list[bytes] = field(default_factory=list)
    read_bytes: float = 0.0  # storage bytes completed since the last report


def block_key(agent: int, block: int) -> bytes:
    """A stored block's hash: unique per (agent, position), so an agent's turns share their prefix blocks."""
    mixed = (((agent + 1) << 32 | block) * _MIX) & (2 ** 64 - 1)
    return struct.pack("<QQ", mixed, agent)


@dataclass
class SimResult:
    jct_s: float
    turns: int
    storage_read_bytes: dict[str, float]
    ttft_s: list[float]
    link_bytes: dict[str, float]
    tpot_s: list[float] = field(default_factory=list)  # per request: decode time per token after the first


class ClusterSim:
    def __init__(self, cfg: SimConfig, rounds_per_agent: list[list[tuple[int, int]]],
                 starts: list[float] | None = None):
        self.cfg = cfg
        mode, policy, self.layerwise, self.reads = SYSTEMS[cfg.system]
        nodes = [f"p{i}" for i in range(cfg.prefill_nodes)] + [f"d{i}" for i in range(cfg.decode_nodes)]
        caps = cluster_links(cfg.hardware, nodes)
        caps["storage"] = cfg.storage_bps if math.isfinite(cfg.storage_bps) else 1e30
        self.loop = EventLoop(FlowNetwork(caps))
        self.core = SchedulerCore(SchedulerConfig(kv_store="/nonexistent", mode=mode, policy=policy,
                                                  heartbeat_timeout_s=1e12, max_queued_requests=10 ** 9),
                                  make_policy(policy), clock=lambda: self.loop.now)
        self.engines: dict[str, SimEngine] = {}
        self.groups: dict[str, list[SimEngine]] = {}  # node -> its engines (a group pulls for all of them)
        for node in nodes:
            for g in range(cfg.hardware.gpus):
                self._register(node, g)
        self.agents = [Agent(i, r, start=starts[i] if starts else 0.0) for i, r in enumerate(rounds_per_agent)]
        self.unfinished = sum(1 for a in self.agents if a.rounds)  # pulls go on while any agent has rounds left
        self.requests: dict[str, SimRequest] = {}  # by work id
        self.by_id: dict[str, SimRequest] = {}  # by request id
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.read_bytes: dict[str, float] = {}
        self.reading: dict[str, set[str]] = {}  # node -> its storage reads in flight (flow ids)
        self.turns = 0

    # --- set-up -----------------------------------------------------------------------------------------------
    def _register(self, node: str, g: int) -> None:
        cfg, e = self.cfg, self.cfg.engine
        role = Role.PREFILL if node.startswith("p") else Role.DECODE
        snic_tokens = cfg.hardware.snic_bps / cfg.model.kv_bytes_per_token
        beta = int(5.0 / max(e.prefill.per_token, 1e-12))  # tokens prefilled in 5 s
        info = EngineInfo(f"{node}-{g}", role, node, "sim", "sim", {}, [], 0, 0, cfg.block_size, e.num_layers,
                          "00" * 16, e.decode_kv_tokens if role is Role.DECODE else 10 ** 9,
                          max_model_len=10 ** 8, group_id=node, alpha_tokens=int(3.0 * snic_tokens),
                          beta_tokens=beta if role is Role.PREFILL else 0)
        self.core.register(info)
        self.engines[info.engine_id] = SimEngine(info, (node, g))
        self.groups.setdefault(node, []).append(self.engines[info.engine_id])

    # --- agents -----------------------------------------------------------------------------------------------
    def _submit(self, agent: Agent) -> None:
        append, gen = agent.rounds[agent.next_round]
        prompt = agent.context + append
        bs = self.cfg.block_size
        keys = b"".join(block_key(agent.index, b) for b in range(prompt // bs))
        rid = f"a{agent.index}.r{agent.next_round}"
        req = SimRequest(agent, prompt, gen, self.loop.now)
        self.by_id[rid] = req
        sampling = SamplingParams(max_tokens=gen, ignore_eos=True).to_dict()
        self.core.submit(SubmitRequest(rid, bytes(4 * prompt), sampling, block_hashes=keys),
                         lambda ev, r=req: self._on_event(ev, r))

    def _on_event(self, ev: SubmitEvent, req: SimRequest) -> None:
        if ev.kind == "finished":
            agent = req.agent
            agent.context = req.prompt + req.gen
            agent.next_round += 1
            self.turns += 1
            if agent.next_round < len(agent.rounds):
                self._submit(agent)
            else:
                agent.finished_at = self.loop.now
                self.unfinished -= 1
        elif ev.kind == "failed":
            raise RuntimeError(f"simulated request {ev.request_id} failed: {ev.error}")

    # --- pulls ------------------------------------------------------------------------------------------------
    def _pull(self, group: str) -> None:
        members = self.groups[group]
        reply = self.core.pull(group, [self._load(e) for e in members], members[0].info.engine_id)
        for eid, work in reply.assignments.items():
            for a in work:
                self._start_prefill(self.engines[eid], a)
        if self.unfinished:
            self.loop.after(self.cfg.pull_interval_s, lambda: self._pull(group))

    def _load(self, e: SimEngine) -> EngineLoad:
        tok = sum(r.prompt + r.generated for r in e.held.values())
        free = e.info.capacity_tokens - sum(r.prompt + r.gen for r in e.held.values())
        node = e.info.node_id
        net = self.loop.net
        read_q = sum(net.remaining(f) for f in self.reading.get(node, ()) if f in net.flows)
        finished, e.finished = e.finished, []
        stored, e.stored = b"".join(e.stored), []
        read, e.read_bytes = e.read_bytes, 0.0
        return EngineLoad(e.info.engine_id, len(e.held), tok, int(read_q / self.cfg.model.kv_bytes_per_token),
                          free, request_ids=list(e.held), finished=finished, stored_keys=stored,
                          storage_read_bytes=int(read))

    # --- prefill ----------------------------------------------------------------------------------------------
    def _start_prefill(self, pe: SimEngine, a) -> None:
        rid = a.request_id.rsplit(".", 1)[0]
        req = self.by_id[rid]
        req.de = a.decode.engine_id
        req.hit_tokens = a.num_hit_blocks * self.cfg.block_size
        self.requests[a.request_id] = req
        pe.held[a.request_id] = req
        de = self.engines[req.de]
        de.held[a.request_id] = req
        hit_bytes = a.num_hit_blocks * self.cfg.block_size * self.cfg.model.kv_bytes_per_token
        reader = pe if a.path.value == "pe" else de
        route = path_route(PE_PATH if reader is pe else DE_PATH, pe.gpu, de.gpu) + (("storage", 1.0),)
        start = self.loop.now
        if not self.reads or hit_bytes == 0:
            self._compute(pe, a.request_id, start, start)
            return

        node, flow = reader.info.node_id, f"read:{a.request_id}"

        def loaded():
            self.reading[node].discard(flow)
            reader.read_bytes += hit_bytes
            self.read_bytes[reader.info.node_id] = self.read_bytes.get(reader.info.node_id, 0.0) + hit_bytes
            self._compute(pe, a.request_id, start, self.loop.now)

        self.reading.setdefault(node, set()).add(flow)
        self.loop.transfer(flow, hit_bytes, route, loaded)

    def _compute(self, pe: SimEngine, work: str, read_start: float, read_end: float) -> None:
        """Queue the request's prefill on its GPU (FIFO); when it may start depends on the prefill kind."""
        req = self.requests[work]
        t = self.cfg.engine.prefill.predict([(req.hit_tokens, req.prompt - req.hit_tokens)])
        if self.layerwise:  # layers compute as they arrive: done one layer after the read at the earliest
            begin = max(pe.busy_until, read_start)
            end = max(begin + t, read_end + t / self.cfg.engine.num_layers)
        else:
            begin = max(pe.busy_until, read_end)
            end = begin + t
        pe.busy_until = max(end, self.loop.now)
        self.loop.at(pe.busy_until, lambda: self._hand_off(pe, work))

    def _hand_off(self, pe: SimEngine, work: str) -> None:
        req = pe.held.pop(work)
        req.prefill_done = self.loop.now
        self.ttft.append(self.loop.now - req.submitted)
        de = self.engines[req.de]
        de.running[work] = req
        req.generated = 1
        if not de.stepping:
            de.stepping = True
            self._step(de)

    # --- decode -----------------------------------------------------------------------------------------------
    def _step(self, de: SimEngine) -> None:
        if not de.running:
            de.stepping = False
            return
        context = sum(r.prompt + r.generated for r in de.running.values())
        dt = self.cfg.engine.decode_step(len(de.running), context)
        self.loop.after(dt, lambda: self._stepped(de))

    def _stepped(self, de: SimEngine) -> None:
        bs = self.cfg.block_size
        for work, req in list(de.running.items()):
            req.generated += 1
            if req.generated >= req.gen:
                del de.running[work]
                del de.held[work]
                de.finished.append(work)
                self.tpot.append((self.loop.now - req.prefill_done) / max(req.gen - 1, 1))
                first, last = req.hit_tokens // bs, (req.prompt + req.gen) // bs  # what storage lacks
                de.stored.extend(block_key(req.agent.index, b) for b in range(first, last))
        self._step(de)

    # --- run --------------------------------------------------------------------------------------------------
    def run(self, until: float = math.inf) -> SimResult:
        for agent in self.agents:
            if agent.rounds:
                self.loop.at(agent.start, lambda a=agent: self._submit(a))
        groups = sorted(self.groups)
        for i, group in enumerate(groups):  # real groups' pull timers are not aligned: spread their phases
            self.loop.at(self.cfg.pull_interval_s * i / len(groups), lambda g=group: self._pull(g))
        self.loop.run(until)
        jct = max((a.finished_at for a in self.agents), default=0.0)
        return SimResult(jct, self.turns, dict(self.read_bytes), self.ttft, dict(self.loop.net.carried), self.tpot)


@dataclass(frozen=True)
class Slo:
    """The paper's online service objective. It states thresholds, not the statistic: means are used here."""

    ttft_s: float = 4.0
    tpot_s: float = 0.05

    def holds(self, r: SimResult) -> bool:
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        return mean(r.ttft_s) <= self.ttft_s and mean(r.tpot_s) <= self.tpot_s


def online_capacity(cfg: SimConfig, pool: list[list[tuple[int, int]]], duration_s: float, slo: Slo = Slo(),
                    iters: int = 8, seed: int = 0) -> dict:
    """The highest agent arrival rate (agents/s, Poisson over ``duration_s``) at which ``slo`` holds: doubling to
    find a rate that fails, then bisection. Agent i replays ``pool[i % len(pool)]``."""
    import numpy as np

    tried: dict[float, bool] = {}

    def ok(aps: float) -> bool:
        gaps = np.random.default_rng(seed).exponential(1.0 / aps, size=int(aps * duration_s * 2) + 1)
        starts = [float(t) for t in np.cumsum(gaps) if t < duration_s]
        r = ClusterSim(cfg, [pool[i % len(pool)] for i in range(len(starts))], starts).run()
        tried[aps] = slo.holds(r)
        return tried[aps]

    lo, hi = 0.0, 1.0
    while ok(hi):
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise ValueError("the SLO holds at any arrival rate: the workload is too small")
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return {"agents_per_s": lo, "tried": sorted(tried.items())}


def simulate_systems(args, hw: Hardware) -> list[dict]:
    """``dualpath simulate``: the trace the options describe, run once per system; one summary row each."""
    import numpy as np

    from dualpath.rollout.tracegen import generate_trace
    from dualpath.sim.hardware import MODELS
    from scheduler.balance import max_over_avg

    trajectories, _ = generate_trace(args.preset, args.agents, args.scale, args.turns_scale, seed=args.seed)
    rounds = [[(len(r.append), r.generate or r.max_tokens or 1) for r in t.rounds] for t in trajectories]
    engine = EngineModel(CostModel(0.0, 1.0 / args.prefill_tps, 0.0), args.decode_step_ms / 1e3, 0.0, 0.0,
                         args.decode_kv_tokens, args.layers)
    storage = args.storage_gbps * 1e9 / 8 if args.storage_gbps > 0 else math.inf
    rows = []
    for system in args.systems.split(","):
        cfg = SimConfig(hw, MODELS[args.model], engine, args.prefill, args.decode, system, storage)
        sim = ClusterSim(cfg, rounds)
        r = sim.run()
        caps = sim.loop.net.capacity
        util = {k: v / (caps[k] * r.jct_s) for k, v in r.link_bytes.items() if r.jct_s > 0 and k != "storage"}
        busiest = max(util, key=util.get) if util else ""
        rows.append({"system": system, "jct_s": r.jct_s, "turns": r.turns,
                     "turns_per_s": r.turns / r.jct_s if r.jct_s else 0.0,
                     "ttft_p50_s": float(np.median(r.ttft_s)) if r.ttft_s else 0.0,
                     "storage_read_bytes": r.storage_read_bytes,
                     "storage_read_max_over_avg": max_over_avg([r.storage_read_bytes.get(n, 0.0) for n in sim.groups])
                     if system != "oracle" else 0.0,
                     "busiest_link": busiest, "busiest_utilization": util.get(busiest, 0.0)})
        if args.online_seconds > 0:
            rows[-1]["online_agents_per_s"] = online_capacity(cfg, rounds, args.online_seconds)["agents_per_s"]
    return rows
