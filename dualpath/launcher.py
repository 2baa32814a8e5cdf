"""Start a scheduler and xPyD engine processes on this host, wait until every part is ready, keep them up, stop
them all.

Children learn the launcher's pid (``DUALPATH_PARENT_PID``) and ask the kernel to end them when it ends, so no
process outlives the launcher, even one killed with SIGKILL. Each child logs to its own file in ``run_dir``; the logs
of an earlier run in the same directory are rotated (``NAME.log.1`` is the last run's). A child that exits, or stops
answering its health check, is restarted with backoff up to a cap (``RestartPolicy``): a restarted engine registers
again under its name and the scheduler moves its requests; a restarted scheduler listens on its old port, engines
register with it keeping their work, and submitters resubmit what it had not yet handed to a decode engine.

Start-up is reported through ``report`` (the log by default; ``dualpath serve`` prints): each engine as it starts
loading (model, device) and as it is ready (its KV cache in tokens, from its ready file), and every ``PROGRESS_S``
what is still starting, with the last line of its log, so a slow start shows where it is.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dualpath.core.config import QosConfig
from dualpath.core.errors import ConfigError, DualPathError
from dualpath.core.lora import LoraModule
from dualpath.core.messages import RequestRef
from dualpath.core.rpc import ENGINE_METHODS, SCHEDULER_METHODS, TOKEN_ENV, Client, RpcError, ensure_cluster_token

log = logging.getLogger(__name__)
PORTS_PER_ENGINE = 3  # an engine's control port, then its transport's listeners (one per priority class)
TP_PORTS = 1  # a tensor-parallel engine's one more: its ranks' rendezvous (``ParallelConfig.master_port``)
KEEP_LOGS = 3  # earlier runs' logs kept beside the current one (NAME.log.1 .. NAME.log.3)
PROGRESS_S = 10.0  # how often a wait for children to start says what is still starting


@dataclass(frozen=True)
class RestartPolicy:
    """How a supervisor brings back a child that exits, or fails ``health_failures`` health checks in a row (one
    every ``health_interval_s``, each given ``health_timeout_s``): after ``backoff_s``, doubling per recent restart up
    to ``max_backoff_s``, at most ``max_restarts`` times in ``window_s``; past that it stays down and says so.
    ``max_restarts`` 0: never restarted (the process's own supervisor, Kubernetes or Slurm, does it)."""

    max_restarts: int = 0
    window_s: float = 600.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    health_interval_s: float = 5.0
    health_timeout_s: float = 5.0
    health_failures: int = 3

    def delay(self, recent: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2**recent)


def qos_args(qos: QosConfig) -> list[str]:
    """``dualpath engine``'s options giving ``qos``."""
    return [
        "--kv-service-level",
        str(qos.kv_service_level),
        "--kv-dscp",
        str(qos.kv_dscp),
        "--collective-service-level",
        str(qos.collective_service_level),
        "--collective-dscp",
        str(qos.collective_dscp),
    ]


def parse_port_range(text: str) -> tuple[int, int]:
    """``LO-HI`` (inclusive) as two ports."""
    try:
        lo, hi = (int(x) for x in text.split("-"))
    except ValueError:
        raise ConfigError(f"a port range is LO-HI, got {text!r}") from None
    if not 0 < lo <= hi < 65536:
        raise ConfigError(f"port range {text} is not within 1-65535, low to high")
    return lo, hi


@dataclass(frozen=True)
class ClusterSpec:
    model: str
    num_prefill: int = 1
    num_decode: int = 1
    mode: str = "dualpath"
    policy: str = "dualpath"
    load_every_hit: bool = False  # the paper's systems: never recompute a stored prefix that is slow to load
    scheduling_policy: str = "fcfs"  # see SchedulerConfig.scheduling_policy
    priority_preemption: bool = True  # see SchedulerConfig.priority_preemption
    session_prefetch: bool = True  # see SchedulerConfig.session_prefetch
    session_affinity: bool = True  # see SchedulerConfig.session_affinity
    transport: str = "shm"
    qos: QosConfig = QosConfig()  # the engines' priority classes on the wire (``dualpath engine``'s QoS options)
    kv_store: str | None = None
    device: str = "cpu"  # "cuda" gives engine i the devices cuda:i*tp .. cuda:i*tp+tp-1 (prefill first, then decode)
    dtype: str = "float32"
    kernels: str = "auto"  # see EngineConfig.kernels
    tensor_parallel_size: int = 1  # ranks per engine (ParallelConfig.tensor_parallel_size)
    prefill_tensor_parallel_size: int = 0  # the prefill engines' own (0: tensor_parallel_size)
    decode_tensor_parallel_size: int = 0  # the decode engines' own (0: tensor_parallel_size)
    tp_master_port: int = 0  # the first TP engine's rendezvous port, the next one's +1, ... (0: any free port)
    tp_join_timeout_s: float = 60.0  # see ParallelConfig.join_timeout_s
    enable_expert_parallel: bool = False  # see ParallelConfig.enable_expert_parallel (every TP engine)
    moe_dispatch: str = "all_to_all"  # see ParallelConfig.moe_dispatch
    data_parallel_size: int = 1  # data-parallel attention: each role's engines in groups of this many (MoE models)
    kv_cache_dtype: str = "auto"  # see EngineConfig.kv_cache_dtype
    quantization: str | None = None  # see EngineConfig.quantization
    enforce_eager: bool = False  # see EngineConfig.enforce_eager
    speculative_config: str = ""  # see EngineConfig.speculative (vLLM's JSON; "" off)
    kv_events_config: str = ""  # see KVEventsConfig (vLLM's JSON; "" off): engine i of a role at port offset 2i (+1)
    lora_modules: tuple[LoraModule, ...] = ()  # see EngineConfig.lora_modules
    block_size: int = 64
    buffer_bytes: int = 256 << 20
    cache_bytes: int = 0  # see CacheConfig.device_memory_bytes (0: automatic)
    gpu_memory_utilization: float = 0.9  # see CacheConfig.gpu_memory_utilization
    workspace_tokens: int = 16384
    prefill_kv_budget_bytes: int = 0  # see EngineProcessConfig.prefill_kv_budget_bytes
    storage_read_bps: float = 0.0
    storage_capacity: int = 0  # bytes of KV kept in the store (0: no cap)
    compute_quota_ms: float = 300.0
    cost_model: str | None = None  # "fixed,per_token,attention"
    max_model_len: int = 0
    torch_threads: int = 1
    heartbeat_timeout_s: float = 10.0
    engine_wait_timeout_s: float = 60.0  # see SchedulerConfig.engine_wait_timeout_s
    restart: RestartPolicy = RestartPolicy()  # children brought back when they die (off by default: tests kill)
    engine_ports: tuple[int, int] | None = None  # every engine's ports from this range (default: any free port)
    env: tuple[tuple[str, str], ...] = ()  # more environment for every child (the chaos suite's failpoints)
    scheduler_http_port: int = -1  # the scheduler's /metrics (-1: none, 0: any free port)
    host: str = "127.0.0.1"
    scheduler_port: int = 0
    engines_per_node: int = 1  # engines of a role packed per node; a node's engines form one group
    extra_engine_args: tuple[str, ...] = ()
    log_level: str = "INFO"

    def tp(self, role: str) -> int:
        """The tensor-parallel size of ``role``'s engines."""
        own = self.prefill_tensor_parallel_size if role == "prefill" else self.decode_tensor_parallel_size
        return own or self.tensor_parallel_size

    def first_device(self, role: str, index: int) -> int:
        """The first device index of engine ``index`` of ``role`` (with ``device="cuda"``): the prefill engines'
        ranks take the first devices, each engine ``tp(role)`` consecutive ones, the decode engines' the next."""
        before = self.num_prefill * self.tp("prefill") if role == "decode" else 0
        return before + index * self.tp(role)


def _gives(args: tuple[str, ...], flag: str) -> bool:
    """Whether command-line ``args`` give option ``flag`` (``--flag VALUE`` or ``--flag=VALUE``)."""
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _free_port(host: str) -> int:
    """A port free on ``host`` now (a data-parallel group's rendezvous: its rank 0 binds it when it starts)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _check_groups(spec: ClusterSpec, model) -> None:
    """Data-parallel attention: each role's engines fill whole groups, of TP 1, on a model the groups can share."""
    from dualpath.core.config import EngineConfig, ParallelConfig
    from dualpath.engines.parallel.ranks import check_parallel

    d = spec.data_parallel_size
    for role, count in (("prefill", spec.num_prefill), ("decode", spec.num_decode)):
        if count % d:
            raise ConfigError(f"--data-parallel-size {d}: the {count} {role} engine(s) do not fill groups of {d}")
        if spec.tp(role) > 1:
            raise ConfigError(
                "data-parallel attention runs one rank per engine: --tensor-parallel-size 1 with "
                "--data-parallel-size > 1"
            )
    check_parallel(model, EngineConfig(parallel=ParallelConfig(data_parallel_size=d, data_parallel_master="h:1")))


def check_parallelism(spec: ClusterSpec, model) -> None:
    """``ConfigError`` before any process starts when ``spec``'s tensor parallelism cannot serve ``model`` (a
    ``ModelConfig``): a size that does not divide its heads, MLP or vocabulary, an architecture or LoRA adapters not
    yet served sharded (``dualpath.engines.parallel.ranks.check_parallel``, per role), or more devices than this host has."""
    from dualpath.core.config import EngineConfig, ParallelConfig

    sizes = {role: spec.tp(role) for role in ("prefill", "decode")}
    for size in sizes.values():
        ParallelConfig(size)  # (a size out of range is refused with its own message)
    from dualpath.engines.parallel.ranks import check_parallel

    if spec.data_parallel_size > 1:
        _check_groups(spec, model)
    if all(size == 1 for size in sizes.values()):
        return

    for role, count in (("prefill", spec.num_prefill), ("decode", spec.num_decode)):
        if count:  # the role's last engine: the highest devices it takes
            device = f"cuda:{spec.first_device(role, count - 1)}" if spec.device == "cuda" else spec.device
            check_parallel(
                model,
                EngineConfig(
                    device=device,
                    lora_modules=spec.lora_modules,
                    parallel=ParallelConfig(sizes[role], enable_expert_parallel=spec.enable_expert_parallel),
                ),
            )
    if spec.device == "cuda":
        import torch

        need, have = spec.first_device("decode", spec.num_decode), torch.cuda.device_count()
        if need > have:
            raise ConfigError(
                f"{spec.num_prefill} prefill engine(s) of tensor-parallel size {sizes['prefill']} and "
                f"{spec.num_decode} decode engine(s) of size {sizes['decode']} need {need} GPUs, but "
                f"this host has {have}"
            )


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path
    ready_path: Path
    cmd: list[str] = field(default_factory=list)  # what (re)starts it
    address: str = ""  # its control address once ready (health checks)
    restarts: list[float] = field(default_factory=list)  # when it was restarted (monotonic)
    retired: bool = False  # replaced on purpose (``restart_scheduler``): no longer watched

    def tail(self, n: int = 30) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-n:])
        except OSError:
            return ""

    def option(self, name: str) -> str:
        """The value of ``--name`` in its command ("" without one)."""
        return self.cmd[self.cmd.index(name) + 1] if name in self.cmd[:-1] else ""

    def describe(self) -> str:
        """What it is, for start-up reports: an engine's model and device (and tensor-parallel size)."""
        if "engine" not in self.cmd:
            return self.name
        tp = self.option("--tensor-parallel-size")
        more = f", tensor-parallel size {tp}" if tp not in ("", "1") else ""
        return f"{self.name} ({Path(self.option('--model')).name} on {self.option('--device')}{more})"

    def ready_text(self) -> str:
        """Its ready file in words: an engine's is ``ID ADDRESS KV_TOKENS``, the scheduler's ``PORT HTTP_PORT``."""
        fields = self.ready_path.read_text().split()
        if "engine" in self.cmd and len(fields) > 2:
            return f", KV cache {int(fields[2]):,} tokens, at {fields[1]}"
        return f", at port {fields[0]}" if fields else ""


