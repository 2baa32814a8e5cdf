"""What prefill and decode engines share: the model, the KV geometry and fingerprint, the DRAM buffer, storage,
the transport and traffic manager, the gRPC control surface, registration and the pull loop.

Engines of one node and role form a group (``--group-id``); its leader — the member with the smallest id that
answers — is the only one that pulls: every ``pull_interval_s`` it sends the group's load reports and hands the
work it gets to the members (``Assign``); members push their reports to it (``PushLoad``). If the leader stops
answering, the next member takes over. Facts the scheduler must not miss (a request started, finished or failed)
are also sent straight to the scheduler as they happen (``Report``); everything waits in an outbox until a
report carrying it was delivered.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import uuid

import torch

from dualpath.core.config import EngineProcessConfig
from dualpath.core.errors import CheckpointError, DualPathError, EngineBusyError, RankLostError
from dualpath.core.geometry import KVGeometry, model_fingerprint
from dualpath.core.messages import (
    Ack,
    AdapterLoad,
    AdapterLoadReply,
    Assignment,
    EngineInfo,
    EngineLoad,
    PullReply,
    PullRequest,
    RequestRef,
    Role,
    WeightUpdate,
    WeightUpdateReply,
    pack_keys,
    unpack_keys,
)
from dualpath.core.rpc import ENGINE_METHODS, SCHEDULER_METHODS, Client, RpcError, ThreadedServer
from dualpath.core.sampling_params import SamplingParams
from dualpath.core.tokenizer import Tokenizer
from dualpath.engines.guided import GuideSource
from dualpath.engines.kv_events import open_kv_events
from dualpath.engines.models import open_checkpoint, open_update
from dualpath.engines.parallel.dp import attach, join_group
from dualpath.engines.parallel.ranks import RankSpec, check_parallel, start_ranks
from dualpath.engines.parallel.steps import attach_buffer, load_adapter, update_weights
from dualpath.kernels.attention import check_cache_dtype
from dualpath.kernels.kv_move import cache_dtype
from dualpath.traffic.buffer import BufferPool
from dualpath.traffic.manager import TrafficManager
from dualpath.traffic.prefetch import Prefetcher
from dualpath.traffic.memory import HostMemory
from dualpath.traffic.storage import ReadAccounting, make_storage
from dualpath.traffic.transport import make_transport

log = logging.getLogger(__name__)
REJOIN = "rejoin: the scheduler counts this engine as gone"  # PushLoad's refusal that makes a member register again
REGISTER = "register: the scheduler does not know this engine"  # the same, keeping its work (a restarted scheduler)


class Outbox:
    """Report fields that accumulate between reports and are cleared only once a report was delivered."""

    FIELDS = ("started", "finished", "failed", "stored_keys", "evicted_keys")

    def __init__(self):
        self._lock = threading.Lock()
        self._items = {f: [] for f in self.FIELDS}

    def add(self, field: str, *items) -> None:
        with self._lock:
            self._items[field].extend(items)

    def take(self) -> dict[str, list]:
        with self._lock:
            out, self._items = self._items, {f: [] for f in self.FIELDS}
        return out

    def put_back(self, items: dict[str, list]) -> None:
        with self._lock:
            for f, v in items.items():
                self._items[f][:0] = v


class Engine:
    role: Role

    def __init__(self, cfg: EngineProcessConfig):
        self.cfg = cfg
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        self.engine_id = cfg.engine_id or f"{cfg.role}-{socket.gethostname()}-{os.getpid()}"
        self.node_id = cfg.node_id or self.engine_id
        self.device = torch.device(cfg.engine.device)
        self.dtype = getattr(torch, cfg.engine.dtype)
        self.stopping = threading.Event()
        self.exit_code = 0  # 1: a rank of this engine died (its supervisor restarts the whole engine)
        ckpt = open_checkpoint(cfg.model, cfg.engine.weight_quant)
        self.model_config = ckpt.config
        check_parallel(ckpt.config, cfg.engine)
        # this process is rank 0; under tensor parallelism the others follow its steps (``dualpath.engines.parallel``)
        self.ranks = start_ranks(RankSpec(cfg.model, cfg.engine, cfg.host, cfg.torch_threads), self._rank_lost)
        self.model = self.ranks.state.model
        self.dp = None  # data-parallel attention: this engine's group, whose MoE layers it runs in step with
        if cfg.engine.parallel.data_parallel_size > 1:
            p = cfg.engine.parallel
            self.dp = attach(self.model, join_group(p, cfg.engine.device), p.moe_dispatch, self._rank_lost)
            log.info(
                "engine %s is data-parallel rank %d of %d (group at %s)",
                self.engine_id,
                p.data_parallel_rank,
                p.data_parallel_size,
                p.data_parallel_master,
            )
        self.runtime_adapters: list[str] = []  # LoRA adapters loaded since the start (a new scheduler learns them)
        self.adapter_names: dict[str, str] = {}  # adapter identity -> the name requests give it (KV events)
        for m in cfg.engine.lora_modules:
            self._load_adapter(m.path, m.name)
        self.max_model_len = ckpt.config.context_limit(cfg.max_model_len)
        self.model_dir = ckpt.path
        self._tokenizer: Tokenizer | None = None
        self._tokenizer_error: Exception | None = None  # a failed load is not retried
        self._tokenizer_lock = threading.Lock()
        self.guides = GuideSource(self.tokenizer, ckpt.config.vocab_size, ckpt.config.eos_token_ids)
        bs = cfg.engine.cache.block_size
        self.geometry = KVGeometry.for_model(ckpt.config, cfg.engine.kv_dtype, bs)
        check_cache_dtype(self.model.kernels, self.device, cache_dtype(self.geometry))
        self.fingerprint = model_fingerprint(
            ckpt.config, cfg.engine.dtype, bs, ckpt.weights_digest, cfg.engine.kv_dtype
        )
        self.transport = make_transport(cfg.transport, self.engine_id)
        slots = max(1, cfg.buffer_bytes // self.geometry.full_block_bytes)
        self.buffer_memory = self._host_memory(slots * self.geometry.full_block_bytes)
        self.buffer_region = self.transport.register(self.buffer_memory).region_id
        self.ranks.state.host["buffer"] = self.buffer_memory.tensor
        if self.ranks.size > 1:
            self.ranks.run(attach_buffer, self.buffer_memory.name, self.buffer_memory.nbytes)
        self.buffer = BufferPool(self.geometry, slots, self.buffer_memory)
        self.accounting = ReadAccounting(cfg.storage.read_bandwidth_bps, self.geometry.full_block_bytes / bs)
        self.kv_events = open_kv_events(cfg.kv_events, bs, cfg.engine.parallel.data_parallel_rank, self.adapter_names)
        self.storage = self._open_storage(self.fingerprint)
        self.traffic = TrafficManager(self.geometry, self.storage, self.buffer, self.transport, self.buffer_region)
        if cfg.prefetch_share > 0:
            self.traffic.prefetcher = Prefetcher(
                self.buffer, lambda: self.traffic.storage, self.accounting, cfg.prefetch_share
            )
        self.updating = False  # loading new weights: no work is admitted (set and read under admission_lock)
        self.weights = ("", "")  # (checkpoint, version) an update loaded; ("", ""): the ones it started with
        self.outbox = Outbox()
        self.members: list[list[str]] = []  # the group: [engine id, control address]
        self.member_loads: list[EngineLoad] = []  # pushed by members, waiting for the leader's next pull
        self._peers: dict[str, Client] = {}
        self.unreachable: set[str] = set()  # members (or the leader) that stopped answering us
        self.registered = False  # the scheduler has taken this engine (a stop then tells it: ``leave``)
        self.leaving = False  # stopping: its reports say so
        self._rejoin_members: dict[str, bool] = {}  # members that must register again -> keep their work (leader)
        self._report_event = threading.Event()
        self._lock = threading.Lock()
        self._read_bytes_reported = self._failures_reported = self._removed_reported = self._refused_reported = 0
        self._busy_reported = 0.0
        self.busy_s = 0.0  # prefill attention seconds (prefill engines)
        self.busy_tokens = 0  # the new tokens those seconds computed
        self._busy_tokens_reported = 0
        self.kv_load_failures = 0  # stored blocks that failed to load and were recomputed
        self.server = ThreadedServer("Engine")
        self.setup()
        self.alpha = self.alpha_tokens()
        self.rpc_refused = 0  # calls without the cluster's credentials (counted by the RPC server's thread)
        self.port = self.server.start(ENGINE_METHODS, self, f"{cfg.host}:{cfg.port}", on_refused=self._refused)
        self.scheduler = Client("Scheduler", SCHEDULER_METHODS, cfg.scheduler)

    def _refused(self) -> None:
        self.rpc_refused += 1

    def _host_memory(self, nbytes: int) -> HostMemory:
        """Host memory the transport addresses; shared by name when the engine has other ranks, which map it."""
        if self.ranks.size > 1:
            return HostMemory(nbytes, shared=True, pin=True)
        return self.transport.allocate(nbytes)

    def _dp_balance(self) -> float:
        """``EngineLoad.dp_balance``: this engine's view of its data-parallel group's balance (0: none)."""
        return (self.dp.stats()["attention_max_over_avg"] or 0.0) if self.dp is not None else 0.0

    def _rank_lost(self, why: str) -> None:
        """A rank died (``dualpath.engines.parallel.ranks``), or an engine of its data-parallel group
        (``dualpath.engines.parallel.dp``): the engine stops, telling the scheduler it leaves, and exits non-zero so that
        its supervisor starts it again, whole."""
        self.exit_code = 1
        self.stopping.set()

    # --- role hooks -----------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Allocate role-specific memory (paged cache, workspace) and register it."""

    def capacity_tokens(self) -> int:
        raise NotImplementedError

    def held(self) -> dict[str, int]:
        """Work ids the engine holds -> their tokens (seq and tok of the load report)."""
        raise NotImplementedError

    def free_tokens(self) -> int:
        return self.capacity_tokens()

    def spec_stats(self) -> dict[str, int]:
        """Speculative decoding's cumulative counts (decode engines)."""
        return {}

    def admission_lock(self) -> threading.Lock | threading.RLock | threading.Condition:
        """The lock under which work becomes held (``held`` sees it), so an update sees all work or none."""
        raise NotImplementedError

    def on_assignment(self, a: Assignment) -> None:
        raise DualPathError(f"{self.role.value} engines take no assignments")

    def on_cancel(self, work_id: str, reason: str) -> None:
        """Drop everything held for ``work_id``."""

    def on_preempt(self, work_id: str) -> None:
        """Hand ``work_id`` back to its submitter to go on later (decode engines; the scheduler names only theirs)."""

    def loop(self) -> None:
        """The engine's main loop; returns when ``stopping`` is set."""
        self.stopping.wait()

    def tokenizer(self) -> Tokenizer:
        """The checkpoint's tokenizer, loaded on first use (engines that never need one pay nothing)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                if self._tokenizer_error is not None:
                    raise self._tokenizer_error
                try:
                    self._tokenizer = Tokenizer(self.model_dir)
                except Exception as e:
                    self._tokenizer_error = e
                    raise
            return self._tokenizer

    def guides_ready(self, params: SamplingParams, then, stop_strings: bool = False) -> bool:
        """Whether ``params``' guide (and, with ``stop_strings``, the tokenizer its stop strings are matched with)
        can be had at once. If not (the first structured request: the vocabulary's ~0.4 s pass; the first with
        stop strings: the tokenizer's load), that runs on a helper thread, which calls ``then`` after it, and False
        is returned: the caller stops and ``then`` redoes its work, so an engine loop never stalls the requests it
        runs."""
        want_tokenizer = (
            stop_strings and bool(params.stop) and self._tokenizer is None and self._tokenizer_error is None
        )
        if self.guides.ready(params) and not want_tokenizer:
            return True

        def warm():
            try:
                self.guides.warm() if params.structured else self.tokenizer()
            except Exception as e:  # noqa: BLE001 - logged; guide_for raises it again, failing the request
                log.warning("loading the tokenizer (or indexing its vocabulary) failed: %s", e)
            then()

        threading.Thread(target=warm, daemon=True, name="guides-warm").start()
        return False

    # --- registration and reports ---------------------------------------------------------------------------
    def beta_tokens(self) -> int:
        return 0

    def alpha_tokens(self) -> int:
        """Tokens this node reads from storage in 3 s: pinned, else from the configured cap, else probed. Unless
        pinned, the scheduler replaces it with the rate this node reads at while storage is its bottleneck
        (``read_intervals``)."""
        if self.cfg.alpha_tokens:
            return self.cfg.alpha_tokens
        bps = self.cfg.storage.read_bandwidth_bps
        if not bps:
            bps = self._measure_read_bps()
            log.info(
                "storage reads measured at %.0f MB/s at start (the scheduler goes by the rate measured once "
                "blocks wait to be read for a second; --alpha-tokens pins it)",
                bps / 1e6,
            )
        return int(bps * 3 / (self.geometry.full_block_bytes / self.geometry.block_size))

    def _measure_read_bps(self, nbytes: int = 32 << 20, max_blocks: int = 64) -> float:
        """Write and read back up to ``nbytes`` of probe blocks (at most ``max_blocks``: a small model's blocks are
        KBs, and thousands of files would cost every engine start seconds while measuring little more) under their
        own fingerprint (never a model's), then remove them. The blocks are dropped from the page cache between
        the write and the read: a read of what was just written would measure memory, not the disk."""
        from dualpath.traffic.storage import make_storage

        g = self.geometry
        n = max(1, min(nbytes // g.full_block_bytes, max_blocks))
        probe = make_storage(self.cfg.storage, g, b"\xff" * 8 + os.urandom(8))
        keys = [i.to_bytes(16, "little") for i in range(n)]
        block = torch.randint(0, 256, (g.full_block_bytes,), dtype=torch.uint8)
        blocks = [block.clone() for _ in keys]  # each read lands in its own
        try:
            probe.write(keys, blocks).result()
            probe.drop_cached(keys)
            t = time.perf_counter()
            probe.read(keys, blocks).result()
            return n * g.full_block_bytes / max(time.perf_counter() - t, 1e-6)
        finally:
            probe.destroy()

    def info(self) -> EngineInfo:
        return EngineInfo(
            self.engine_id,
            self.role,
            self.node_id,
            f"{self.cfg.host}:{self.port}",
            self.cfg.transport.name,
            self.transport.address(),
            [r.to_dict() for r in self.transport.regions()],
            self.buffer_region,
            self.buffer.num_slots,
            self.geometry.block_size,
            self.geometry.num_layers,
            self.fingerprint.hex(),
            self.capacity_tokens(),
            self.cfg.model,
            self.max_model_len,
            list(self.model_config.eos_token_ids),
            self.cfg.group_id,
            self.alpha,
            self.beta_tokens(),
            weights_path=self.weights[0],
            weights_version=self.weights[1],
            adapters=list(self.runtime_adapters),
        )

    def register(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                ack = self.scheduler.call("Register", self.info(), timeout=10)
                break
            except RpcError as e:
                if time.monotonic() > deadline:
                    raise DualPathError(f"cannot reach the scheduler at {self.cfg.scheduler}: {e}") from None
                time.sleep(0.2)
        if not ack.ok:
            raise DualPathError(f"the scheduler refused engine {self.engine_id}: {ack.error}")
        started_with = {m.path for m in self.cfg.engine.lora_modules}
        for path in ack.adapters:  # loaded into the cluster at runtime: this engine must serve them too
            if path not in started_with and path not in self.runtime_adapters:
                self._load_adapter(path, runtime=True)
        self.members = ack.members
        self.registered = True

    def _load_adapter(self, path: str, name: str = "", runtime: bool = False) -> str:
        digest = self.ranks.run(load_adapter, path)
        if name:
            self.adapter_names[digest] = name
        if runtime and path not in self.runtime_adapters:
            self.runtime_adapters.append(path)
        log.info("LoRA adapter %s (%s) loaded as %s", name or path, path, digest[:12])
        return digest

    def load(self) -> tuple[EngineLoad, dict]:
        held = self.held()
        snap = self.accounting.snapshot()
        items = self.outbox.take()
        read_delta = snap.completed_bytes - self._read_bytes_reported
        busy_delta = self.busy_s - self._busy_reported
        busy_tokens = self.busy_tokens - self._busy_tokens_reported
        fail_delta = self.kv_load_failures - self._failures_reported
        stored = self.storage.usage()
        removed = stored.get("corrupt_removed", 0)
        load = EngineLoad(
            self.engine_id,
            len(held),
            sum(held.values()),
            snap.queue_tokens,
            self.free_tokens(),
            request_ids=list(held),
            started=items["started"],
            finished=items["finished"],
            failed=items["failed"],
            stored_keys=pack_keys(items["stored_keys"]),
            evicted_keys=pack_keys(items["evicted_keys"]),
            prefill_busy_s=busy_delta,
            prefill_tokens=busy_tokens,
            dp_balance=self._dp_balance(),
            storage_read_bytes=read_delta,
            kv_load_failures=fail_delta,
            kv_corrupt_removed=removed - self._removed_reported,
            rpc_refused=self.rpc_refused - self._refused_reported,
            read_intervals=[] if self.cfg.alpha_tokens else self.accounting.drain_intervals(),
            traffic=self.traffic.snapshot(),
            speculative=self.spec_stats(),
            prefetch=self.traffic.prefetcher.stats() if self.traffic.prefetcher else {},
            storage_used_bytes=stored["used_bytes"],
            storage_capacity_bytes=stored["capacity_bytes"],
            leaving=self.leaving,
        )
        return load, {
            "items": items,
            "read": snap.completed_bytes,
            "busy": self.busy_s,
            "busy_tokens": self.busy_tokens,
            "failures": self.kv_load_failures,
            "removed": removed,
            "refused": self.rpc_refused,
        }

    def _delivered(self, marks: dict) -> None:
        self._read_bytes_reported, self._busy_reported = marks["read"], marks["busy"]
        self._busy_tokens_reported = marks["busy_tokens"]
        self._failures_reported = marks["failures"]
        self._removed_reported = marks["removed"]
        self._refused_reported = marks["refused"]

    def report_now(self, timeout: float = 10.0) -> None:
        """Send a load report straight to the scheduler (events that must not wait for the next pull)."""
        with self._lock:  # one report at a time keeps the delivered marks in order
            load, marks = self.load()
            try:
                self.scheduler.call("Report", load, timeout=timeout)
                self._delivered(marks)
            except RpcError as e:
                self.outbox.put_back(marks["items"])
                log.warning("report failed: %s", e)

    def report_soon(self) -> None:
        self._report_event.set()

    def _reporter(self) -> None:
        while not self.stopping.is_set():
            if self._report_event.wait(0.5):
                self._report_event.clear()
                self.report_now()

    # --- the group ------------------------------------------------------------------------------------------
    @property
    def group(self) -> str:
        return self.cfg.group_id or self.engine_id

    def leader(self) -> str:
        return min([m[0] for m in self.members] + [self.engine_id])

    def _peer(self, address: str) -> Client:
        if address not in self._peers:
            self._peers[address] = Client("Engine", ENGINE_METHODS, address)
        return self._peers[address]

    def pull_loop(self) -> None:
        while not self.stopping.is_set():
            if self.leader() == self.engine_id:
                self._pull()
            else:
                self._push()
            self.stopping.wait(self.cfg.pull_interval_s)

    def _pull(self) -> None:
        with self._lock:
            load, marks = self.load()
            members, self.member_loads = self.member_loads, []
            gone = sorted(self.unreachable)
            try:
                reply = self.scheduler.exchange(
                    "PullStream", PullRequest(self.group, [load, *members], self.engine_id, gone), 10, unary="Pull"
                )
                self._delivered(marks)
                self.unreachable.difference_update(gone)
            except RpcError as e:
                self.outbox.put_back(marks["items"])
                self.member_loads[:0] = members
                log.warning("pull failed: %s", e)
                self.stopping.wait(0.5)
                return
        if reply.members:
            self.members = reply.members
        self._rejoin_members.update({m: False for m in reply.rejoin if m != self.engine_id})
        self._rejoin_members.update({m: True for m in reply.unknown if m != self.engine_id})
        if self.engine_id in reply.rejoin or self.engine_id in reply.unknown:
            self._rejoin(keep_work=self.engine_id in reply.unknown)
        self._apply(reply)
        addresses = dict((m[0], m[1]) for m in self.members)
        for eid in {**reply.assignments, **reply.prefetch}:
            if eid != self.engine_id:
                work, ahead = reply.assignments.get(eid, []), reply.prefetch.get(eid, [])
                self._forward(
                    eid,
                    addresses.get(eid),
                    PullReply(
                        {eid: work} if work else {}, reply.cancelled, preempted=reply.preempted, prefetch={eid: ahead}
                    ),
                )
        if reply.cancelled or reply.preempted:  # work ids: each member acts on its own
            for eid, addr in addresses.items():
                if eid != self.engine_id and eid not in reply.assignments and eid not in reply.prefetch:
                    self._forward(eid, addr, PullReply({}, reply.cancelled, preempted=reply.preempted))

    def _forward(self, eid: str, address: str | None, reply: PullReply) -> None:
        """Hand a member its work; if it cannot take it, report the work failed so the scheduler retries it."""
        try:
            if address is None:
                raise RpcError(f"{eid} is not in the group")
            self._peer(address).call("Assign", reply, timeout=10)
        except RpcError as e:
            self.unreachable.add(eid)  # the scheduler learns it at our next pull
            self.members = [m for m in self.members if m[0] != eid]
            for a in reply.assignments.get(eid, []):
                self.outbox.add("failed", [a.request_id, f"group member {eid} unreachable: {e}"])

    def _push(self) -> None:
        leader = self.leader()
        address = dict((m[0], m[1]) for m in self.members).get(leader)
        with self._lock:
            load, marks = self.load()
            try:
                if address is None:
                    raise RpcError(f"leader {leader} unknown")
                ack = self._peer(address).call("PushLoad", load, timeout=5)
            except RpcError as e:
                self.outbox.put_back(marks["items"])
                log.warning("group leader %s unreachable (%s); the next member leads", leader, e)
                self.members = [m for m in self.members if m[0] != leader]
                self.unreachable.add(leader)
                return
            if ack.ok:
                self._delivered(marks)
            else:  # refused: the report goes again after registering
                self.outbox.put_back(marks["items"])
        if ack.error in (REJOIN, REGISTER):
            self._rejoin(keep_work=ack.error == REGISTER)

    def PushLoad(self, load: EngineLoad, ctx) -> Ack:
        """A member's load for the leader's next pull; a member the scheduler no longer counts is told to rejoin."""
        with self._lock:
            keep = self._rejoin_members.pop(load.engine_id, None)
            if keep is not None:
                return Ack(False, REGISTER if keep else REJOIN)
            self.member_loads.append(load)
        return Ack()

    def _rejoin(self, keep_work: bool) -> None:
        """Register again, rather than idle forever. The scheduler either declared this engine gone (silent past
        its heartbeat timeout) and already re-queued or failed its work, which is dropped first; or it never knew
        this engine (it restarted: ``keep_work``), and the work goes on, its submitters streaming it from here."""
        if self.stopping.is_set():  # a stopping engine told it it is leaving: it does not come back
            return
        held = [] if keep_work else list(self.held())
        log.warning(
            "the scheduler %s engine %s: %s and registering again",
            "does not know" if keep_work else "counts as gone",
            self.engine_id,
            "keeping its work" if keep_work else f"dropping {len(held)} requests",
        )
        for work_id in held:
            self.on_cancel(work_id, "the scheduler declared this engine gone")
        try:
            self.register(timeout=10)
        except DualPathError as e:  # the next pull asks again
            log.error("registering again failed: %s", e)

    def _apply(self, reply: PullReply) -> None:
        for w in reply.cancelled:
            self.on_cancel(w, "cancelled by the scheduler")
        for w in reply.preempted:
            self.on_preempt(w)
        for a in reply.assignments.get(self.engine_id, []):
            self.on_assignment(a)
        for order in reply.prefetch.get(self.engine_id, []):
            self.traffic.prefetch(unpack_keys(order.keys), order.hold_s)

    # --- weights --------------------------------------------------------------------------------------------
    def _open_storage(self, fingerprint: bytes):
        storage = make_storage(self.cfg.storage, self.geometry, fingerprint, self.accounting)
        storage.set_evict_callback(self._evicted)
        storage.set_corrupt_callback(self.kv_events.removed)  # (the scheduler learns those when a load fails)
        storage.set_cleared_callback(self.kv_events.cleared)  # the store flushed by the scheduler
        return storage

    def _evicted(self, keys: list[bytes]) -> None:
        self.outbox.add("evicted_keys", *keys)
        self.kv_events.removed(keys)

    def update_weights(self, model_path: str, version: str = "", check_only: bool = False) -> bytes:
        """Load ``model_path``'s weights in place (the scheduler calls this once the engine holds no work) and
        return the new fingerprint: it follows the weights' exact bytes, so blocks computed by other weights
        never hit. Refused (``EngineBusyError``) while work is held; a checkpoint that does not fit leaves the old
        weights (``CheckpointError``); failing halfway through the copy leaves a mix, so the engine stops.
        ``check_only``: raise what loading would raise before copying, load nothing."""
        if check_only:
            open_update(self.model, model_path, self.cfg.engine.weight_quant)
            return self.fingerprint
        with self.admission_lock():
            if self.updating or self.held():
                raise EngineBusyError(f"engine {self.engine_id} holds work; the scheduler drains it first")
            self.updating = True
        try:
            try:
                digest = self.ranks.run(update_weights, model_path, self.cfg.engine.weight_quant)
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure mid-copy leaves weights no one asked for
                log.error("engine %s failed loading %s halfway (%s): it stops", self.engine_id, model_path, e)
                self.stopping.set()
                raise DualPathError(
                    f"engine {self.engine_id} failed loading the weights halfway ({e}) and stops"
                ) from None
            fp = model_fingerprint(
                self.model_config,
                self.cfg.engine.dtype,
                self.geometry.block_size,
                f"sha256:{digest}",
                self.cfg.engine.kv_dtype,
            )
            if fp != self.fingerprint:
                if self.traffic.prefetcher is not None:
                    self.traffic.prefetcher.clear()
                old, self.fingerprint = self.storage, fp
                self.storage = self.traffic.storage = self._open_storage(fp)
                threading.Thread(target=old.destroy, daemon=True, name="kv-retire").start()
                self.kv_events.cleared()  # nothing stored under the old weights can hit again
            self.weights = (model_path, version)
            log.info(
                "engine %s serves %s (version %r, fingerprint %s)", self.engine_id, model_path, version, fp.hex()[:12]
            )
            return fp
        finally:
            self.updating = False

    def UpdateWeights(self, req: WeightUpdate, ctx) -> WeightUpdateReply:
        start = time.perf_counter()
        try:
            fp = self.update_weights(req.model_path, req.version, req.check_only)
        except DualPathError as e:
            return WeightUpdateReply(False, str(e), busy=isinstance(e, EngineBusyError))
        return WeightUpdateReply(
            True, fingerprint=fp.hex(), version=req.version, engines=1, seconds=time.perf_counter() - start
        )

    def LoadAdapter(self, req: AdapterLoad, ctx) -> AdapterLoadReply:
        """A LoRA adapter, loaded beside the work in flight (a new identity: nothing running uses it yet)."""
        try:
            return AdapterLoadReply(True, digest=self._load_adapter(req.path, runtime=True), engines=1)
        except CheckpointError as e:
            return AdapterLoadReply(False, str(e))

    # --- control RPCs ---------------------------------------------------------------------------------------
    def Health(self, ref: RequestRef, ctx) -> Ack:
        return Ack(not self.stopping.is_set())

    def Assign(self, reply: PullReply, ctx) -> Ack:
        """Work forwarded by the group leader."""
        self._apply(reply)
        return Ack()

    def Cancel(self, ref: RequestRef, ctx) -> Ack:
        self.on_cancel(ref.request_id, ref.reason or "cancelled")
        return Ack()

    # --- life -----------------------------------------------------------------------------------------------
    def run(self) -> None:
        """Start the pull loop and the main loop (after ``register``); return after SIGTERM/SIGINT or ``stop``."""
        threading.Thread(target=self.pull_loop, daemon=True, name="pull").start()
        threading.Thread(target=self._reporter, daemon=True, name="reporter").start()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stopping.set())
        log.info(
            "%s engine %s ready on port %d (node %s, %d buffer slots, transport %s)",
            self.role.value,
            self.engine_id,
            self.port,
            self.node_id,
            self.buffer.num_slots,
            self.cfg.transport.name,
        )
        try:
            self.loop()
        except RankLostError:  # a step found a rank gone: ``_rank_lost`` has set the exit code (1) and ``stopping``;
            pass  # raised on, the CLI would exit 2 and say "error" where the supervisor should see a lost rank's 1
        finally:
            self.stop()

    def leave(self) -> None:
        """The last report says this engine is stopping (``EngineLoad.leaving``): the scheduler counts it gone at
        once and moves what it held, instead of waiting out its heartbeats (a rolling restart, a drained node)."""
        if self.registered:
            self.leaving = True
            self.report_now(timeout=3.0)

    def stop(self) -> None:
        self.stopping.set()
        self.leave()
        self.server.stop(grace=1)
        self.transport.close()
        if self.traffic.prefetcher is not None:
            self.traffic.prefetcher.close()
        self.storage.close()
        self.kv_events.close()  # after the store: its last evictions are published
        self.buffer_memory.close()  # a shared segment outlives the process unless unlinked (no supervisor may be left)
        self.ranks.close()
        log.info("%s engine %s stopped", self.role.value, self.engine_id)


def new_work_id() -> str:
    return uuid.uuid4().hex
