"""Start a scheduler and xPyD engine processes on this host, wait until every part is ready, stop them all.

Children learn the launcher's pid (``DUALPATH_PARENT_PID``) and ask the kernel to end them when it ends, so no
process outlives the launcher, even one killed with SIGKILL. Each child logs to its own file in ``run_dir``.
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
from dataclasses import dataclass
from pathlib import Path

from dualpath.errors import DualPathError
from dualpath.lora import LoraModule

log = logging.getLogger(__name__)


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
    transport: str = "shm"
    kv_store: str | None = None
    device: str = "cpu"  # "cuda" gives engine i the device cuda:i
    dtype: str = "float32"
    kernels: str = "auto"  # see EngineConfig.kernels
    kv_cache_dtype: str = "auto"  # see EngineConfig.kv_cache_dtype
    quantization: str | None = None  # see EngineConfig.quantization
    enforce_eager: bool = False  # see EngineConfig.enforce_eager
    speculative_config: str = ""  # see EngineConfig.speculative (vLLM's JSON; "" off)
    lora_modules: tuple[LoraModule, ...] = ()  # see EngineConfig.lora_modules
    block_size: int = 64
    buffer_bytes: int = 256 << 20
    cache_bytes: int = 0  # see CacheConfig.device_memory_bytes (0: automatic)
    gpu_memory_utilization: float = 0.9  # see CacheConfig.gpu_memory_utilization
    workspace_tokens: int = 16384
    storage_read_bps: float = 0.0
    storage_capacity: int = 0  # bytes of KV kept in the store (0: no cap)
    compute_quota_ms: float = 300.0
    cost_model: str | None = None  # "fixed,per_token,attention"
    max_model_len: int = 0
    torch_threads: int = 1
    heartbeat_timeout_s: float = 10.0
    scheduler_http_port: int = -1  # the scheduler's /metrics (-1: none, 0: any free port)
    host: str = "127.0.0.1"
    scheduler_port: int = 0
    engines_per_node: int = 1  # engines of a role packed per node; a node's engines form one group
    extra_engine_args: tuple[str, ...] = ()
    log_level: str = "INFO"


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path
    ready_path: Path

    def tail(self, n: int = 30) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-n:])
        except OSError:
            return ""


class Supervisor:
    """Child processes of this host: spawned with their own log and ready file, watched, stopped together."""

    def __init__(self, run_dir: str | None, torch_threads: int, log_level: str):
        self.run_dir = Path(run_dir or tempfile.mkdtemp(prefix="dualpath-run-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.torch_threads, self.log_level = torch_threads, log_level
        self.children: list[Child] = []
        self._stopping = False

    def spawn(self, name: str, args: list[str], prefix: tuple[str, ...] = ()) -> Child:
        """Start ``dualpath ARGS --ready-file F`` (F before a ``--``: options after it belong to the engines of
        ``dualpath node``), behind ``prefix`` (e.g. ``ip netns exec NS``, which execs, so the parent stays us)."""
        log_path, ready = self.run_dir / f"{name}.log", self.run_dir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        env = {**os.environ, "DUALPATH_PARENT_PID": str(os.getpid()), "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": str(self.torch_threads or 1), "TOKENIZERS_PARALLELISM": "false"}
        own = args[:args.index("--")] if "--" in args else args
        cmd = [*prefix, sys.executable, "-m", "dualpath.cli", "--log-level", self.log_level, *own,
               "--ready-file", str(ready), *args[len(own):]]
        with open(log_path, "a") as out:  # (a restarted part's log goes on)
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=False)
        child = Child(name, proc, log_path, ready)
        self.children.append(child)
        return child

    def wait_ready(self, children: list[Child], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for c in children:
            while not c.ready_path.exists():
                if c.proc.poll() is not None:
                    raise DualPathError(f"{c.name} exited with {c.proc.returncode} while starting:\n{c.tail()}")
                if time.monotonic() > deadline:
                    raise DualPathError(f"{c.name} not ready after {timeout:.0f} s:\n{c.tail()}")
                time.sleep(0.05)

    def _watch(self) -> None:
        reported = set()
        while not self._stopping:
            for c in self.children:
                if c.proc.poll() is not None and c.name not in reported:
                    reported.add(c.name)
                    log.error("%s exited with %s; last lines:\n%s", c.name, c.proc.returncode, c.tail(15))
            time.sleep(0.5)

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
        self._stopping = True
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


def _release(c: "Child") -> None:
    """What a stopped child could not clean up itself: its shared-memory segments."""
    from traffic.memory import remove_segments

    n = remove_segments(c.proc.pid)
    if n:
        log.info("removed %d shared-memory segments left by %s", n, c.name)


class LocalCluster(Supervisor):
    """A scheduler and xPyD engines on this host."""

    def __init__(self, spec: ClusterSpec, run_dir: str | None = None):
        super().__init__(run_dir, spec.torch_threads, spec.log_level)
        self.spec = spec
        self.scheduler_address = ""
        self.scheduler_http = ""
        self.engine_addresses: dict[str, str] = {}

    def _engine_args(self, role: str, index: int, device_index: int) -> list[str]:
        s = self.spec
        device = f"cuda:{device_index}" if s.device == "cuda" else s.device
        name = f"{role}-{index}"
        node = f"{role}-node{index // s.engines_per_node}"
        args = ["engine", "--role", role, "--model", s.model, "--scheduler", self.scheduler_address,
                "--engine-id", name, "--node-id", node, "--group-id", node if s.engines_per_node > 1 else "",
                "--device", device, "--dtype", s.dtype, "--kv-cache-dtype", s.kv_cache_dtype,
                "--kernels", s.kernels, "--transport", s.transport,
                "--host", s.host, "--block-size", str(s.block_size), "--buffer-bytes", str(s.buffer_bytes),
                "--cache-bytes", str(s.cache_bytes), "--gpu-memory-utilization", str(s.gpu_memory_utilization),
                "--workspace-tokens", str(s.workspace_tokens),
                "--storage-read-bps", str(s.storage_read_bps), "--storage-capacity", str(s.storage_capacity),
                "--compute-quota-ms", str(s.compute_quota_ms),
                "--torch-threads", str(s.torch_threads), "--max-model-len", str(s.max_model_len)]
        if s.enforce_eager:
            args.append("--enforce-eager")
        if s.quantization:
            args += ["--quantization", s.quantization]
        if s.speculative_config:
            args += ["--speculative-config", s.speculative_config]
        if s.lora_modules:
            args += ["--lora-modules", *(f"{m.name}={m.path}" for m in s.lora_modules)]
        if s.kv_store:
            args += ["--kv-store", s.kv_store]
        if s.cost_model:
            args += ["--cost-model", s.cost_model]
        return args + list(s.extra_engine_args)

    def start(self, timeout: float = 300.0) -> "LocalCluster":
        s = self.spec
        try:
            self._start_scheduler(s.scheduler_port, timeout)
            engines = [self.spawn(f"prefill-{i}", self._engine_args("prefill", i, i)) for i in range(s.num_prefill)]
            engines += [self.spawn(f"decode-{i}", self._engine_args("decode", i, s.num_prefill + i))
                        for i in range(s.num_decode)]
            self.wait_ready(engines, timeout)
            for c in engines:
                eid, addr = c.ready_path.read_text().split()
                self.engine_addresses[eid] = addr
            threading.Thread(target=self._watch, daemon=True, name="cluster-watch").start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_scheduler(self, port: int, timeout: float) -> None:
        s = self.spec
        args = ["scheduler", "--host", s.host, "--port", str(port), "--mode", s.mode, "--policy", s.policy,
                "--heartbeat-timeout", str(s.heartbeat_timeout_s), "--http-port", str(s.scheduler_http_port),
                "--scheduling-policy", s.scheduling_policy]
        if s.kv_store:
            args += ["--kv-store", s.kv_store]
        if s.load_every_hit:
            args.append("--load-every-hit")
        if not s.priority_preemption:
            args.append("--disable-priority-preemption")
        sched = self.spawn("scheduler", args)
        self.wait_ready([sched], timeout)
        port, http = sched.ready_path.read_text().split()
        self.scheduler_address = f"{s.host}:{port}"
        self.scheduler_http = f"http://{s.host}:{http}" if int(http) >= 0 else ""

    def restart_scheduler(self, timeout: float = 60.0) -> None:
        """Start the scheduler again on its port (after it died, or stopping it first): the engines register with
        it again keeping their work, and clients submit again what it had not yet handed to a decode engine."""
        old = self.child("scheduler")
        if old.proc.poll() is None:
            old.proc.terminate()
            old.proc.wait(30)
        self.children.remove(old)
        self._start_scheduler(int(self.scheduler_address.rsplit(":", 1)[1]), timeout)

    def add_engine(self, role: str, timeout: float = 120.0) -> str:
        """Start one more engine of ``role`` (the next index) and wait until it serves: a replacement in a rolling
        restart (stop the old one after: its replies move here), or more capacity. Returns its name."""
        index = sum(c.name.startswith(f"{role}-") for c in self.children)
        first_device = self.spec.num_prefill if role == "decode" else 0
        child = self.spawn(f"{role}-{index}", self._engine_args(role, index, first_device + index))
        self.wait_ready([child], timeout)
        eid, addr = child.ready_path.read_text().split()
        self.engine_addresses[eid] = addr
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
    device: str = "cpu"  # "cuda" gives engine i the device cuda:i
    node_id: str = ""  # default: the host name
    host: str = "127.0.0.1"  # the address peers reach these engines at
    base_port: int = 0  # engine i listens on base_port + i (0: any free port)
    torch_threads: int = 0  # per engine (0: the cores shared out)
    engine_args: tuple[str, ...] = ()  # for every ``dualpath engine``: --model, --transport, --kv-store, ...
    log_level: str = "INFO"


class NodeEngines(Supervisor):
    """Start a node's engines, wait for them, and end them all when one ends (the pod or job step restarts)."""

    def __init__(self, spec: NodeSpec, run_dir: str | None = None):
        threads = spec.torch_threads or max(1, (os.cpu_count() or 1) // max(1, spec.engines))
        super().__init__(run_dir, threads, spec.log_level)
        self.spec = spec

    def engine_args(self, index: int) -> list[str]:
        s = self.spec
        node = s.node_id or socket.gethostname()
        device = f"cuda:{index}" if s.device == "cuda" else s.device
        return ["engine", "--role", s.role, "--scheduler", s.scheduler, "--engine-id", f"{s.role}-{node}-{index}",
                "--node-id", node, "--group-id", f"{s.role}-{node}", "--device", device, "--host", s.host,
                "--port", str(s.base_port + index if s.base_port else 0), "--torch-threads", str(self.torch_threads),
                *s.engine_args]

    def start(self, timeout: float = 600.0) -> "NodeEngines":
        try:
            children = [self.spawn(f"{self.spec.role}-{i}", self.engine_args(i)) for i in range(self.spec.engines)]
            self.wait_ready(children, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait(self) -> int:
        """Block until an engine exits (then stop the others) or ``stop`` is called; the exit code to report."""
        while not self._stopping:
            for c in self.children:
                if c.proc.poll() is not None:
                    log.error("%s exited with %s; stopping this node's engines:\n%s", c.name, c.proc.returncode,
                              c.tail(15))
                    self.stop()
                    return c.proc.returncode or 1
            time.sleep(0.5)
        return 0


__all__ = ["ClusterSpec", "LocalCluster", "NodeEngines", "NodeSpec", "Supervisor"]
