"""A peer process that owns one registered region filled with a known pattern and answers commands over a
pipe: the far side for transport contract tests and benchmarks. ``PeerProcess`` starts and drives it."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal

import torch

from dualpath.core.config import TransportConfig
from dualpath.traffic.memory import remove_segments
from dualpath.traffic.transport.base import RegionDesc


def pattern(seed: int, nbytes: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().numpy().tobytes(), digest_size=16).hexdigest()


def serve(conn, config: TransportConfig, endpoint: str, nbytes: int) -> None:
    torch.set_num_threads(1)
    from dualpath.traffic.transport import make_transport

    t = make_transport(config, endpoint)
    mem = t.allocate(nbytes)
    mem.tensor.copy_(pattern(7, nbytes))
    t.register(mem)
    conn.send((t.address(), [r.to_dict() for r in t.regions()]))
    while True:
        cmd, arg = conn.recv()
        if cmd == "digest":
            lo, hi = arg
            conn.send(digest(mem.tensor[lo:hi]))
        elif cmd == "exit":
            t.close()
            mem.close()  # unlinks its shared segment: os._exit runs no finalizer
            conn.send("bye")
            os._exit(0)  # NIXL crashes at interpreter exit otherwise


class PeerProcess:
    """Start ``serve`` in a spawned process; ``info`` is its (address, region descriptors)."""

    def __init__(self, config: TransportConfig, nbytes: int, endpoint: str = "peer", start_timeout: float = 60):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, config, endpoint, nbytes), daemon=True)
        self.proc.start()
        if not self.conn.poll(start_timeout):
            self.proc.kill()
            raise RuntimeError(f"{config.name} peer did not start")
        address, regions = self.conn.recv()
        self.address, self.regions = address, [RegionDesc.from_dict(r) for r in regions]

    def digest(self, lo: int, hi: int) -> str:
        self.conn.send(("digest", (lo, hi)))
        if not self.conn.poll(60):
            raise RuntimeError("peer did not answer")
        return self.conn.recv()

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)
        remove_segments(self.proc.pid)  # it could not unlink its own

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit", None))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
            remove_segments(self.proc.pid)
