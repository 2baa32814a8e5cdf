"""An engine's ranks as processes: rank 0 (the engine process itself) starts the others, and every model step it
takes runs on all of them (``Ranks.run``).

Rank 0 decides everything (batches, block tables, buffer slots, what moves where); it sends each step, a function
of ``dualpath.engines.parallel.steps`` and its plain arguments, down a pipe to every other rank, then runs it itself. The
ranks meet in the step's collectives (the layers' reductions, ``Comm.agree``), so they run in lockstep without
replies. A rank that dies takes the engine out of service: its pipe breaks or its collectives fail (bounded by
``collective_timeout_s``), rank 0's watcher sees its process end, and the engine stops with the rank, its exit
code and the reason in the log. Rank 0 dying ends the others (their pipe reaches EOF, or a collective fails).
The other ranks are ``python -m dualpath.engines.parallel.ranks`` processes (not ``multiprocessing``'s spawn, which would
import the user's ``__main__`` again: a script without a main guard would start engines recursively).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Callable

import torch
import torch.distributed as dist

from dualpath.core.config import EngineConfig, ModelConfig
from dualpath.core.errors import ConfigError, RankLostError
from dualpath.core.geometry import HeadShard
from dualpath.engines.models import load_model
from dualpath.engines.comm import Comm, TPShard, join, open_store
from dualpath.engines.parallel.steps import STEPS, RankState, StepAborted

log = logging.getLogger(__name__)
RANK_EXIT_GRACE_S = 1.0  # after a failed collective, how long rank 0 waits for a watcher to name a rank that exited
READY_TIMEOUT_S = 1800.0  # loading a rank's weights (a 660B model's 1/8 from a network filesystem) may take this


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to build its part of an engine: the checkpoint, the engine's config (device, dtype,
    kernels, quantization, parallelism) and where rank 0's rendezvous listens."""

    model: str
    engine: EngineConfig
    host: str = "127.0.0.1"
    torch_threads: int = 0
    log_level: int = logging.INFO

    @property
    def size(self) -> int:
        return self.engine.parallel.tensor_parallel_size

    def device(self, rank: int) -> str:
        return self.engine.parallel.rank_device(self.engine.device, rank)

    def load(self, rank: int, comm: Comm | None):
        e = self.engine
        p = e.parallel
        shard = TPShard(rank, self.size, p.enable_expert_parallel, p.data_parallel_rank, p.data_parallel_size)
        model = load_model(self.model, self.device(rank), e.dtype, e.kernels, e.weight_quant, shard)
        if comm is not None:
            model.connect(comm, e.parallel.moe_dispatch)
        return model


def check_parallel(model: ModelConfig, engine: EngineConfig) -> None:
    """``ConfigError`` with the numbers, before any process starts, when ``engine``'s parallelism cannot serve
    ``model``: a size that does not divide the heads, the vocabulary or the MLP; an architecture not yet served
    sharded; more ranks than devices."""
    size = engine.parallel.tensor_parallel_size
    _check_data_parallel(model, engine.parallel)
    if size == 1:
        return
    for what, n in (
        ("attention heads", model.num_heads),
        ("vocab_size", model.vocab_size),
        ("intermediate_size", model.intermediate_size),
        *_moe_dims(model, engine.parallel),
    ):
        if n % size:
            raise ConfigError(f"--tensor-parallel-size {size} does not divide the model's {what} ({n})")
    try:
        if model.mla is None:  # (MLA's latent row is whole on every rank)
            HeadShard(model.num_kv_heads, model.head_dim, 0, size)
    except ConfigError as e:
        raise ConfigError(f"--tensor-parallel-size {size}: {e}") from None
    if engine.device.startswith("cuda"):
        first = int(engine.device.partition(":")[2] or 0)
        have = torch.cuda.device_count()
        if first + size > have:
            raise ConfigError(
                f"--tensor-parallel-size {size} from {engine.device} needs devices cuda:{first}.."
                f"cuda:{first + size - 1}, but this host has {have} GPU(s)"
            )


