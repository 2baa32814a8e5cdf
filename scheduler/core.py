"""The scheduler's bookkeeping, without sockets: engines and their loads, requests and their queues, the block
index, balance metrics. The gRPC service (``dualpath.scheduler.service``) calls these methods; tests call them directly.

A request's life: ``submit`` (hashes, hit length) -> the global queue -> a decode group's private queue (policy
phase 1) -> when that group pulls, a decode engine (phase 2, memory reserved) -> the prefill queue -> when a
prefill group pulls, a prefill engine and a read path -> the prefill engine runs it and hands it to the decode
engine, which reports it finished. Each attempt runs under its own work id (``<request>.<attempt>``), so reports
about an abandoned attempt can never touch a retry.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import queue
import random
import secrets
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable, Collection, Iterable, Iterator
from pathlib import Path

from dualpath.core.config import SchedulerConfig
from dualpath.core.errors import RequestError, UnavailableError
from dualpath.core.geometry import HASH_BYTES, block_hashes, choice_blocks
from dualpath.core.messages import (
    Assignment,
    EngineInfo,
    EngineLoad,
    Mode,
    PrefetchOrder,
    PullReply,
    ReadPath,
    RegisterReply,
    Role,
    SubmitEvent,
    SubmitRequest,
    TurnEnd,
    pack_keys,
    unpack_keys,
)
from dualpath.core.paths import default_kv_store
from dualpath.core.sampling_params import ParamsCache, SamplingParams
from dualpath.core.sessions import session_key
from dualpath.scheduler.balance import WindowedSums, max_over_avg, measured_alpha
from dualpath.scheduler.index import BlockIndex
from dualpath.scheduler.policy import (
    Affinity,
    EngineState,
    NodeState,
    Policy,
    QueuedRequest,
    Running,
    preemption,
    shorter_queue,
)
from dualpath.scheduler.sessions import Session, SessionBook
from dualpath.scheduler.sessions_policy import load_time
from dualpath.traffic.storage.pins import remove_pin, write_pin

log = logging.getLogger(__name__)


class Fifo:
    """An ordered set of request ids: lower ranks first (a request's priority: vLLM's order), arrival order within a
    rank; O(1) append, push-front, remove and membership (a rank that appears or empties is sorted in or out of the
    few present). Each id may carry a weight (a private queue's tokens), summed in ``weight``."""

    def __init__(self):
        self._levels: dict[int, OrderedDict[str, int]] = {}  # rank -> its ids, in order, with their weights
        self._rank: dict[str, int] = {}
        self._ranks: list[int] = []  # those present, ascending
        self.weight = 0

    def append(self, rid: str, weight: int = 0, rank: int = 0) -> None:
        if rid in self._rank:  # an id already queued keeps its place
            level = self._levels[self._rank[rid]]
            self.weight += weight - level[rid]
            level[rid] = weight
            return
        if rank not in self._levels:
            self._levels[rank] = OrderedDict()
            bisect.insort(self._ranks, rank)
        self._levels[rank][rid] = weight
        self._rank[rid] = rank
        self.weight += weight

    def appendleft(self, rid: str, weight: int = 0, rank: int = 0) -> None:
        """First of its rank (a retry goes before the requests that arrived after it)."""
        self.append(rid, weight, rank)
        self._levels[self._rank[rid]].move_to_end(rid, last=False)

    def remove(self, rid: str) -> None:
        rank = self._rank.pop(rid)
        level = self._levels[rank]
        self.weight -= level.pop(rid)
        if not level:
            del self._levels[rank]
            self._ranks.remove(rank)

    def discard(self, rid: str) -> None:
        if rid in self._rank:
            self.remove(rid)

    def popleft(self) -> str:
        rid = self.first()
        self.remove(rid)
        return rid

    def __contains__(self, rid: str) -> bool:
        return rid in self._rank

    def __iter__(self) -> Iterator[str]:
        # live: callers finish iterating before they add or remove
        return itertools.chain.from_iterable(self._levels[r] for r in self._ranks)

    def __len__(self) -> int:
        return len(self._rank)

    def __bool__(self) -> bool:
        return bool(self._rank)

    def first(self) -> str:
        return next(iter(self._levels[self._ranks[0]]))

    def by_rank(self) -> dict[int, int]:
        return {r: len(self._levels[r]) for r in self._ranks}


class Lazy:
    """A sequence built on demand from an iterator (policies walk a queue's head and stop early; re-iteration
    reuses what was built)."""

    def __init__(self, source):
        self._it, self._items = iter(source), []

    def __iter__(self):
        i = 0
        while True:
            if i < len(self._items):
                yield self._items[i]
            else:
                try:
                    self._items.append(next(self._it))
                except StopIteration:
                    return
                yield self._items[i]
            i += 1


class Outstanding:
    """Work given to an engine that its reports do not count yet: work id -> (tokens, reserve), with the sums kept
    (engine states are built on every pull; summing the entries each time dominated the scheduler at scale)."""

    __slots__ = ("_d", "tokens", "reserve")

    def __init__(self):
        self._d: dict[str, tuple[int, int]] = {}
        self.tokens = self.reserve = 0

    def add(self, work: str, tokens: int, reserve: int) -> None:
        self.discard(work)
        self._d[work] = (tokens, reserve)
        self.tokens += tokens
        self.reserve += reserve

    def discard(self, work: str) -> None:
        v = self._d.pop(work, None)
        if v is not None:
            self.tokens -= v[0]
            self.reserve -= v[1]

    def discard_all(self, works: list[str]) -> None:
        """Discard each of ``works`` (a report's held requests: often many more than are outstanding)."""
        few = len(self._d) <= 4  # the usual case: scanning the list beats building a set of it
        for w in [w for w in self._d if w in works] if few else self._d.keys() & set(works):
            self.discard(w)

    def __len__(self) -> int:
        return len(self._d)


@dataclass
class EngineRecord:
    info: EngineInfo
    load: EngineLoad | None = None
    last_seen: float = 0.0
    alive: bool = True
    outstanding: Outstanding = field(default_factory=Outstanding)
    group: str = field(init=False)  # the engine group it pulls with (itself when it has none)
    prefilled: tuple[float, float] = (0.0, 0.0)  # prefill engines: (tokens, seconds) of recent prefills, decaying
    read_intervals: list[list[float]] = field(default_factory=list)  # its last report's storage drain intervals
    # decode engines: requests generating there (reported started): an index of ``SchedulerCore.requests`` that
    # preemption reads on a full group's pulls, kept so that costs the group's replies, not every request
    decoding: set[str] = field(default_factory=set)

    def measured_beta(self) -> int:
        """Tokens it prefills in 5 s, from its recent prefills (0 until it has prefilled a few blocks' worth)."""
        tokens, seconds = self.prefilled
        return int(5 * tokens / seconds) if tokens >= 64 and seconds > 0 else 0

    def __post_init__(self):
        self.group = self.info.group_id or self.info.engine_id


def request_of(work_id: str) -> str:
    """The request id of a work id (``REQUEST.ATTEMPT.NONCE``; request ids may hold dots themselves)."""
    return work_id.rsplit(".", 2)[0]


@dataclass
class RequestRecord:
    spec: SubmitRequest
    params: SamplingParams
    mode: Mode
    hashes: bytes  # the prompt's chained block hashes, packed
    hit_blocks: int
    notify: Callable[[SubmitEvent], None]  # where events about the request go
    attempt: int = 0
    group: str | None = None  # the decode group whose private queue holds it
    de: str | None = None
    pe: str | None = None
    path: str = ""
    streaming: bool = False
    submitted_at: float = 0.0
    seq: int = 0  # its place in the order of submissions (a hold lets the earlier ones run)
    # the unguessable part of its work ids: an engine's ``Stream`` of a work id is a capability held only by the
    # submitter, told it by the scheduler, and the request's own engines (request ids are the clients' to choose)
    nonce: str = field(default_factory=lambda: secrets.token_hex(8))
    session: str = ""  # the key of the agent session it is a turn of ("": none)
    affinity: Affinity | None = None  # where that session's last turn ran, and its prefetch

    @property
    def work_id(self) -> str:
        return f"{self.spec.request_id}.{self.attempt}.{self.nonce}"

    @property
    def rank(self) -> int:
        """Where it queues: lower first (``SamplingParams.priority``; all 0 under first-come-first-served)."""
        return self.params.priority


class SchedulerCore:
    def __init__(self, config: SchedulerConfig, policy: Policy, clock=time.monotonic, balance_window_s: float = 30.0):
        self.config, self.policy, self.clock = config, policy, clock
        self.mode = Mode(config.mode)
        self.index = BlockIndex()
        self.index_rebuild: threading.Thread | None = None  # lists storage after the first registration
        self.engines: dict[str, EngineRecord] = {}
        self.by_node: dict[str, list[EngineRecord]] = {}
        self.by_group: dict[str, list[EngineRecord]] = {}
        self.alive_ids: dict[Role, set[str]] = {Role.PREFILL: set(), Role.DECODE: set()}
        # a role whose engines have all gone: since when, and the last one's departure (for errors and /health)
        self.unserved_since: dict[Role, float] = {}
        self.last_gone: dict[Role, str] = {}
        self._alive_sorted: dict[Role, list[EngineRecord]] = {}  # cache of alive(); dropped when alive_ids change
        self._views: dict[str, tuple] = {}  # group -> (alive members, their ids, members()); dropped likewise
        # prefill group -> what its engines were (``_prefill_key``) when the policy said they could take nothing
        self._full_prefill: dict[str, tuple] = {}
        self.requests: dict[str, RequestRecord] = {}  # by request id
        self.by_work: dict[str, str] = {}  # work id -> request id
        self.global_queue = Fifo()
        self.private: dict[str, Fifo] = {}  # decode group -> its private queue
        self.prefill_queue = Fifo()
        self.cancelled_for: dict[str, list[str]] = {}  # engine -> work ids it must drop
        self.preempt_for: dict[str, list[str]] = {}  # decode engine -> work ids it must hand back (preemption)
        self.preempting: set[str] = set()  # requests told to hand back, until their engines report them ended
        self.fingerprint: bytes | None = None
        self.weights_version = ""  # the label of the weights last loaded by an update
        self.weights_path = ""  # the checkpoint they came from ("": the ones the engines started with)
        self.adapters: list[str] = []  # LoRA adapters loaded at runtime, their paths in load order (joiners load them)
        self.paused = False  # a weight update runs: no request is handed to an engine
        # ``hold`` (vLLM's /pause) until ``release``: requests submitted from this seq on are not handed out
        self.held_from: int | None = None
        self.block_size = 0
        self.max_model_len = 0
        self.lock = threading.RLock()
        self.counters = {
            "submitted": 0,
            "finished": 0,
            "failed": 0,
            "retried": 0,
            "rejected": 0,
            "path_pe": 0,
            "path_de": 0,
            "path_split": 0,
            "hit_tokens": 0,
            "recomputed_hit_tokens": 0,
            "prompt_tokens": 0,
            "kv_load_failures": 0,
            "kv_corrupt_removed": 0,
            "cache_flushes": 0,
            "preempted": 0,
            "rpc_refused": 0,
            "blocks_stored": 0,
            "blocks_evicted": 0,
            "session_turns": 0,
            "session_turns_prefetched": 0,  # placed where their prefetch was
            "session_turns_kept_decode": 0,  # on their last turn's decode engine
            "prefetch_orders": 0,
            "prefetch_blocks_ordered": 0,
            "hashes_verified": 0,
            "hash_mismatches": 0,
        }
        self._params = ParamsCache()
        self._verify_rng = random.Random()  # which trusted hashes are checked: unpredictable to a submitter
        self._verify_all = False  # set for good by a mismatch
        self.sessions = SessionBook()
        self.pinned: dict[str, dict[str, int]] = {}  # tenant (cache salt) -> its sessions' pinned blocks
        self._pins = ThreadPoolExecutor(1, thread_name_prefix="pins")  # pin files are written off the lock
        self.prefetch_for: dict[str, list[PrefetchOrder]] = {}  # engine -> sessions' KV to read ahead
        self.prefetch_stats: dict[str, dict] = {}  # engine -> its prefetcher's cumulative counts
        self.policy.affinity = config.session_affinity
        self.storage_read_bytes: dict[str, int] = {}  # node -> completed storage read bytes (all time)
        self.prefill_busy_s: dict[str, float] = {}  # prefill engine -> attention seconds (all time)
        self.pulls_by_sender: dict[str, int] = {}
        self.traffic: dict[str, dict[str, int]] = {}  # engine -> cumulative "path:class" -> bytes
        self.speculative: dict[str, dict[str, int]] = {}  # decode engine -> cumulative draft tokens fed, kept
        self._totals: dict[str, int] | None = None
        self._decode_by_group: tuple[list[EngineRecord], list[tuple[str, list[EngineRecord]]]] | None = None
        self._room: int | None = None  # _decode_room's answer, dropped when the roster changes
        self._totals_at = 0.0
        self._alphas: dict[str, tuple[float, int]] = {}  # node -> (when measured, measured alpha)
        self.read_window = WindowedSums(balance_window_s, clock)
        self.busy_window = WindowedSums(balance_window_s, clock)

    # --- engines --------------------------------------------------------------------------------------------
    def register(self, info: EngineInfo) -> RegisterReply:
        fp = bytes.fromhex(info.fingerprint)
        with self.lock:
            if self.fingerprint is not None and (fp != self.fingerprint or info.block_size != self.block_size):
                return RegisterReply(
                    False, f"engine {info.engine_id} serves another model or block size than the cluster"
                )
            first = self.fingerprint is None
            self.fingerprint, self.block_size, self.max_model_len = fp, info.block_size, info.max_model_len
            if first and info.weights_version + info.weights_path:  # this scheduler restarted after an update
                self.weights_version, self.weights_path = info.weights_version, info.weights_path
            # adapters loaded at runtime before this scheduler (re)started: joiners load them too
            self.adapters += [p for p in info.adapters if p not in self.adapters]
            old = self.engines.get(info.engine_id)
            if old is not None and old.alive:
                self._engine_gone(info.engine_id, "re-registered")
            rec = self.engines[info.engine_id] = EngineRecord(info, last_seen=self.clock())
            for index, key in ((self.by_node, info.node_id), (self.by_group, rec.group)):
                index[key] = [x for x in index.get(key, []) if x.info.engine_id != info.engine_id] + [rec]
            self.alive_ids[info.role].add(info.engine_id)
            self._roster_changed(info.role)
            if info.role is Role.DECODE:
                self.private.setdefault(rec.group, Fifo())
            else:
                self.busy_window.track(info.engine_id)
                self.prefill_busy_s.setdefault(info.engine_id, 0.0)
            self.read_window.track(info.node_id)
            self.storage_read_bytes.setdefault(info.node_id, 0)
            members = self.members(rec.group)
        if first:
            self._rebuild_index(fp)
        log.info("engine %s joined (%s, node %s, group %s)", info.engine_id, info.role.value, info.node_id, rec.group)
        return RegisterReply(True, members=members, adapters=list(self.adapters))

    def _rebuild_index(self, fingerprint: bytes) -> None:
        """List what storage holds for the cluster's model, on a thread of its own: the first engine's registration
        (and every request) must not wait for minutes of directory listing on a large store. A block evicted while
        the listing runs may come back as a stale entry; its load then fails and is recomputed, as any miss is."""
        root = self._store_root()

        def run():
            try:
                self.index.rebuild(root, fingerprint)
            except OSError as e:
                log.warning("cannot rebuild the block index from %s: %s", root, e)

        self.index_rebuild = threading.Thread(target=run, name="index-rebuild", daemon=True)
        self.index_rebuild.start()

    def _store_root(self) -> Path:
        return Path(self.config.kv_store).expanduser() if self.config.kv_store else default_kv_store()

    def members(self, group: str) -> list[list[str]]:
        return sorted([e.info.engine_id, e.info.control_address] for e in self.by_group.get(group, ()) if e.alive)

    def alive(self, role: Role) -> list[EngineRecord]:
        if role not in self._alive_sorted:
            self._alive_sorted[role] = [self.engines[eid] for eid in sorted(self.alive_ids[role])]
        return self._alive_sorted[role]

    def ready(self) -> bool:
        return bool(self.alive_ids[Role.PREFILL] and self.alive_ids[Role.DECODE])

    def refused_call(self) -> None:
        """A call to the scheduler came without the cluster's credentials (``dualpath.core.rpc``)."""
        with self.lock:
            self.counters["rpc_refused"] += 1

    def missing(self) -> list[str]:
        """What keeps the cluster from serving, in words (empty when it can)."""
        now, out = self.clock(), []
        with self.lock:
            for role in (Role.PREFILL, Role.DECODE):
                if self.alive_ids[role]:
                    continue
                since = self.unserved_since.get(role)
                out.append(
                    f"no {role.value} engine has registered yet"
                    if since is None
                    else f"no {role.value} engine alive for {now - since:.0f} s ({self.last_gone[role]})"
                )
        return out

    def expire(self) -> None:
        """Declare engines silent for longer than the heartbeat timeout dead; fail the requests that waited
        ``engine_wait_timeout_s`` for a role with no engine alive."""
        now = self.clock()
        with self.lock:
            for eid, e in list(self.engines.items()):
                if e.alive and now - e.last_seen > self.config.heartbeat_timeout_s:
                    self._engine_gone(eid, f"no load report for {now - e.last_seen:.1f} s")
            if self.unserved_since and self.config.engine_wait_timeout_s > 0:
                self._fail_unserved(now)
            self._unpin(self.sessions.expire(now))

    def _fail_unserved(self, now: float) -> None:
        """A request waits for a missing role (its engines restarting) at most the bound, counted from when it
        began to wait for it; then it fails as unavailable (a 503, or an error in its stream), never hangs."""
        bound, why = self.config.engine_wait_timeout_s, None
        for rid, r in list(self.requests.items()):
            needs = [
                self.unserved_since[role] for role in self.unserved_since if role is Role.DECODE or not r.streaming
            ]  # a generating reply needs no prefill engine
            if needs and now - max(max(needs), r.submitted_at) > bound:
                why = why or "; ".join(self.missing())
                self._fail(rid, f"unavailable: waited {bound:.0f} s for an engine: {why}")

    def lost(self, eid: str, why: str) -> None:
        """Count engine ``eid`` gone now (it failed a health check), as a missed heartbeat would."""
        with self.lock:
            if self._alive(eid):
                self._engine_gone(eid, why)

    def _roster_changed(self, role: Role) -> None:
        """An engine of ``role`` joined or left: drop what is derived from who is alive."""
        if self.alive_ids[role]:
            self.unserved_since.pop(role, None)
        else:
            self.unserved_since.setdefault(role, self.clock())
        self._totals = self._room = None
        self._alive_sorted.pop(role, None)
        self._views.clear()

    def _engine_gone(self, eid: str, why: str) -> None:
        e = self.engines[eid]
        e.alive = False
        self.alive_ids[e.info.role].discard(eid)
        self.last_gone[e.info.role] = f"{eid} is gone: {why}"
        self.preempt_for.pop(eid, None)
        self.prefetch_for.pop(eid, None)
        self.sessions.engine_gone(eid)
        self._roster_changed(e.info.role)
        # (once generating, a request's prefill engine is done with it)
        mine = [(rid, r) for rid, r in self.requests.items() if r.de == eid or (r.pe == eid and not r.streaming)]
        (log.warning if mine else log.info)(
            "engine %s is gone (%s)%s", eid, why, f"; {len(mine)} of its request(s) go elsewhere" if mine else ""
        )
        for rid, r in mine:
            if r.de == eid and r.streaming:  # the submitter may continue the reply elsewhere (dualpath.client)
                self._fail(rid, f"decode engine {eid} died while generating ({why})", engine_lost=True)
            else:
                self._retry(rid, f"engine {eid} is gone")
        if e.info.role is Role.DECODE and not any(x.alive for x in self.by_group.get(e.group, ())):
            orphans = self.private.pop(e.group, Fifo())  # the whole group left: back to the global queue
            for rid in reversed(list(orphans)):
                self.requests[rid].group = None
                self.global_queue.appendleft(rid, rank=self.requests[rid].rank)
        if e.info.role is Role.PREFILL:
            self.busy_window.forget(eid)
        if not any(x.alive for x in self.by_node.get(e.info.node_id, ())):
            self.read_window.forget(e.info.node_id)

    # --- requests -------------------------------------------------------------------------------------------
    def submit(
        self,
        spec: SubmitRequest,
        notify: Callable[[SubmitEvent], None] | None = None,
        trust_hashes: bool = False,
        member: bool = False,
    ):
        """Accept a request (or raise ``RequestError``). Events about it go to ``notify``; without one they go to a
        ``queue.Queue``, which is returned. The prompt's block hashes (``_prompt_hashes``) are computed here from
        its tokens, salt and adapter, so no submitter can claim another tenant's stored KV for its own tokens,
        unless the submitter is a ``member`` the plane authenticated (its hashes are used, a share of them checked)
        or an in-process caller whose prompts are synthetic (``trust_hashes``: used as sent, the simulator)."""
        events: queue.Queue | None = None
        if notify is None:
            events = queue.Queue()
            notify = events.put
        params = self._params.get(spec.sampling)
        mode = Mode(spec.mode) if spec.mode else self.mode
        with self.lock:
            if not self.ready() and not self._can_wait():
                raise UnavailableError("; ".join(self.missing()))
            if len(self.requests) >= self.config.max_queued_requests:
                self.counters["rejected"] += 1
                raise UnavailableError(f"scheduler overloaded: {len(self.requests)} requests in flight")
            if spec.request_id in self.requests:
                raise RequestError(f"duplicate request id {spec.request_id}")
            n = spec.num_tokens
            if n == 0 or n + params.max_new_tokens > self.max_model_len:
                raise RequestError(
                    f"prompt ({n - params.num_resumed_tokens} tokens) plus max_tokens "
                    f"({params.max_tokens}) exceeds the model's context of {self.max_model_len}",
                    field="max_tokens",
                )
            if params.priority and self.config.scheduling_policy != "priority":
                raise RequestError(
                    "priority scheduling is not enabled: start the scheduler with --scheduling-policy priority",
                    field="priority",
                )
            if params.num_resumed_tokens >= n:
                raise RequestError(
                    f"{params.num_resumed_tokens} resumed tokens of a {n}-token list leave no prompt",
                    field="num_resumed_tokens",
                )
            room = self._decode_room()
            if self._choice_tokens(n, params) > room:  # it would wait at the head of its queue forever
                raise RequestError(
                    f"{params.n} choice(s) of {params.max_tokens} tokens after a {n}-token prompt need "
                    f"more KV memory than a decode engine has ({room} tokens)",
                    field="max_tokens",
                )
            stale = bool(spec.fingerprint) and spec.fingerprint != self.fingerprint.hex()
            hashes = self._prompt_hashes(spec, params, (trust_hashes or member) and not stale, member)
            if len(hashes) != n // self.block_size * HASH_BYTES:
                raise RequestError(f"{len(hashes) // HASH_BYTES} block hashes for {n} tokens", field="block_hashes")
            hit = self._hit_blocks(hashes, n, params)
            r = RequestRecord(
                spec, params, mode, hashes, hit, notify, submitted_at=self.clock(), seq=self.counters["submitted"]
            )
            if spec.session is not None:
                self._begin_turn(r)
            self.requests[spec.request_id] = r
            self.by_work[r.work_id] = spec.request_id
            # a reply going on (moved off a lost engine, or preempted) was admitted before the requests of its rank
            (self.global_queue.appendleft if params.num_resumed_tokens else self.global_queue.append)(
                spec.request_id, rank=r.rank
            )
            self.counters["submitted"] += 1
            self.counters["prompt_tokens"] += n
            self.counters["hit_tokens"] += hit * self.block_size
            notify(
                SubmitEvent(
                    "accepted",
                    spec.request_id,
                    num_hit_tokens=hit * self.block_size,
                    fingerprint=self.fingerprint.hex() if stale else "",
                )
            )
            return events

    def _begin_turn(self, r: RequestRecord) -> None:
        hint = r.spec.session.checked()
        r.session = session_key(hint.id, r.params.cache_salt, r.params.adapter)
        tail = r.spec.tokens[len(r.hashes) // HASH_BYTES * self.block_size * 4 :]
        a = self.sessions.begin_turn(
            r.session,
            hint,
            r.spec.request_id,
            tail,
            r.hashes,
            r.params.cache_salt,
            r.params.adapter,
            self.clock(),
        )
        de = self.engines.get(a.de)
        r.affinity = replace(a, de_group=de.group if de and de.alive else "") if a.pe or a.de else None
        self.counters["session_turns"] += 1

    def end_turn(self, t: TurnEnd) -> None:
        """A session's turn replied (its submitter says so): the session waits for its next turn, and that turn's
        prefetch is planned."""
        with self.lock:
            s = self.sessions.of_request(t.request_id)
            if s is None or not self.fingerprint:
                return
            more = s.tail + t.output_tokens  # the chain goes on from the session's last whole block
            parent = s.hashes[-HASH_BYTES:] if s.hashes else None
            new = block_hashes(more, self.fingerprint, self.block_size, parent, salt=s.salt, adapter=s.adapter)
            tail = more[len(new) * self.block_size * 4 :]
            hint = t.next_turn_in_s if t.next_turn_in_s >= 0 else None
            s = self.sessions.turn_end(t.request_id, tail, s.hashes + pack_keys(new), t.tool_wait, hint, self.clock())
            if s is not None:
                self._plan_prefetch(s)

    def _plan_prefetch(self, s: Session) -> None:
        if self.config.session_prefetch:
            self.sessions.schedule(s, self._read_seconds(s))
        if s.ttl_s > 0:
            self._pin(s)

    def _pin(self, s: Session) -> None:
        """Keep the session's stored blocks against eviction for its TTL, within its tenant's quota (a pin file the
        stores' evictors read: ``dualpath.traffic.storage.pins``)."""
        mine = self.pinned.setdefault(s.salt, {})
        mine.pop(s.key, None)
        room = self.config.session_pin_quota_tokens // self.block_size - sum(mine.values())
        blocks = min(self.index.hit_blocks(s.hashes), max(0, room))
        if blocks < self.index.hit_blocks(s.hashes):
            log.warning("session %s: its tenant's pin quota holds %d of its blocks", s.key[:12], blocks)
        mine[s.key] = blocks
        keys = unpack_keys(s.hashes[: blocks * HASH_BYTES])
        model_dir, until = self._store_root() / self.fingerprint.hex(), time.time() + s.ttl_s
        self._pins.submit(_write_pin, model_dir, s.key, keys, until)

    def _unpin(self, sessions: list[Session]) -> None:
        for s in sessions:
            if self.pinned.get(s.salt, {}).pop(s.key, None) is not None and self.fingerprint:
                self._pins.submit(remove_pin, self._store_root() / self.fingerprint.hex(), s.key)

    def _read_seconds(self, s: Session) -> float:
        """How long the session's stored KV takes to read at the slower of its engines' nodes (unknown: forever, so
        its prefetch goes out at once)."""
        tokens = self.index.hit_blocks(s.hashes) * self.block_size
        rates = [self.node_state(self.engines[e].info.node_id).alpha / 3 for e in (s.pe, s.de) if e in self.engines]
        rate = min((x for x in rates if x > 0), default=0.0)
        return load_time(tokens, rate)

    def _order_prefetches(self) -> None:
        """Send each session whose prefetch is due to the engine that will serve its next turn: its last decode or
        prefill engine, on the side whose node has the shorter storage read queue (the paper's rule, now)."""
        for s in self.sessions.due(self.clock()):
            blocks = self.index.hit_blocks(s.hashes)
            eid = self._prefetch_engine(s)
            if not blocks or eid is None:
                continue
            hold = self.sessions.ordered(s, eid, blocks, self.clock())
            self.prefetch_for.setdefault(eid, []).append(PrefetchOrder(s.key, s.hashes[: blocks * HASH_BYTES], hold))
            self.counters["prefetch_orders"] += 1
            self.counters["prefetch_blocks_ordered"] += blocks

    def _prefetch_engine(self, s: Session) -> str | None:
        """Where the session's next turn will most likely read: its decode engine is chosen first (and keeps the
        turn where phase 2's Z bound allows), and any prefill engine reads its buffer on the DE path; its prefill
        engine is as sure only when one prefill group pulls every request (then the side with the shorter read
        queue, the paper's rule). A turn placed elsewhere reads storage as usual."""
        pe, de = (self.engines.get(e) for e in (s.pe, s.de))
        pe = pe if pe and pe.alive and self.mode is not Mode.DE else None
        de = de if de and de.alive and self.mode not in (Mode.PE, Mode.BASIC) else None
        if pe and de:
            if len({e.group for e in self.alive(Role.PREFILL)}) > 1:
                return de.info.engine_id
            side = shorter_queue(None, self.node_state(pe.info.node_id), self.node_state(de.info.node_id)).path
            return (pe if side is ReadPath.PE else de).info.engine_id
        return (pe or de).info.engine_id if (pe or de) else None

    def _decode_room(self) -> int:
        """The most KV tokens one decode engine holds: of those alive, or while none is (they are restarting) of
        every one registered. Kept until the roster changes: submit asks it for every request."""
        if self._room is None:
            pool = self.alive(Role.DECODE) or [e for e in self.engines.values() if e.info.role is Role.DECODE]
            self._room = max(e.info.capacity_tokens for e in pool)
        return self._room

    def _can_wait(self) -> bool:
        """Whether a request may queue although a role has no engine alive: every missing role had engines (they
        are restarting) and waits are bounded."""
        missing = [role for role in (Role.PREFILL, Role.DECODE) if not self.alive_ids[role]]
        return self.config.engine_wait_timeout_s > 0 and all(role in self.unserved_since for role in missing)

    def _prompt_hashes(self, spec: SubmitRequest, params: SamplingParams, trusted: bool, member: bool) -> bytes:
        """The prompt's chained block hashes: a trusted submitter's as sent for the current fingerprint (a
        member's: a random ``verify_block_hashes`` share of them recomputed and compared), anyone else's computed
        here. A member whose hashes differ from the tokens' has a bug: its request gets the right hashes, the
        mismatch is logged and counted, and every later member's prompt is hashed here."""
        sent = spec.block_hashes
        if not (trusted and sent):
            return self._hash(spec.tokens, params)
        if not member or not (self._verify_all or self._verify_rng.random() < self.config.verify_block_hashes):
            return sent
        mine = self._hash(spec.tokens, params)
        self.counters["hashes_verified"] += 1
        if mine != sent:
            self.counters["hash_mismatches"] += 1
            self._verify_all = True
            log.error(
                "request %s: its submitter's block hashes differ from its tokens' (a member's bug): "
                "the scheduler now hashes every prompt itself",
                spec.request_id,
            )
        return mine

    def _hash(self, tokens: bytes, params: SamplingParams) -> bytes:
        return pack_keys(
            block_hashes(tokens, self.fingerprint, self.block_size, salt=params.cache_salt, adapter=params.adapter)
        )

    def _hit_blocks(self, hashes: bytes, n: int, params: SamplingParams) -> int:
        """Leading prompt blocks stored. At least one prompt token is always computed (its logits give the first
        output token); prompt logprobs need every prompt token computed."""
        if params.prompt_logprobs is not None:
            return 0
        return min(self.index.hit_blocks(hashes), (n - 1) // self.block_size)

    def queued(self, r: RequestRecord) -> QueuedRequest:
        n = r.spec.num_tokens
        de_node = self.engines[r.de].info.node_id if r.de else ""
        return QueuedRequest(
            r.work_id,
            n,
            r.hit_blocks * self.block_size,
            self._decode_tokens(r),
            de_node,
            r.mode,
            r.de or "",
            r.affinity,
        )

    def _decode_tokens(self, r: "RequestRecord") -> int:
        """The most KV a decode engine holds for ``r`` (in tokens of whole blocks): the prompt once, every choice's
        generation budget."""
        return self._choice_tokens(r.spec.num_tokens, r.params)

    def _choice_tokens(self, n_prompt: int, params: SamplingParams) -> int:
        total = min(n_prompt + params.max_new_tokens, self.max_model_len)
        return choice_blocks(self.block_size, n_prompt, total, params.n) * self.block_size

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        with self.lock:
            r = self.requests.get(request_id)
            if r is None:
                return
            self._cancel_on_engines(r)
            self._drop(request_id, SubmitEvent("failed", request_id, error=reason))

    def _cancel_on_engines(self, r: RequestRecord) -> None:
        """The engines holding ``r`` drop it (told on their group's next pull)."""
        for eid in (r.pe, r.de):
            if eid:
                self.cancelled_for.setdefault(eid, []).append(r.work_id)

    def _unqueue(self, rid: str) -> None:
        r = self.requests[rid]
        self.global_queue.discard(rid)
        self.prefill_queue.discard(rid)
        if r.group in self.private:
            self.private[r.group].discard(rid)
        r.group = None

    def _drop(self, rid: str, event: SubmitEvent | None) -> None:
        self._unqueue(rid)
        r = self.requests.pop(rid)
        self.by_work.pop(r.work_id, None)
        self.preempting.discard(rid)
        if r.de in self.engines:
            self.engines[r.de].decoding.discard(rid)
        for eid in (r.pe, r.de):
            if eid in self.engines:
                self.engines[eid].outstanding.discard(r.work_id)
        if event is not None:
            r.notify(event)

    def _fail(self, rid: str, error: str, engine_lost: bool = False, aborted: bool = False) -> None:
        self.counters["failed"] += 1
        log.warning("request %s failed: %s", rid, error)
        self._drop(rid, SubmitEvent("failed", rid, error=error, engine_lost=engine_lost, aborted=aborted))

    def _retry(self, rid: str, why: str) -> None:
        r = self.requests[rid]
        if r.attempt + 1 >= self.config.max_attempts:
            self._fail(rid, f"gave up after {r.attempt + 1} attempts: {why}")
            return
        for eid in (r.pe, r.de):
            if eid in self.engines:
                self.engines[eid].outstanding.discard(r.work_id)
                if self.engines[eid].alive:
                    self.cancelled_for.setdefault(eid, []).append(r.work_id)
        self._unqueue(rid)
        self.by_work.pop(r.work_id, None)
        r.attempt += 1
        r.pe = r.de = None
        self.by_work[r.work_id] = rid
        self.global_queue.appendleft(rid, rank=r.rank)
        self.counters["retried"] += 1
        log.info("request %s retried (%s)", rid, why)

    # --- weight updates -------------------------------------------------------------------------------------
    def pause(self, abort: bool = False) -> int:
        """Stop handing requests to engines (new weights are about to load); requests keep being accepted and
        queue. With ``abort``, requests on engines go back to the queue if none of their tokens streamed, and
        fail if some did (they would end on other weights); returns how many failed."""
        with self.lock:
            self.paused = True
            if not abort:
                return 0
            ended = 0
            for rid, r in list(self.requests.items()):
                if not (r.pe or r.de):
                    continue
                if r.streaming:
                    self._cancel_on_engines(r)
                    self._fail(rid, "aborted: the model's weights are being updated", aborted=True)
                    ended += 1
                else:
                    self._retry(rid, "the model's weights are being updated")
            return ended

    @property
    def held(self) -> bool:
        return self.held_from is not None

    def hold(self, abort: bool = False) -> int:
        """Hand no request submitted from now on to an engine until ``release`` (vLLM's /pause, SGLang's
        /pause_generation: a trainer about to change the weights); they are accepted and queue. Those submitted
        before run to their end (``hold_drained`` says when), or with ``abort`` every request in flight ends now,
        queued or on engines: its choices end with finish reason abort and the tokens they had. Returns how many
        ended. A weight update meanwhile leaves the cluster held."""
        with self.lock:
            if self.held_from is None:  # a second hold keeps the first one's line
                self.held_from = self.counters["submitted"]
            return self.abort(None, "generation was paused (/pause)") if abort else 0

    def abort(self, label: str | None, why: str = "/abort_request") -> int:
        """End the requests in flight labelled ``label`` (None: every one), queued or on engines: their choices
        finish with the tokens they had, reason abort, and their engines drop them. Returns how many ended."""
        with self.lock:
            ended = [(rid, r) for rid, r in self.requests.items() if label is None or r.spec.label == label]
            for rid, r in ended:
                self._cancel_on_engines(r)
                self._fail(rid, f"aborted: {why}", aborted=True)
            return len(ended)

    def release(self) -> None:
        with self.lock:
            self.held_from = None

    def hold_drained(self) -> bool:
        """Every request submitted before the hold ended and every cancellation went out."""
        with self.lock:
            line = self.held_from if self.held_from is not None else self.counters["submitted"]
            return not self.cancelled_for and not any(r.seq < line for r in self.requests.values())

    def _handed_out(self, rids: Iterable[str]) -> Iterator[str]:
        """The queued requests that may go to engines now (while held: those submitted before the hold)."""
        if self.held_from is None:
            return iter(rids)
        return (rid for rid in rids if self.requests[rid].seq < self.held_from)

    def flush(self, remove: Callable[[Path, bytes], object]) -> str:
        """Forget every stored block of the served weights (SGLang's /flush_cache, vLLM's /reset_prefix_cache: a
        benchmark's cold start): ``remove(root, fingerprint)`` deletes them from storage and the index starts empty.
        Refused ("" on success, else why) while requests are in flight: they may be loading those blocks."""
        with self.lock:
            if self.requests:
                return f"{len(self.requests)} request(s) in flight; flush when none is"
            if self.fingerprint is None:
                return "no engine has registered the model yet"
            try:
                remove(self._store_root(), self.fingerprint)
            except OSError as e:  # the index stays: the blocks are still there
                return f"the stored blocks could not be removed: {e}"
            self.index = BlockIndex()
            self.counters["cache_flushes"] += 1
            return ""

    def drained(self) -> bool:
        """No request is on an engine and every cancellation went out (engines may still be dropping it)."""
        with self.lock:
            return not self.cancelled_for and not any(r.pe or r.de for r in self.requests.values())

    def resume(
        self, fingerprint: bytes | None = None, version: str = "", loaded: Collection[str] = (), path: str = ""
    ) -> None:
        """End a pause. With the fingerprint of new weights and the engines that ``loaded`` them: any other engine
        is counted gone (it serves other weights), the index starts over (rebuilt from what is stored for the new
        weights) and every queued request is hashed again, so no block of the old weights can hit. ``path``: the
        checkpoint the new weights came from (``stats``' ``weights_path``)."""
        changed = fingerprint is not None and fingerprint != self.fingerprint
        with self.lock:
            if fingerprint is not None:
                self.weights_version, self.weights_path = version, path
                for eid, e in list(self.engines.items()):
                    if e.alive and eid not in loaded:
                        self._engine_gone(eid, "it did not load the new weights")
                    elif eid in loaded:
                        e.info = replace(
                            e.info, fingerprint=fingerprint.hex(), weights_version=version, weights_path=path
                        )
            if changed:
                self.fingerprint, self.index = fingerprint, BlockIndex()
                for r in self.requests.values():  # all queued: a drained cluster holds none on engines
                    r.hashes = self._hash(r.spec.tokens, r.params)
                    hit = self._hit_blocks(r.hashes, r.spec.num_tokens, r.params)
                    self.counters["hit_tokens"] += (hit - r.hit_blocks) * self.block_size
                    r.hit_blocks = hit
            self.paused = False
        if changed:
            self._rebuild_index(fingerprint)

    # --- pulls ----------------------------------------------------------------------------------------------
    def report(self, load: EngineLoad) -> None:
        """A load report outside a pull (engines send one when a request finishes, so stored blocks are indexed
        before the submitter can send the next turn)."""
        with self.lock:
            self._index_reports([load])
            self._absorb(load)

    def pull(self, group_id: str, loads: list[EngineLoad], sender: str = "", unreachable: list[str] = ()) -> PullReply:
        with self.lock:
            self.pulls_by_sender[sender] = self.pulls_by_sender.get(sender, 0) + 1
            for eid in unreachable:  # a group's own members are the first to know one of them is gone
                e = self.engines.get(eid)
                if e is not None and e.alive and e.group == group_id and eid != sender:
                    self._engine_gone(eid, f"unreachable from {sender}")
            rejoin, unknown = [], []
            if loads:
                self._index_reports(loads)
                for load in loads:
                    self._absorb(load)
                for load in loads:
                    if not self._alive(load.engine_id):
                        (rejoin if load.engine_id in self.engines else unknown).append(load.engine_id)
            group, pulling, members = self._view(group_id)
            if not group:
                return PullReply({}, rejoin=rejoin, unknown=unknown)
            cancelled = (
                [w for e in group for w in self.cancelled_for.pop(e.info.engine_id, [])] if self.cancelled_for else []
            )
            self._route()
            if self.sessions.has_due():
                self._order_prefetches()
            ahead = (
                {
                    e.info.engine_id: self.prefetch_for.pop(e.info.engine_id)
                    for e in group
                    if e.info.engine_id in self.prefetch_for
                }
                if self.prefetch_for
                else {}
            )
            if group[0].info.role is Role.DECODE:
                if not self.paused:  # the one gate (and _handed_out's): the prefill queue holds what a DE took
                    self._assign_decode(group_id, group, pulling)
                preempted = (
                    [w for e in group for w in self.preempt_for.pop(e.info.engine_id, [])] if self.preempt_for else []
                )
                return PullReply({}, cancelled, list(members), rejoin, unknown, preempted, ahead)
            return PullReply(
                self._assign_prefill(group, pulling), cancelled, list(members), rejoin, unknown, prefetch=ahead
            )

    def _view(self, group_id: str) -> tuple[list[EngineRecord], set[str], list[list[str]]]:
        """A group's alive engines, their ids and ``members()``, cached until an engine joins or leaves (every
        pull needs them; callers do not modify them)."""
        view = self._views.get(group_id)
        if view is None:
            group = [e for e in self.by_group.get(group_id, ()) if e.alive]
            view = self._views[group_id] = (group, {e.info.engine_id for e in group}, self.members(group_id))
        return view

    def idle_for(self, group_id: str) -> bool:
        """Whether a pull from ``group_id`` that brings no new reports would change nothing: no request is queued
        where the group could take it, and no cancellation waits for its engines. (Only the simulator asks:
        it leaves such pulls out.)"""
        with self.lock:
            group = self.by_group.get(group_id, ())
            if self.global_queue or (
                (self.cancelled_for or self.preempt_for)
                and any(e.info.engine_id in self.cancelled_for or e.info.engine_id in self.preempt_for for e in group)
            ):
                return False
            if group and group[0].info.role is Role.DECODE:
                return not self.private.get(group_id)
            return not self.prefill_queue or self._still_full(self._view(group_id)[0])

    def _index_reports(self, loads: list[EngineLoad]) -> None:
        """Blocks written and evicted since the last reports, one index update per pull (not per engine). Runs
        before the reports' finished requests are announced, so a submitter's next turn finds its blocks."""
        stored = b"".join(load.stored_keys for load in loads if load.stored_keys and self._alive(load.engine_id))
        evicted = b"".join(load.evicted_keys for load in loads if load.evicted_keys and self._alive(load.engine_id))
        if stored:
            self.index.add_packed(stored)
            self.counters["blocks_stored"] += len(stored) // HASH_BYTES
        if evicted:
            self.index.remove_packed(evicted)
            self.counters["blocks_evicted"] += len(evicted) // HASH_BYTES

    def _turn_finished(self, rid: str) -> None:
        s = self.sessions.finished(rid, self.clock())
        if s is not None and s.waiting:
            self._plan_prefetch(s)

    def _alive(self, eid: str) -> bool:
        e = self.engines.get(eid)
        return e is not None and e.alive

    def _absorb(self, load: EngineLoad) -> None:
        e = self.engines.get(load.engine_id)
        if e is None or not e.alive:
            return
        e.load, e.last_seen = load, self.clock()
        if e.outstanding:
            e.outstanding.discard_all(load.request_ids)  # the engine's own numbers now include them
        node = e.info.node_id
        e.read_intervals = load.read_intervals
        if load.storage_read_bytes:  # the windows track every node and prefill engine from registration
            self.storage_read_bytes[node] = self.storage_read_bytes.get(node, 0) + load.storage_read_bytes
            self.read_window.add(node, load.storage_read_bytes)
        if e.info.role is Role.PREFILL and load.prefill_busy_s:
            self.prefill_busy_s[load.engine_id] = self.prefill_busy_s.get(load.engine_id, 0.0) + load.prefill_busy_s
            self.busy_window.add(load.engine_id, load.prefill_busy_s)
            tokens, seconds = e.prefilled  # older reports fade: the rate follows contention and prompt lengths
            e.prefilled = (0.8 * tokens + load.prefill_tokens, 0.8 * seconds + load.prefill_busy_s)
        if load.kv_load_failures or load.kv_corrupt_removed or load.rpc_refused:  # (rare: most reports skip this)
            self.counters["kv_load_failures"] += load.kv_load_failures
            self.counters["kv_corrupt_removed"] += load.kv_corrupt_removed
            self.counters["rpc_refused"] += load.rpc_refused
        if load.traffic:
            self.traffic[load.engine_id] = dict(load.traffic)
        if load.speculative:
            self.speculative[load.engine_id] = dict(load.speculative)
        if load.prefetch:
            self.prefetch_stats[load.engine_id] = dict(load.prefetch)
        for w in load.started:
            rid = self.by_work.get(w)
            if rid is not None:
                self.requests[rid].streaming = True
                if self.requests[rid].de == load.engine_id:
                    e.decoding.add(rid)
        for w in load.finished:
            rid = self.by_work.get(w)
            if rid is not None:
                self.counters["finished"] += 1
                if self.requests[rid].session:
                    self._turn_finished(rid)
                self._drop(rid, SubmitEvent("finished", rid))
        for w, reason in load.failed:
            rid = self.by_work.get(w)
            if rid is None:
                continue
            if e.info.role is Role.DECODE and rid in self.preempting:  # handed back as told: its submitter
                self.counters["preempted"] += 1  # continues it (dualpath.client)
                self._drop(rid, SubmitEvent("failed", rid, error=reason, engine_lost=True, preempted=True))
            elif e.info.role is Role.DECODE and self.requests[rid].streaming:
                self._fail(rid, reason)
            else:
                self._retry(rid, reason)
        if load.leaving:  # after the rest of its last report (the blocks it stored are indexed first)
            self._engine_gone(load.engine_id, "it is stopping")

    def _state(self, e: EngineRecord) -> EngineState:
        load, out, info = e.load, e.outstanding, e.info
        return EngineState(  # positional (every pull builds its group's): engine, node, group, seq, tok, free, betas
            info.engine_id,
            info.node_id,
            e.group,
            (load.seq if load else 0) + len(out),
            (load.tok if load else 0) + out.tokens,
            (load.free_tokens if load else info.capacity_tokens) - out.reserve,
            info.beta_tokens,
            e.measured_beta(),
        )

    def _group_totals(self) -> dict[str, int]:
        """Each decode group's tokens (engines' load plus its private queue), recomputed at most every 50 ms: at
        a thousand engines a full pass per pull would dominate the scheduler's time."""
        now = self.clock()
        if self._totals is None or now - self._totals_at > 0.05:
            totals: dict[str, int] = {}
            for g, members in self._decode_groups():
                tok = 0
                for e in members:  # the tok of _state(e), without building the state
                    load = e.load
                    tok += (load.tok if load else 0) + e.outstanding.tokens
                totals[g] = tok + (self.private[g].weight if g in self.private else 0)
            self._totals, self._totals_at = totals, now
        return self._totals

    def _decode_groups(self) -> list[tuple[str, list[EngineRecord]]]:
        """``alive(DECODE)`` by group, groups in order of first appearance; rebuilt when that list is (it is
        replaced, not changed, when an engine joins or leaves)."""
        alive = self.alive(Role.DECODE)
        cached = self._decode_by_group
        if cached is None or cached[0] is not alive:
            groups: dict[str, list[EngineRecord]] = {}
            for e in alive:
                groups.setdefault(e.group, []).append(e)
            cached = self._decode_by_group = (alive, list(groups.items()))
        return cached[1]

    def _route(self) -> None:
        """Phase 1: drain the global queue into decode groups' private queues."""
        if not self.global_queue:
            return
        totals = self._group_totals()
        while self.global_queue and totals:
            rid = self.global_queue.first()
            r = self.requests[rid]
            g = self.policy.route_decode_group(self.queued(r), totals)
            if g is None:
                break
            self.global_queue.popleft()
            r.group = g
            private = self.private.get(g)
            if private is None:
                private = self.private[g] = Fifo()
            private.append(rid, r.spec.num_tokens, r.rank)
            totals[g] += r.spec.num_tokens

    def _assign_decode(self, group_id: str, group: list[EngineRecord], pulling: set[str]) -> None:
        """Phase 2 for a pulling decode group (``group``: its alive engines, ``pulling``: their ids)."""
        private = self.private.get(group_id)
        if not private:  # nothing to place: skip building the group's states
            return
        waiting = Lazy(self.queued(self.requests[rid]) for rid in self._handed_out(private))
        states = [self._state(e) for e in group]  # phase 1 chose the group
        for work_id, eid in list(self.policy.assign_decode(waiting, states, pulling)):  # done reading private
            rid = self.by_work[work_id]
            r = self.requests[rid]
            r.de = eid
            if r.session:
                self.sessions.placed(rid, de=eid)
                self.counters["session_turns_kept_decode"] += bool(r.affinity and r.affinity.de == eid)
            n = r.spec.num_tokens
            self.engines[eid].outstanding.add(work_id, n, self._decode_tokens(r))
            private.remove(rid)
            r.group = None
            self.prefill_queue.append(rid, rank=r.rank)
        if private and self.config.scheduling_policy == "priority" and self.config.priority_preemption:
            self._preempt_for(private, states, pulling)

    def _preempt_for(self, private: Fifo, states: list[EngineState], pulling: set[str]) -> None:
        """Priority scheduling: when the first request of a decode group's queue fits none of its engines
        (``states``, after this pull's placements), replies less urgent than it end on one engine to make room
        (``policy.preemption``). The engine stores what they generated and hands them back; their submitters
        continue them from there (``dualpath.client``), queued first of their priority. One preemption at a time
        per group: the next waits until the engine has reported the replies it was told to hand back ended."""
        head = next(iter(self._handed_out(private)), None)
        if head is None or any(self.requests[rid].de in pulling for rid in self.preempting):
            return
        r = self.requests[head]
        running = {
            s.engine_id: [
                Running(x.work_id, x.rank, x.seq, self._decode_tokens(x))
                for x in map(self.requests.__getitem__, self.engines[s.engine_id].decoding)
                if x.rank > r.rank
            ]  # (only these may be ended)
            for s in states
            if s.engine_id in pulling
        }
        free = {s.engine_id: s.free_tokens for s in states if s.engine_id in pulling}
        eid, victims = preemption(self._decode_tokens(r), r.rank, free, running)
        for w in victims:
            self.preempting.add(self.by_work[w])
            self.preempt_for.setdefault(eid, []).append(w)
        if victims:
            log.info("preempting %d request(s) on %s for %s (priority %d)", len(victims), eid, head, r.rank)

    def _node_states(self) -> "_Nodes":
        return _Nodes(self)

    @staticmethod
    def _prefill_key(group: list[EngineRecord]) -> tuple:
        """All that a per-group policy's view of a prefill group is built from (``_state``): the engines, their
        descriptions, last reports, outstanding work and recent prefill rates."""
        return tuple(
            (e, e.info, e.load, len(e.outstanding), e.outstanding.tokens, e.outstanding.reserve, e.prefilled)
            for e in group
        )

    def _still_full(self, group: list[EngineRecord]) -> bool:
        """The group could take no prefill at its last pull (``Policy.takes_no_prefill``), and nothing about its
        engines changed since: placement would find the same."""
        full = self._full_prefill.get(group[0].group) if group else None
        return full is not None and full == self._prefill_key(group)

    def _assign_prefill(self, group: list[EngineRecord], pulling: set[str]) -> dict[str, list[Assignment]]:
        """Prefill engines and read paths for the queue's head (``group``: the pulling group's alive engines)."""
        if not self.prefill_queue:
            return {}
        # policies with a per-group view (the paper's) see only the pulling group: pulls stay O(group)
        per_group = not getattr(self.policy, "global_view", True)
        if per_group and self._still_full(group):  # (in a saturated cluster, most prefill pulls)
            return {}
        candidates = group if per_group else self.alive(Role.PREFILL)
        pe_nodes = {e.info.engine_id: e.info.node_id for e in candidates}
        waiting = Lazy(
            itertools.islice(
                (
                    self.queued(self.requests[rid])
                    for rid in self.prefill_queue
                    if self.engines[self.requests[rid].de].alive
                ),
                self.config.max_assignments_per_pull,
            )
        )
        out: dict[str, list[Assignment]] = {}
        states = [self._state(e) for e in candidates]
        decisions = list(
            self.policy.assign_prefill(waiting, states, pulling, self._node_states(), pe_nodes, self.block_size)
        )  # then remove
        if per_group and not decisions and self.policy.takes_no_prefill(states):
            self._full_prefill[group[0].group] = self._prefill_key(group)
        for d in decisions:
            rid = self.by_work[d.request_id]
            r = self.requests[rid]
            if 0 <= d.path.load_blocks < r.hit_blocks:  # loading the rest would take longer than computing it
                self.counters["recomputed_hit_tokens"] += (r.hit_blocks - d.path.load_blocks) * self.block_size
                r.hit_blocks = d.path.load_blocks
            hit = r.hit_blocks * self.block_size
            r.pe, r.path = d.engine_id, ("split" if d.path.pe_blocks > 0 else d.path.path.value)
            self.counters[f"path_{r.path}"] += 1
            prefetched = self._turn_placed(r)
            self.engines[d.engine_id].outstanding.add(d.request_id, r.spec.num_tokens - hit, 0)
            self.prefill_queue.remove(rid)
            de = self.engines[r.de].info
            out.setdefault(d.engine_id, []).append(
                Assignment(
                    d.request_id,
                    r.spec.tokens,
                    dict(r.spec.sampling),
                    r.hashes[: r.hit_blocks * HASH_BYTES],
                    d.path.path,
                    r.mode is not Mode.BASIC,
                    de,
                    d.path.pe_blocks,
                )
            )
            r.notify(
                SubmitEvent(
                    "assigned",
                    rid,
                    num_hit_tokens=hit,
                    decode_engine=de.engine_id,
                    decode_address=de.control_address,
                    path=r.path,
                    work_id=d.request_id,
                    prefetched=prefetched,
                )
            )
        return out

    def _turn_placed(self, r: RequestRecord) -> bool:
        """Record a session turn's prefill engine; whether it reads a prefetch of its KV."""
        if not r.session:
            return False
        self.sessions.placed(r.spec.request_id, pe=r.pe)
        a = r.affinity
        used = bool(a and a.prefetch_blocks and a.prefetch_engine == (r.pe if r.path == "pe" else r.de))
        self.counters["session_turns_prefetched"] += used
        return used

    def node_state(self, node: str) -> NodeState:
        n = NodeState(recent_read=self.read_window.sum(node))
        for e in self.by_node.get(node, ()):
            if e.alive:
                n.read_q += e.load.read_q_tokens if e.load else 0
                n.alpha = max(n.alpha, e.info.alpha_tokens)
        n.alpha = self.live_alpha(node) or n.alpha
        return n

    def live_alpha(self, node: str) -> int:
        """The node's alpha as it read in the last 10 s while blocks waited (0: too little to tell; the engines'
        start-up probe or pinned value stands). Recomputed at most every 0.5 s: pulls ask for nodes far more often
        than reads change the answer."""
        now = self.clock()
        at, alpha = self._alphas.get(node, (-1.0, 0))
        if at < 0 or now - at > 0.5:
            alpha = measured_alpha([i for e in self.by_node.get(node, ()) if e.alive for i in e.read_intervals])
            self._alphas[node] = (now, alpha)
        return alpha

    # --- metrics --------------------------------------------------------------------------------------------
    def balance(self) -> dict:
        """max/avg over the sliding window: storage reads across nodes, attention time across each PE group."""
        reads = self.read_window.sums()
        busy = self.busy_window.sums()
        groups: dict[str, list[float]] = {}
        for eid, s in busy.items():
            e = self.engines.get(eid)
            if e is not None:
                groups.setdefault(e.group, []).append(s)
        return {
            "storage_read_max_over_avg": max_over_avg(reads.values()),
            "storage_read_window_bytes": reads,
            "prefill_busy_max_over_avg": {g: max_over_avg(v) for g, v in groups.items()},
        }

    def stats(self) -> dict:
        with self.lock:
            nodes = {n: self.node_state(n) for n in self.by_node}
            return {
                **self.counters,
                "fingerprint": self.fingerprint.hex() if self.fingerprint else "",
                "block_size": self.block_size,
                "weights_version": self.weights_version,
                "weights_path": self.weights_path,
                "paused": self.paused,
                "held": self.held,
                "scheduling_policy": self.config.scheduling_policy,
                "lora_adapters": list(self.adapters),  # loaded at runtime (those engines started with: their own)
                "global_queue": len(self.global_queue),
                "decode_queue": sum(len(q) for q in self.private.values()),
                "prefill_queue": len(self.prefill_queue),
                "in_flight": len(self.requests),
                "waiting_by_priority": self._waiting_by_priority(),
                "index_blocks": len(self.index),
                "engines_alive": sum(e.alive for e in self.engines.values()),
                "engines_alive_by_role": {r.value: len(ids) for r, ids in self.alive_ids.items()},
                "missing": self.missing(),  # what keeps it from serving, in words
                "node_read_q_tokens": {n: s.read_q for n, s in nodes.items()},
                "node_alpha_tokens": {n: s.alpha for n, s in nodes.items()},
                "node_alpha_measured": {n: self.live_alpha(n) > 0 for n in nodes},
                "storage_read_bytes": dict(self.storage_read_bytes),
                "prefill_busy_s": dict(self.prefill_busy_s),
                "pulls_by_sender": dict(self.pulls_by_sender),
                "traffic_bytes": {e: dict(t) for e, t in self.traffic.items()},
                "speculative": {e: dict(t) for e, t in self.speculative.items()},
                **self.sessions.stats(),
                "prefetch": self._prefetch_totals(),
                "engines": {eid: self._engine_view(e) for eid, e in self.engines.items() if e.alive},
                **self.balance(),
            }

    def _prefetch_totals(self) -> dict[str, int]:
        """The engines' prefetchers summed: blocks loaded, used (by a turn), wasted (freed unused), skipped (no room,
        or missing), held now, and the bytes those are."""
        out = dict.fromkeys(("ordered", "loaded", "used", "wasted", "skipped", "hit_reads", "held"), 0)
        for eid, st in self.prefetch_stats.items():
            for k in out:
                out[k] += st.get(k, 0)
            for k in ("loaded", "used", "wasted", "hit_reads", "held"):
                out[f"{k}_bytes"] = out.get(f"{k}_bytes", 0) + st.get(k, 0) * st.get("block_bytes", 0)
        return out

    def _waiting_by_priority(self) -> dict[str, int]:
        """Requests in the scheduler's queues (not yet on engines) by priority (text keys: the stats are JSON)."""
        out: dict[str, int] = {}
        for q in (self.global_queue, self.prefill_queue, *self.private.values()):
            for rank, n in q.by_rank().items():
                out[str(rank)] = out.get(str(rank), 0) + n
        return out

    @staticmethod
    def _engine_view(e: EngineRecord) -> dict:
        """An engine's last report: requests held, their tokens, free KV tokens (a decode engine's device cache,
        a prefill engine's workspace) and its capacity, the KV store's stored bytes and cap."""
        load = e.load
        return {
            "role": e.info.role.value,
            "node": e.info.node_id,
            "group": e.group,
            "dp_balance": load.dp_balance if load else 0.0,
            "requests": load.seq if load else 0,
            "tokens": load.tok if load else 0,
            "capacity_tokens": e.info.capacity_tokens,
            "free_tokens": load.free_tokens if load else e.info.capacity_tokens,
            "measured_beta": e.measured_beta(),
            "storage_used_bytes": load.storage_used_bytes if load else 0,
            "storage_capacity_bytes": load.storage_capacity_bytes if load else 0,
        }


class _Nodes(dict):
    """Node states computed when a policy first asks for a node (a pull touches few of them)."""

    def __init__(self, core: SchedulerCore):
        super().__init__()
        self.core = core

    def __missing__(self, node: str) -> NodeState:
        n = self[node] = self.core.node_state(node)
        return n

    def get(self, node, default=None):
        return self[node]

    def setdefault(self, node, default=None):
        return self[node]


def _write_pin(model_dir: Path, name: str, keys: list, until: float) -> None:
    try:
        write_pin(model_dir, name, keys, until)
    except OSError as e:  # the session's KV is then evicted as any other's
        log.warning("cannot pin session %s's blocks: %s", name[:12], e)