class Supervisor:
    """Child processes of this host: spawned with their own log and ready file, watched (and, by ``restart``,
    brought back), stopped together."""

    def __init__(
        self,
        run_dir: str | None,
        torch_threads: int,
        log_level: str,
        restart: RestartPolicy = RestartPolicy(),
        start_timeout: float = 300.0,
        env: dict | None = None,
        report: Callable[[str], None] = log.info,
    ):
        self.report = report  # start-up progress, a line at a time
        self.run_dir = Path(run_dir or tempfile.mkdtemp(prefix="dualpath-run-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.torch_threads, self.log_level = torch_threads, log_level
        self.restart, self.start_timeout, self.env = restart, start_timeout, env or {}
        self.children: list[Child] = []
        self._stopping = False
        self._stop_event = threading.Event()
        self._spawn_lock = threading.Lock()  # a restart never starts a process after ``stop`` began
        self._rotated: set[str] = set()

    def spawn(self, name: str, args: list[str], prefix: tuple[str, ...] = ()) -> Child:
        """Start ``dualpath ARGS --ready-file F`` (F before a ``--``: options after it belong to the engines of
        ``dualpath node``), behind ``prefix`` (e.g. ``ip netns exec NS``, which execs, so the parent stays us)."""
        log_path, ready = self.run_dir / f"{name}.log", self.run_dir / f"{name}.ready"
        if name not in self._rotated:
            self._rotated.add(name)
            rotate_log(log_path)
        own = args[: args.index("--")] if "--" in args else args
        cmd = [
            *prefix,
            sys.executable,
            "-m",
            "dualpath.cli",
            "--log-level",
            self.log_level,
            *own,
            "--ready-file",
            str(ready),
            *args[len(own) :],
        ]
        child = Child(name, self._popen(cmd, log_path, ready), log_path, ready, cmd)
        self.children.append(child)
        self.report(f"starting {child.describe()}; log: {log_path}")
        return child

    def _popen(self, cmd: list[str], log_path: Path, ready: Path) -> subprocess.Popen:
        ready.unlink(missing_ok=True)
        env = {
            **os.environ,
            **self.env,
            "DUALPATH_PARENT_PID": str(os.getpid()),
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": str(self.torch_threads or 1),
            "TOKENIZERS_PARALLELISM": "false",
        }
        with open(log_path, "a") as out:  # (a restarted part's log goes on)
            return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=False)

    def wait_ready(self, children: list[Child], timeout: float, progress_s: float = PROGRESS_S) -> None:
        """Until every child wrote its ready file, reporting each as it does and, every ``progress_s``, those still
        starting; a child that exits first, or the ``timeout``, raises with the end of its log."""
        start = time.monotonic()
        note, pending = start + progress_s, list(children)
        while pending:
            for c in [c for c in pending if c.ready_path.exists()]:
                pending.remove(c)
                self.report(f"{c.describe()} ready after {time.monotonic() - start:.1f} s{c.ready_text()}")
            for c in pending:
                if c.proc.poll() is not None:
                    raise DualPathError(f"{c.name} exited with {c.proc.returncode} while starting:\n{c.tail()}")
            now = time.monotonic()
            if pending and now > start + timeout:
                raise DualPathError(f"{pending[0].name} not ready after {timeout:.0f} s:\n{pending[0].tail()}")
            if pending and now >= note:
                note = now + progress_s
                self._still_starting(pending, now - start)
            if pending:
                time.sleep(0.05)

    def _still_starting(self, pending: list[Child], waited_s: float) -> None:
        """Which children are still starting, each with its log's last line (where it is)."""
        self.report(
            f"still starting after {waited_s:.0f} s: "
            + "; ".join(f"{c.name} ({c.tail(1).strip()[-160:] or 'nothing logged yet'})" for c in pending)
        )

    def watch(self, children: list[Child] | None = None) -> None:
        """Watch each child on a thread of its own: log an exit, and restart by ``self.restart``."""
        for c in self.children if children is None else children:
            threading.Thread(target=self._supervise, args=(c,), daemon=True, name=f"watch-{c.name}").start()

    def _supervise(self, c: Child) -> None:
        failures, next_check = 0, time.monotonic() + self.restart.health_interval_s
        while not self._stop_event.wait(0.25) and not c.retired:
            why = f"exited with {c.proc.returncode}" if c.proc.poll() is not None else ""
            if not why and self.restart.max_restarts and time.monotonic() >= next_check:
                next_check = time.monotonic() + self.restart.health_interval_s
                failures = 0 if self.healthy(c) else failures + 1
                if failures >= self.restart.health_failures:
                    why = f"did not answer {failures} health checks in a row"
                    c.proc.kill()
                    c.proc.wait(30)
            if not why:
                continue
            if not self._recover(c, why):
                return
            failures, next_check = 0, time.monotonic() + self.restart.health_interval_s

    def healthy(self, c: Child) -> bool:
        """Whether ``c`` answered its health check in time: an engine's ``Health``, the scheduler's ``Stats``."""
        if not c.address:
            return True
        service, methods, call = (
            ("Scheduler", SCHEDULER_METHODS, "Stats") if c.name == "scheduler" else ("Engine", ENGINE_METHODS, "Health")
        )
        client = Client(service, methods, c.address)
        try:
            client.call(call, RequestRef(""), timeout=self.restart.health_timeout_s)
            return True
        except RpcError as e:
            log.warning("%s failed a health check: %s", c.name, e)
            return False
        finally:
            client.close()

    def _recover(self, c: Child, why: str) -> bool:
        """Restart ``c`` after its backoff, if the policy allows; False when it stays down."""
        policy, now = self.restart, time.monotonic()
        _release(c)
        c.restarts = [t for t in c.restarts if now - t < policy.window_s]
        if len(c.restarts) >= policy.max_restarts:
            more = (
                f"; restarted {len(c.restarts)} times in {policy.window_s:.0f} s, it stays down"
                if policy.max_restarts
                else ""
            )
            log.error("%s %s%s; last lines:\n%s", c.name, why, more, c.tail(15))
            return False
        delay = policy.delay(len(c.restarts))
        log.error(
            "%s %s; restarting it in %.0f s (restart %d of at most %d in %.0f s); last lines:\n%s",
            c.name,
            why,
            delay,
            len(c.restarts) + 1,
            policy.max_restarts,
            policy.window_s,
            c.tail(15),
        )
        if self._stop_event.wait(delay):
            return False
        with self._spawn_lock:
            if self._stopping:
                return False
            c.restarts.append(time.monotonic())
            with open(c.log_path, "a") as out:
                out.write(f"\n--- restarted by the supervisor ({why}) ---\n")
            c.proc = self._popen(c.cmd, c.log_path, c.ready_path)
        try:
            self.wait_ready([c], self.start_timeout)
        except DualPathError as e:
            log.error("%s did not come back: %s", c.name, e)
            if c.proc.poll() is None:
                c.proc.kill()  # the watch loop sees the exit and tries again, within the cap
                c.proc.wait(30)
            return True
        self.restarted(c)
        log.warning("%s is back (pid %d)", c.name, c.proc.pid)
        return True

    def restarted(self, c: Child) -> None:
        """``c`` is ready (again): learn its control address from its ready file (an engine's: ``ID ADDRESS``)."""
        c.address = c.ready_path.read_text().split()[1]

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        c = self.child(name)
        c.proc.send_signal(sig)
        c.proc.wait(30)
        _release(c)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM every child, wait, SIGKILL what remains: the engines, then the scheduler (an engine's last report,
        that it is leaving, finds the scheduler still there)."""
        with self._spawn_lock:
            self._stopping = True
            self._stop_event.set()
        deadline = time.monotonic() + timeout
        for last in (False, True):
            group = [c for c in self.children if (c.name == "scheduler") == last]
            for c in group:
                if c.proc.poll() is None:
                    c.proc.send_signal(signal.SIGTERM)
            for c in group:
                try:
                    c.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait(5)
                _release(c)


def rotate_log(path: Path, keep: int = KEEP_LOGS) -> None:
    """Move an earlier run's ``path`` to ``path.1`` (and ``.1`` to ``.2``, ...), keeping ``keep``: a run's log holds
    that run only."""
    for i in range(keep, 0, -1):
        older = path.with_name(f"{path.name}.{i - 1}") if i > 1 else path
        if older.exists():
            older.replace(path.with_name(f"{path.name}.{i}"))


def _release(c: "Child") -> None:
    """What a stopped child could not clean up itself: its shared-memory segments."""
    from dualpath.traffic.memory import remove_segments

    n = remove_segments(c.proc.pid)
    if n:
        log.info("removed %d shared-memory segments left by %s", n, c.name)


class LocalCluster(Supervisor):
    """A scheduler and xPyD engines on this host."""

    def __init__(self, spec: ClusterSpec, run_dir: str | None = None, report: Callable[[str], None] = log.info):
        super().__init__(run_dir, spec.torch_threads, spec.log_level, spec.restart, env=dict(spec.env), report=report)
        self.spec = spec
        self.scheduler_address = ""
        self.scheduler_http = ""
        self.engine_addresses: dict[str, str] = {}
        self._ports_used = 0  # engines given ports from ``spec.engine_ports`` so far
        self._ports_taken = 0  # ports of the range given out so far
        self._tp_engines = 0  # tensor-parallel engines given a rendezvous port from ``spec.tp_master_port`` so far
        self._dp_masters: dict[tuple[str, int], str] = {}  # (role, group) -> its data-parallel rendezvous

    @property
    def token_file(self) -> Path:
        """The cluster token, for other processes of this host that must call in (``dualpath status``)."""
        return self.run_dir / "cluster-token"

    def _share_token(self) -> None:
        token = os.environ.get(TOKEN_ENV)
        if token:  # (an earlier run's file in the same directory held another token)
            self.token_file.unlink(missing_ok=True)
            fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token)

    def _next_ports(self, tp: int = 1) -> tuple[int, int, int]:
        """The next engine's (control port, first transport port, its ranks' rendezvous port): from the range (a
        tensor-parallel engine takes one more port than ``PORTS_PER_ENGINE``, its ranks' rendezvous), or (0, 0,
        ``--tp-master-port`` + k for the k-th tensor-parallel engine, else 0) for any free ones."""
        if self.spec.engine_ports is None:
            master = 0
            if tp > 1 and self.spec.tp_master_port:
                master = self.spec.tp_master_port + self._tp_engines
                self._tp_engines += 1
            return 0, 0, master
        lo, hi = self.spec.engine_ports
        need = PORTS_PER_ENGINE + (TP_PORTS if tp > 1 else 0)
        port = lo + self._ports_taken
        if port + need - 1 > hi:
            raise ConfigError(
                f"--engine-port-range {lo}-{hi} has room for {(hi - lo + 1) // need} engines ({need} "
                f"ports each{' at tensor-parallel size > 1' if tp > 1 else ''}); engine "
                f"{self._ports_used + 1} needs more"
            )
        self._ports_used += 1
        self._ports_taken += need
        return port, port + 1, port + PORTS_PER_ENGINE if tp > 1 else 0

    def _engine_args(self, role: str, index: int, device_index: int) -> list[str]:
        """``dualpath engine`` options of engine ``index`` of ``role``, its ranks from device ``device_index``
        (``ClusterSpec.first_device``) on."""
        s = self.spec
        device = f"cuda:{device_index}" if s.device == "cuda" else s.device
        name = f"{role}-{index}"
        node = f"{role}-node{index // s.engines_per_node}"
        tp = s.tp(role)
        port, transport_port, master_port = self._next_ports(tp)
        group = node if s.engines_per_node > 1 else ""
        if s.data_parallel_size > 1:  # a data-parallel group is one engine group to the scheduler (paper §6)
            group = f"{role}-dp{index // s.data_parallel_size}"
        args = [
            "engine",
            "--role",
            role,
            "--model",
            s.model,
            "--scheduler",
            self.scheduler_address,
            "--port",
            str(port),
            "--transport-port",
            str(transport_port),
            "--engine-id",
            name,
            "--node-id",
            node,
            "--group-id",
            group,
            "--device",
            device,
            "--dtype",
            s.dtype,
            "--kv-cache-dtype",
            s.kv_cache_dtype,
            "--kernels",
            s.kernels,
            "--transport",
            s.transport,
            "--host",
            s.host,
            "--block-size",
            str(s.block_size),
            "--buffer-bytes",
            str(s.buffer_bytes),
            "--cache-bytes",
            str(s.cache_bytes),
            "--gpu-memory-utilization",
            str(s.gpu_memory_utilization),
            "--workspace-tokens",
            str(s.workspace_tokens),
            "--prefill-kv-budget",
            str(s.prefill_kv_budget_bytes),
            "--storage-read-bps",
            str(s.storage_read_bps),
            "--storage-capacity",
            str(s.storage_capacity),
            "--compute-quota-ms",
            str(s.compute_quota_ms),
            "--torch-threads",
            str(s.torch_threads),
            "--max-model-len",
            str(s.max_model_len),
        ]
        if tp > 1:  # (TP 1: the command as before)
            args += [
                "--tensor-parallel-size",
                str(tp),
                "--tp-master-port",
                str(master_port),
                "--tp-join-timeout",
                str(s.tp_join_timeout_s),
                "--moe-dispatch",
                s.moe_dispatch,
            ]
            if s.enable_expert_parallel:
                args.append("--enable-expert-parallel")
        if s.data_parallel_size > 1:  # the group's engines are consecutive; a restarted one meets them again
            group = index // s.data_parallel_size
            master = self._dp_masters.setdefault((role, group), f"{s.host}:{_free_port(s.host)}")
            args += [
                "--data-parallel-size",
                str(s.data_parallel_size),
                "--data-parallel-rank",
                str(index % s.data_parallel_size),
                "--data-parallel-master",
                master,
                "--moe-dispatch",
                s.moe_dispatch,
            ]
        if s.enforce_eager:
            args.append("--enforce-eager")
        if s.quantization:
            args += ["--quantization", s.quantization]
        if s.speculative_config:
            args += ["--speculative-config", s.speculative_config]
        if s.kv_events_config:  # every engine of the host on ports of its own: prefill 2i, decode 2i + 1
            args += ["--kv-events-config", s.kv_events_config]
            args += ["--kv-events-port-offset", str(2 * index + (role == "decode"))]
        if s.lora_modules:
            args += ["--lora-modules", *(f"{m.name}={m.path}" for m in s.lora_modules)]
        if s.kv_store:
            args += ["--kv-store", s.kv_store]
        if s.qos != QosConfig():
            args += qos_args(s.qos)
        if s.cost_model:
            args += ["--cost-model", s.cost_model]
        return args + list(s.extra_engine_args)

    def start(self, timeout: float = 300.0) -> "LocalCluster":
        s = self.spec
        if s.tp("prefill") > 1 or s.tp("decode") > 1:  # (serve checked already; other callers too, before starting)
            from dualpath.engines.models import open_checkpoint

            check_parallelism(s, open_checkpoint(s.model).config)
        ensure_cluster_token()  # the cluster's internal plane is closed to whoever lacks it (children inherit it)
        self._share_token()
        try:
            self._start_scheduler(s.scheduler_port, timeout)
            engines = [
                self.spawn(f"{role}-{i}", self._engine_args(role, i, s.first_device(role, i)))
                for role, count in (("prefill", s.num_prefill), ("decode", s.num_decode))
                for i in range(count)
            ]
            self.wait_ready(engines, timeout)
            for c in engines:
                self.restarted(c)
            self.start_timeout = timeout
            self.watch()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_scheduler(self, port: int, timeout: float, http_port: int | None = None) -> Child:
        s = self.spec
        http_port = s.scheduler_http_port if http_port is None else http_port
        args = [
            "scheduler",
            "--host",
            s.host,
            "--port",
            str(port),
            "--mode",
            s.mode,
            "--policy",
            s.policy,
            "--heartbeat-timeout",
            str(s.heartbeat_timeout_s),
            "--http-port",
            str(http_port),
            "--engine-wait-timeout",
            str(s.engine_wait_timeout_s),
            "--scheduling-policy",
            s.scheduling_policy,
        ]
        if s.kv_store:
            args += ["--kv-store", s.kv_store]
        if s.load_every_hit:
            args.append("--load-every-hit")
        if not s.priority_preemption:
            args.append("--disable-priority-preemption")
        if not s.session_prefetch:
            args.append("--disable-session-prefetch")
        if not s.session_affinity:
            args.append("--disable-session-affinity")
        sched = self.spawn("scheduler", args)
        self.wait_ready([sched], timeout)
        self.restarted(sched)
        # a restart listens where engines and frontends already look
        sched.cmd[sched.cmd.index("--port") + 1] = self.scheduler_address.rsplit(":", 1)[1]
        sched.cmd[sched.cmd.index("--http-port") + 1] = (
            self.scheduler_http.rsplit(":", 1)[1] if self.scheduler_http else str(http_port)
        )
        return sched

    def restarted(self, c: Child) -> None:
        if c.name == "scheduler":
            port, http = c.ready_path.read_text().split()
            c.address = self.scheduler_address = f"{self.spec.host}:{port}"
            self.scheduler_http = f"http://{self.spec.host}:{http}" if int(http) >= 0 else ""
        else:
            super().restarted(c)
            self.engine_addresses[c.ready_path.read_text().split()[0]] = c.address

    def restart_scheduler(self, timeout: float = 60.0) -> None:
        """Start the scheduler again on its port (after it died, or stopping it first): the engines register with
        it again keeping their work, and clients submit again what it had not yet handed to a decode engine."""
        old = self.child("scheduler")
        old.retired = True
        if old.proc.poll() is None:
            old.proc.terminate()
            old.proc.wait(30)
        self.children.remove(old)
        http = int(self.scheduler_http.rsplit(":", 1)[1]) if self.scheduler_http else -1
        self.watch([self._start_scheduler(int(self.scheduler_address.rsplit(":", 1)[1]), timeout, http)])

    def add_engine(self, role: str, timeout: float = 120.0) -> str:
        """Start one more engine of ``role`` (the next index) and wait until it serves: a replacement in a rolling
        restart (stop the old one after: its replies move here), or more capacity. Returns its name."""
        index = sum(c.name.startswith(f"{role}-") for c in self.children)
        child = self.spawn(f"{role}-{index}", self._engine_args(role, index, self.spec.first_device(role, index)))
        self.wait_ready([child], timeout)
        self.restarted(child)
        self.watch([child])
        return child.name

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass(frozen=True)
class NodeSpec:
    """This host's engines of one role, for a cluster whose scheduler runs elsewhere (a Kubernetes pod per node,
    a hand-started cluster). The node's engines form one engine group and share the node's storage NIC."""

    role: str
    scheduler: str
    engines: int = 1
    device: str = "cpu"  # "cuda" gives engine i the devices cuda:i*tp .. cuda:i*tp+tp-1
    node_id: str = ""  # default: the host name
    host: str = "127.0.0.1"  # the address peers reach these engines at
    base_port: int = 0  # engine i listens on base_port + i (0: any free port)
    torch_threads: int = 0  # per engine (0: the cores shared out)
    engine_args: tuple[str, ...] = ()  # for every ``dualpath engine``: --model, --transport, --kv-store, ...
    log_level: str = "INFO"
    tensor_parallel_size: int = 1  # ranks per engine, on consecutive devices (its ranks' rendezvous: any free port)
    data_parallel: bool = False  # the node's engines are one data-parallel attention group (MoE models; TP 1)


class NodeEngines(Supervisor):
    """Start a node's engines, wait for them, and end them all when one ends or stops answering its health checks
    (the pod's container, or the job step, is restarted by Kubernetes or Slurm)."""

    def __init__(self, spec: NodeSpec, run_dir: str | None = None):
        threads = spec.torch_threads or max(
            1, (os.cpu_count() or 1) // max(1, spec.engines * spec.tensor_parallel_size)
        )
        super().__init__(run_dir, threads, spec.log_level)
        self.spec = spec
        # a data-parallel group meets on this host (its engines are this node's; a restart of the node: a new port)
        self.dp_master = f"127.0.0.1:{_free_port('127.0.0.1')}" if spec.data_parallel else ""

    def engine_args(self, index: int) -> list[str]:
        s = self.spec
        node = s.node_id or socket.gethostname()
        tp = s.tensor_parallel_size
        device = f"cuda:{index * tp}" if s.device == "cuda" else s.device
        return [
            "engine",
            "--role",
            s.role,
            "--scheduler",
            s.scheduler,
            "--engine-id",
            f"{s.role}-{node}-{index}",
            "--node-id",
            node,
            "--group-id",
            f"{s.role}-{node}",
            "--device",
            device,
            "--host",
            s.host,
            "--port",
            str(s.base_port + index if s.base_port else 0),
            "--torch-threads",
            str(self.torch_threads),
            *(["--tensor-parallel-size", str(tp)] if tp > 1 else []),
            *self._dp_args(index),
            *(["--kv-events-port-offset", str(index)] if _gives(s.engine_args, "--kv-events-config") else []),
            *s.engine_args,
        ]

    def _dp_args(self, index: int) -> list[str]:
        if not self.spec.data_parallel:
            return []
        return [
            "--data-parallel-size",
            str(self.spec.engines),
            "--data-parallel-rank",
            str(index),
            "--data-parallel-master",
            self.dp_master,
        ]

    def start(self, timeout: float = 600.0) -> "NodeEngines":
        try:
            children = [self.spawn(f"{self.spec.role}-{i}", self.engine_args(i)) for i in range(self.spec.engines)]
            self.wait_ready(children, timeout)
            for c in children:
                self.restarted(c)
        except BaseException:
            self.stop()
            raise
        return self

    def wait(self, alive_file: str | None = None) -> int:
        """Block until an engine exits or fails ``health_failures`` health checks in a row (then stop them all) or
        ``stop`` is called; the exit code to report. ``alive_file`` is touched after every round of checks that all
        engines passed (a liveness probe reads its age)."""
        failures = {c.name: 0 for c in self.children}
        next_check = 0.0
        while not self._stop_event.wait(0.5):
            exited = [c for c in self.children if c.proc.poll() is not None]
            why = ", ".join(f"{c.name} exited with {c.proc.returncode}" for c in exited)
            if not why and time.monotonic() >= next_check:
                next_check = time.monotonic() + self.restart.health_interval_s
                why = self._check_round(failures)
                if not why and alive_file:
                    Path(alive_file).touch()
            if why and not self._stopping:  # (a stop already asked for: its engines' exits are no failure)
                log.error("%s; stopping this node's engines", why)
                self.stop()
                return (exited[0].proc.returncode if exited else 1) or 1
        return 0

    def _check_round(self, failures: dict[str, int]) -> str:
        """One health check of every engine; why the node must stop ("" if it need not). A wedged engine is killed
        at once: it cannot drain, and a SIGTERM would wait out ``stop``'s timeout."""
        for c in self.children:
            failures[c.name] = 0 if self.healthy(c) else failures[c.name] + 1
        stuck = [c for c in self.children if failures[c.name] >= self.restart.health_failures]
        for c in stuck:
            c.proc.kill()
        return (
            f"{', '.join(c.name for c in stuck)} did not answer {self.restart.health_failures} health checks in a row"
            if stuck
            else ""
        )


__all__ = ["ClusterSpec", "LocalCluster", "NodeEngines", "NodeSpec", "Supervisor", "check_parallelism"]