def _check_data_parallel(model: ModelConfig, p) -> None:
    """Data-parallel attention shares an MoE model's experts among the group's engines: one that has none, or
    experts that do not divide among them, is refused."""
    d = p.data_parallel_size
    if d == 1:
        return
    if model.moe is None:
        raise ConfigError(
            f"--data-parallel-size {d}: data-parallel attention splits an MoE model's experts among "
            f"its engines; {model.architecture} has none (run {d} engines of their own instead)"
        )
    if model.moe.num_experts % d:
        raise ConfigError(
            f"--data-parallel-size {d} does not divide the model's {model.moe.num_experts} routed experts"
        )


def _moe_dims(model: ModelConfig, parallel) -> list[tuple[str, int]]:
    """What an MoE model's parallelism splits: whole routed experts under expert parallelism, else each expert's
    intermediate rows; the shared experts' rows either way."""
    e = model.moe
    if e is None:
        return []
    routed = (
        ("routed experts (--enable-expert-parallel)", e.num_experts)
        if parallel.enable_expert_parallel
        else ("moe_intermediate_size (or pass --enable-expert-parallel)", e.moe_intermediate_size)
    )
    return [routed, ("shared experts' intermediate size", e.moe_intermediate_size * e.num_shared_experts)]


class Ranks:
    """Rank 0's hold on its engine's ranks (at TP 1, on itself alone: ``run`` is a plain call)."""

    def __init__(
        self, state: RankState, procs: list = (), conns: list = (), on_lost: Callable[[str], None] | None = None
    ):
        self.state, self.procs, self.conns, self.on_lost = state, list(procs), list(conns), on_lost
        self.lost: str | None = None  # why the engine's ranks can no longer work together
        self._lock = threading.RLock()  # one step at a time, whichever thread asks (steps nest: RLock)
        self._closing = False
        for rank, p in enumerate(self.procs, 1):
            threading.Thread(target=self._watch, args=(rank, p), daemon=True, name=f"rank-{rank}-watch").start()

    @property
    def size(self) -> int:
        return 1 + len(self.procs)

    def run(self, step, *args, **local):
        """Run ``step(state, *args, **local)`` on every rank (``local``: rank 0's own arguments, never sent) and
        return rank 0's result. ``RankLostError`` once any rank is gone."""
        with self._lock:
            if self.lost:
                raise RankLostError(self.lost)
            try:
                msg = pickle.dumps((step.__name__, args))  # plain pickle: tensors go by value, not by fd
                for c in self.conns:
                    c.send_bytes(msg)
                return step(self.state, *args, **local)
            except (OSError, dist.DistError) as e:  # (``comm.CollectiveError`` included)
                # A rank that died fails the collectives at once, a moment before its watcher sees the process
                # end: wait that moment (bounded) so the engine's reason names the rank and how it ended.
                deadline = time.monotonic() + RANK_EXIT_GRACE_S
                while self.lost is None and time.monotonic() < deadline:
                    time.sleep(0.01)
                self._lose(f"a rank stopped answering during {step.__name__}: {e}")
                raise RankLostError(self.lost or str(e)) from None

    def _watch(self, rank: int, p: subprocess.Popen) -> None:
        code = p.wait()
        self._lose(f"rank {rank} (pid {p.pid}, {self.state.device_of(rank)}) exited {_exit_text(code)}")

    def _lose(self, why: str) -> None:
        if self.lost is None and not self._closing:
            self.lost = why
            log.error("tensor-parallel engine lost a rank: %s; the engine leaves service", why)
            if self.on_lost is not None:
                self.on_lost(why)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the other ranks (each ends its loop at ``None``), then leave the group."""
        self._closing = True
        for c in self.conns:
            try:
                c.send_bytes(pickle.dumps(None))
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        self.state.close()


def start_ranks(spec: RankSpec, on_lost: Callable[[str], None] | None = None) -> Ranks:
    """Rank 0 here, the others as processes; returns once every rank has loaded its part of the weights.
    ``RankLostError`` names the rank that failed to join or load."""
    if spec.size == 1:
        return Ranks(RankState(spec.load(0, None), None, spec.device(0)))
    parallel = spec.engine.parallel
    store = open_store(spec.host, parallel)
    procs, conns = [], []
    for rank in range(1, spec.size):
        ours, theirs = socket.socketpair()
        p = subprocess.Popen(
            [sys.executable, "-m", "dualpath.engines.parallel.ranks", str(theirs.fileno())], pass_fds=(theirs.fileno(),)
        )
        theirs.close()
        conn = Connection(ours.detach())
        conn.send((spec, rank, store.port))
        procs.append(p)
        conns.append(conn)
    comm = None
    try:
        comm = join(0, spec.device(0), parallel, spec.host, store=store, gone=lambda r: _gone(procs[r - 1]))
        state = RankState(spec.load(0, comm), comm, spec.device(0), spec)
        _await_loaded(conns, procs)
    except BaseException:
        for p in procs:
            p.kill()
        if comm is not None:  # this process may start another engine
            comm.close()
        raise
    log.info("tensor-parallel engine of %d ranks ready (rendezvous %s)", spec.size, comm.master)
    return Ranks(state, procs, conns, on_lost)


def _gone(p: subprocess.Popen) -> str | None:
    return None if p.poll() is None else f"its process exited {_exit_text(p.returncode)}"


def _exit_text(code: int | None) -> str:
    if code is None:
        return "(still running)"
    return f"with code {code}" if code >= 0 else f"by signal {signal.Signals(-code).name}"


def _await_loaded(conns: list, procs: list) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    for rank, (c, p) in enumerate(zip(conns, procs), 1):
        while not c.poll(0.2):
            if p.poll() is not None or time.monotonic() > deadline:
                why = _gone(p) or f"not ready after {READY_TIMEOUT_S:.0f} s"
                raise RankLostError(f"rank {rank} failed to load its part of the model: {why}")
        status, detail = c.recv()
        if status != "ready":
            raise RankLostError(f"rank {rank} failed to load its part of the model: {detail}")


def follow(spec: RankSpec, rank: int, port: int, conn) -> None:
    """A rank other than 0: join, load this rank's part, then run the steps rank 0 sends until it says stop (or is
    gone). Any failure ends the process: the engine cannot go on with a rank out of step."""
    torch.set_num_threads(spec.torch_threads or 1)
    logging.basicConfig(
        level=spec.log_level, stream=sys.stderr, format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s"
    )
    try:
        comm = join(rank, spec.device(rank), spec.engine.parallel, spec.host, port=port)
        state = RankState(spec.load(rank, comm), comm, spec.device(rank), spec)
        conn.send(("ready", rank))
    except BaseException as e:  # noqa: BLE001 - rank 0 reports it, naming this rank
        log.exception("rank %d could not start", rank)
        _send_quietly(conn, ("error", f"{type(e).__name__}: {e}"))
        os._exit(1)
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            log.error("rank 0 is gone; rank %d stops", rank)
            os._exit(1)
        if msg is None:
            break
        name, args = msg
        try:
            STEPS[name](state, *args)
        except StepAborted:
            continue
        except BaseException:  # noqa: BLE001 - out of step with rank 0 from here on
            log.exception("rank %d failed in step %s; it stops", rank, name)
            os._exit(1)
    state.close()
    os._exit(0)


def _send_quietly(conn, msg) -> None:
    try:
        conn.send(msg)
    except OSError:
        pass


if __name__ == "__main__":  # a rank other than 0: its spec comes first down the pipe from rank 0
    _conn = Connection(int(sys.argv[1]))
    follow(*_conn.recv(), _conn)
