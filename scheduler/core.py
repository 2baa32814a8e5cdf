"""The scheduler's bookkeeping, without sockets: engines and their loads, requests and their queues, the block
index. The gRPC service (``scheduler.service``) calls these methods; tests call them directly.

A request's life: ``submit`` (hashes, hit length) -> decode queue -> a decode engine group pulls and the policy
gives it a decode engine (memory reserved) -> prefill queue -> a prefill group pulls, the policy gives it a prefill
engine and a read path -> the prefill engine runs it and hands it to the decode engine, which reports it finished.
Each attempt runs under its own work id (``<request>.<attempt>``), so reports about an abandoned attempt can
never touch a retry.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from dualpath.config import SchedulerConfig
from dualpath.errors import RequestError
from dualpath.geometry import block_hashes
from dualpath.messages import (Ack, Assignment, EngineInfo, EngineLoad, Mode, PullReply, ReadPath, Role,
                               SubmitEvent, SubmitRequest)
from dualpath.paths import default_kv_store
from dualpath.sampling_params import SamplingParams
from scheduler.index import BlockIndex
from scheduler.policy import EngineState, Policy, QueuedRequest

log = logging.getLogger(__name__)


@dataclass
class EngineRecord:
    info: EngineInfo
    load: EngineLoad | None = None
    last_seen: float = 0.0
    alive: bool = True
    outstanding: dict[str, tuple[int, int]] = field(default_factory=dict)  # work id -> (tokens, reserve)

    @property
    def group(self) -> str:
        return self.info.group_id or self.info.engine_id


@dataclass
class RequestRecord:
    spec: SubmitRequest
    params: SamplingParams
    hashes: list[bytes]
    hit_blocks: int
    events: "queue.Queue[SubmitEvent]"
    attempt: int = 0
    de: str | None = None
    pe: str | None = None
    path: str = ""
    streaming: bool = False
    submitted_at: float = 0.0

    @property
    def work_id(self) -> str:
        return f"{self.spec.request_id}.{self.attempt}"

    def queued(self, block_size: int) -> QueuedRequest:
        n = len(self.spec.token_ids)
        return QueuedRequest(self.work_id, n, self.hit_blocks * block_size, n + self.params.max_tokens)


class SchedulerCore:
    def __init__(self, config: SchedulerConfig, policy: Policy, clock=time.monotonic):
        self.config, self.policy, self.clock = config, policy, clock
        self.mode = Mode(config.mode)
        self.index = BlockIndex()
        self.engines: dict[str, EngineRecord] = {}
        self.requests: dict[str, RequestRecord] = {}  # by request id
        self.by_work: dict[str, str] = {}  # work id -> request id
        self.decode_queue: deque[str] = deque()
        self.prefill_queue: deque[str] = deque()
        self.cancelled_for: dict[str, list[str]] = {}  # engine -> work ids it must drop
        self.fingerprint: bytes | None = None
        self.block_size = 0
        self.max_model_len = 0
        self.eos: list[int] = []
        self.lock = threading.RLock()
        self.counters = {"submitted": 0, "finished": 0, "failed": 0, "retried": 0, "rejected": 0,
                         "path_pe": 0, "path_de": 0, "path_split": 0, "hit_tokens": 0, "prompt_tokens": 0,
                         "kv_load_failures": 0}
        self.storage_read_bytes: dict[str, int] = {}  # node -> completed storage read bytes
        self.prefill_busy_s: dict[str, float] = {}  # prefill engine -> attention seconds

    # --- engines --------------------------------------------------------------------------------------------
    def register(self, info: EngineInfo) -> Ack:
        fp = bytes.fromhex(info.fingerprint)
        with self.lock:
            if self.fingerprint is not None and (fp != self.fingerprint or info.block_size != self.block_size):
                return Ack(False, f"engine {info.engine_id} serves another model or block size than the cluster")
            first = self.fingerprint is None
            self.fingerprint, self.block_size = fp, info.block_size
            self.max_model_len, self.eos = info.max_model_len, list(info.eos_token_ids)
            old = self.engines.get(info.engine_id)
            if old is not None and old.alive:
                self._engine_gone(info.engine_id, "re-registered")
            self.engines[info.engine_id] = EngineRecord(info, last_seen=self.clock())
        if first:
            root = Path(self.config.kv_store).expanduser() if self.config.kv_store else default_kv_store()
            try:
                self.index.rebuild(root, fp)
            except OSError as e:
                log.warning("cannot rebuild the block index from %s: %s", root, e)
        log.info("engine %s joined (%s, node %s)", info.engine_id, info.role.value, info.node_id)
        return Ack()

    def alive(self, role: Role) -> list[EngineRecord]:
        return [e for e in self.engines.values() if e.alive and e.info.role is role]

    def ready(self) -> bool:
        return bool(self.alive(Role.PREFILL) and self.alive(Role.DECODE))

    def expire(self) -> None:
        """Declare engines silent for longer than the heartbeat timeout dead."""
        now = self.clock()
        with self.lock:
            for eid, e in list(self.engines.items()):
                if e.alive and now - e.last_seen > self.config.heartbeat_timeout_s:
                    self._engine_gone(eid, f"no load report for {now - e.last_seen:.1f} s")

    def _engine_gone(self, eid: str, why: str) -> None:
        e = self.engines[eid]
        e.alive = False
        log.warning("engine %s is gone (%s); re-queueing its requests", eid, why)
        for rid, r in list(self.requests.items()):
            if r.pe == eid or r.de == eid:
                if r.de == eid and r.streaming:
                    self._fail(rid, f"decode engine {eid} died while generating ({why})")
                else:
                    self._retry(rid, f"engine {eid} is gone")

    # --- requests -------------------------------------------------------------------------------------------
    def submit(self, spec: SubmitRequest) -> "queue.Queue[SubmitEvent]":
        """Accept a request (or raise ``RequestError``); events about it arrive on the returned queue."""
        params = SamplingParams.from_dict(spec.sampling)
        if spec.mode:
            Mode(spec.mode)  # raises on an unknown mode
        with self.lock:
            if not self.ready():
                raise RequestError("no prefill and decode engines are registered yet")
            if len(self.requests) >= self.config.max_queued_requests:
                self.counters["rejected"] += 1
                raise RequestError(f"scheduler overloaded: {len(self.requests)} requests in flight")
            if spec.request_id in self.requests:
                raise RequestError(f"duplicate request id {spec.request_id}")
            n = len(spec.token_ids)
            if n == 0 or n + params.max_tokens > self.max_model_len:
                raise RequestError(f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                                   f"model's context of {self.max_model_len}", field="max_tokens")
            hashes = block_hashes(spec.token_ids, self.fingerprint, self.block_size)
            # at least one prompt token is always computed: its logits give the first output token
            hit = min(self.index.hit_blocks(hashes), (n - 1) // self.block_size)
            r = RequestRecord(spec, params, hashes, hit, queue.Queue(), submitted_at=self.clock())
            self.requests[spec.request_id] = r
            self.by_work[r.work_id] = spec.request_id
            self.decode_queue.append(spec.request_id)
            self.counters["submitted"] += 1
            self.counters["prompt_tokens"] += n
            self.counters["hit_tokens"] += hit * self.block_size
            r.events.put(SubmitEvent("accepted", spec.request_id, num_hit_tokens=hit * self.block_size))
            return r.events

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        with self.lock:
            r = self.requests.get(request_id)
            if r is None:
                return
            for eid in (r.pe, r.de):
                if eid:
                    self.cancelled_for.setdefault(eid, []).append(r.work_id)
            self._drop(request_id, SubmitEvent("failed", request_id, error=reason))

    def _drop(self, rid: str, event: SubmitEvent | None) -> None:
        r = self.requests.pop(rid)
        self.by_work.pop(r.work_id, None)
        for q in (self.decode_queue, self.prefill_queue):
            if rid in q:
                q.remove(rid)
        for eid in (r.pe, r.de):
            if eid in self.engines:
                self.engines[eid].outstanding.pop(r.work_id, None)
        if event is not None:
            r.events.put(event)

    def _fail(self, rid: str, error: str) -> None:
        self.counters["failed"] += 1
        log.warning("request %s failed: %s", rid, error)
        self._drop(rid, SubmitEvent("failed", rid, error=error))

    def _retry(self, rid: str, why: str) -> None:
        r = self.requests[rid]
        if r.attempt + 1 >= self.config.max_attempts:
            self._fail(rid, f"gave up after {r.attempt + 1} attempts: {why}")
            return
        for eid in (r.pe, r.de):
            if eid in self.engines:
                self.engines[eid].outstanding.pop(r.work_id, None)
                if self.engines[eid].alive:
                    self.cancelled_for.setdefault(eid, []).append(r.work_id)
        self.by_work.pop(r.work_id, None)
        for q in (self.decode_queue, self.prefill_queue):
            if rid in q:
                q.remove(rid)
        r.attempt += 1
        r.pe = r.de = None
        self.by_work[r.work_id] = rid
        self.decode_queue.appendleft(rid)
        self.counters["retried"] += 1
        log.info("request %s retried (%s)", rid, why)

    # --- pulls ----------------------------------------------------------------------------------------------
    def report(self, load: EngineLoad) -> None:
        """A load report outside a pull (engines send one when a request finishes, so stored blocks are indexed
        before the submitter can send the next turn)."""
        with self.lock:
            self._absorb(load)

    def pull(self, group_id: str, loads: list[EngineLoad]) -> PullReply:
        with self.lock:
            for load in loads:
                self._absorb(load)
            group = [e for e in self.engines.values() if e.alive and e.group == group_id]
            if not group:
                return PullReply({})
            cancelled = [w for e in group for w in self.cancelled_for.pop(e.info.engine_id, [])]
            pulling = {e.info.engine_id for e in group}
            if group[0].info.role is Role.DECODE:
                self._assign_decode(pulling)
                return PullReply({}, cancelled)
            return PullReply(self._assign_prefill(pulling), cancelled)

    def _absorb(self, load: EngineLoad) -> None:
        e = self.engines.get(load.engine_id)
        if e is None or not e.alive:
            return
        e.load, e.last_seen = load, self.clock()
        for w in load.request_ids:
            e.outstanding.pop(w, None)  # the engine's own numbers now include it
        if load.stored_keys:
            self.index.add(bytes.fromhex(k) for k in load.stored_keys)
        if load.evicted_keys:
            self.index.remove(bytes.fromhex(k) for k in load.evicted_keys)
        node = e.info.node_id
        self.storage_read_bytes[node] = self.storage_read_bytes.get(node, 0) + load.storage_read_bytes
        if e.info.role is Role.PREFILL:
            self.prefill_busy_s[load.engine_id] = self.prefill_busy_s.get(load.engine_id, 0.0) + load.prefill_busy_s
        self.counters["kv_load_failures"] += load.kv_load_failures
        for w in load.started:
            rid = self.by_work.get(w)
            if rid is not None:
                self.requests[rid].streaming = True
        for w in load.finished:
            rid = self.by_work.get(w)
            if rid is not None:
                self.counters["finished"] += 1
                self._drop(rid, SubmitEvent("finished", rid))
        for w, reason in load.failed:
            rid = self.by_work.get(w)
            if rid is None:
                continue
            r = self.requests[rid]
            if e.info.role is Role.DECODE and r.streaming:
                self._fail(rid, reason)
            else:
                self._retry(rid, reason)

    def _state(self, e: EngineRecord) -> EngineState:
        load = e.load
        extra_tok = sum(t for t, _ in e.outstanding.values())
        extra_reserve = sum(r for _, r in e.outstanding.values())
        return EngineState(e.info.engine_id, e.info.node_id, e.group,
                           seq=(load.seq if load else 0) + len(e.outstanding),
                           tok=(load.tok if load else 0) + extra_tok,
                           free_tokens=(load.free_tokens if load else e.info.capacity_tokens) - extra_reserve)

    def _assign_decode(self, pulling: set[str]) -> None:
        waiting = [self.requests[rid].queued(self.block_size) for rid in self.decode_queue]
        states = [self._state(e) for e in self.alive(Role.DECODE)]
        for work_id, eid in self.policy.assign_decode(waiting, states, pulling):
            rid = self.by_work[work_id]
            r = self.requests[rid]
            r.de = eid
            q = r.queued(self.block_size)
            self.engines[eid].outstanding[work_id] = (q.num_tokens, q.reserve_tokens)
            self.decode_queue.remove(rid)
            self.prefill_queue.append(rid)

    def node_read_q(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.engines.values():
            if e.alive and e.load is not None:
                out[e.info.node_id] = out.get(e.info.node_id, 0) + e.load.read_q_tokens
        return out

    def _assign_prefill(self, pulling: set[str]) -> dict[str, list[Assignment]]:
        ready = [rid for rid in self.prefill_queue if self.engines[self.requests[rid].de].alive]
        waiting = [self.requests[rid].queued(self.block_size) for rid in ready]
        node_q = self.node_read_q()
        out: dict[str, list[Assignment]] = {}
        states = [self._state(e) for e in self.alive(Role.PREFILL)]
        for work_id, pe in self.policy.assign_prefill(waiting, states, pulling):
            rid = self.by_work[work_id]
            r = self.requests[rid]
            q = r.queued(self.block_size)
            pe_node, de_node = self.engines[pe].info.node_id, self.engines[r.de].info.node_id
            mode = Mode(r.spec.mode) if r.spec.mode else self.mode
            choice = self.policy.choose_path(q, node_q.get(pe_node, 0), node_q.get(de_node, 0), mode,
                                             self.block_size)
            pe_share = q.num_hit_tokens if choice.path is ReadPath.PE else max(0, choice.pe_blocks) * self.block_size
            node_q[pe_node] = node_q.get(pe_node, 0) + pe_share
            node_q[de_node] = node_q.get(de_node, 0) + q.num_hit_tokens - pe_share
            r.pe, r.path = pe, ("split" if choice.pe_blocks > 0 else choice.path.value)
            self.counters[f"path_{r.path}"] += 1
            self.engines[pe].outstanding[work_id] = (q.num_tokens, 0)
            self.prefill_queue.remove(rid)
            de = self.engines[r.de].info
            out.setdefault(pe, []).append(Assignment(
                work_id, list(r.spec.token_ids), dict(r.spec.sampling), [h.hex() for h in r.hashes[:r.hit_blocks]],
                choice.path, mode is not Mode.BASIC, de, choice.pe_blocks))
            r.events.put(SubmitEvent("assigned", rid, num_hit_tokens=q.num_hit_tokens, decode_engine=de.engine_id,
                                     decode_address=de.control_address, path=r.path, work_id=work_id))
        return out

    # --- metrics --------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        with self.lock:
            return {
                **self.counters,
                "decode_queue": len(self.decode_queue), "prefill_queue": len(self.prefill_queue),
                "in_flight": len(self.requests), "index_blocks": len(self.index),
                "engines_alive": sum(e.alive for e in self.engines.values()),
                "node_read_q_tokens": self.node_read_q(),
                "storage_read_bytes": dict(self.storage_read_bytes),
                "prefill_busy_s": dict(self.prefill_busy_s),
            }
