"""The ranks of one engine as a ``torch.distributed`` group: who they are, how they meet, and the collectives the
model layers and the step protocol use.

Rendezvous is a TCP store that rank 0 hosts; each rank announces itself under ``joined/<rank>``, so rank 0 can say
which rank never came, and where it was expected. Tensors on CUDA go through NCCL, everything else (CPU engines,
the step protocol's agreement flags) through gloo; every collective is bounded by ``collective_timeout_s``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from dualpath.core.config import ParallelConfig
from dualpath.core.errors import CheckpointError, RankLostError


@dataclass(frozen=True)
class TPShard:
    """Tensor-parallel rank ``rank`` of ``size``: which part of each split dimension it holds. ``expert_parallel``:
    an MoE layer's routed experts are split among the ranks whole (``dualpath.engines.experts``), not each expert's
    matrices among all of them."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False
    dp_rank: int = 0  # data-parallel attention: this engine's place in its group, whose engines split the experts
    dp_size: int = 1

    def split(self, n: int, what: str) -> tuple[int, int]:
        """``[start, stop)`` of this rank's equal part of ``n`` (``what``: named in the error if it does not
        divide)."""
        if n % self.size:
            raise CheckpointError(f"{what} ({n}) does not divide among {self.size} tensor-parallel ranks")
        k = n // self.size
        return self.rank * k, (self.rank + 1) * k


class CollectiveError(dist.DistError):
    """A collective among an engine's ranks failed: a rank died (its connections reset), hung past
    ``collective_timeout_s``, or their link broke. The ranks are out of step from here on (``Ranks.run`` takes the
    engine out of service)."""


def _collective(what: str, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` (a ``torch.distributed`` collective), its failure a ``CollectiveError``. gloo reports
    a peer that died or timed out as a plain ``RuntimeError`` (NCCL's are ``DistError``s already): unwrapped, an
    engine took it for a failed batch and went on with its ranks out of step (its requests failed instead of moving:
    tests/cluster/test_tp_cluster.py)."""
    try:
        return fn(*args, **kwargs)
    except dist.DistError:
        raise
    except RuntimeError as e:
        raise CollectiveError(f"{what} failed: {e}") from e


class Comm:
    """Collectives among one engine's ranks. The layers call ``all_reduce`` / ``all_gather`` on every rank in the
    same order; ``agree`` is the step protocol's flag (all ranks learn whether every rank may go on)."""

    def __init__(self, rank: int, size: int, device_group, cpu_group, master: str):
        self.rank, self.size, self.master = rank, size, master
        self._dev, self._cpu = device_group, cpu_group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        _collective("all_reduce", dist.all_reduce, x, group=self._dev)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        _collective("all_gather", dist.all_gather, parts, x, group=self._dev)
        return torch.cat(parts, dim)

    def all_to_all(
        self, x: torch.Tensor, out_splits: list[int] | None = None, in_splits: list[int] | None = None
    ) -> torch.Tensor:
        """Rows ``x`` cut by ``in_splits`` (one part to each rank, in rank order) exchanged for the parts every rank
        sends this one (``out_splits`` rows from each); None: equal parts."""
        x = x.contiguous()
        out = x.new_empty(sum(out_splits) if out_splits is not None else x.shape[0], *x.shape[1:])
        _collective("all_to_all", dist.all_to_all_single, out, x, out_splits, in_splits, group=self._dev)
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``x [N·m, ...]``, of which this rank gets rows ``[rank·m, (rank+1)·m)``."""
        out = x.new_empty(x.shape[0] // self.size, *x.shape[1:])
        _collective("reduce_scatter", dist.reduce_scatter_tensor, out, x.contiguous(), group=self._dev)
        return out

    def agree(self, ok: bool) -> bool:
        """True when every rank passed ``ok`` True; a barrier besides."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        _collective("agree", dist.all_reduce, flag, op=dist.ReduceOp.MIN, group=self._cpu)
        return bool(flag.item())

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj`` (small, picklable: a digest, an error's text), in rank order, on every rank."""
        out = [None] * self.size
        _collective("gather_objects", dist.all_gather_object, out, obj, group=self._cpu)
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def open_store(host: str, cfg: ParallelConfig) -> dist.TCPStore:
    """Rank 0's rendezvous store on ``cfg.master_port`` (0: a free port, read back from ``store.port``)."""
    try:
        return dist.TCPStore(
            host,
            cfg.master_port,
            cfg.tensor_parallel_size,
            is_master=True,
            timeout=timedelta(seconds=cfg.join_timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as e:
        raise RankLostError(f"cannot host the ranks' rendezvous on {host}:{cfg.master_port}: {e}") from None


def join(
    rank: int,
    device: str,
    cfg: ParallelConfig,
    host: str,
    store: dist.TCPStore | None = None,
    port: int = 0,
    gone: Callable[[int], str | None] = lambda r: None,
    size: int = 0,
) -> Comm:
    """Join the engine's group as ``rank``: rank 0 passes its ``store`` and waits for every rank to announce itself
    (``gone(r)``: why rank r can no longer come, e.g. its process exited); the others connect to ``host:port``.
    Raises ``RankLostError`` naming the rank and the address when one does not come in ``join_timeout_s``.
    ``size``: the group's (0: the tensor-parallel size; a data-parallel group gives its own)."""
    size, address = size or cfg.tensor_parallel_size, f"{host}:{store.port if store is not None else port}"
    if store is None:
        try:
            store = dist.TCPStore(host, port, size, is_master=False, timeout=timedelta(seconds=cfg.join_timeout_s))
        except (RuntimeError, OSError) as e:
            raise RankLostError(f"rank {rank} could not reach rank 0's rendezvous at {address}: {e}") from None
    store.set(f"joined/{rank}", "1")
    if rank == 0:
        _await_ranks(store, size, cfg.join_timeout_s, address, gone)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    timeout = timedelta(seconds=cfg.collective_timeout_s)
    dist.init_process_group(
        backend, store=dist.PrefixStore("group", store), rank=rank, world_size=size, timeout=timeout
    )
    cpu = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
    _mark_collective_sockets()
    return Comm(rank, size, dist.group.WORLD, cpu, address)


def _mark_collective_sockets() -> None:
    """The group's TCP connections (gloo's, made as the group forms) carry the collectives' high class: the TOS
    byte the engine gave NCCL for RoCE (``NCCL_IB_TC``, from its ``QosConfig``; unset: left unmarked). Ranks join
    before their engine opens any KV socket, so every TCP socket of the process now is the group's (or its
    rendezvous': control traffic, high as well)."""
    tc = os.environ.get("NCCL_IB_TC", "")
    if tc.isdigit():
        from dualpath.traffic.qos import mark_own_sockets

        mark_own_sockets(int(tc), lambda s: True)


def _await_ranks(
    store: dist.TCPStore, size: int, timeout_s: float, address: str, gone: Callable[[int], str | None]
) -> None:
    deadline = time.monotonic() + timeout_s
    for r in range(1, size):
        while not store.check([f"joined/{r}"]):
            why = gone(r)
            if why:
                raise RankLostError(f"rank {r} did not join the engine at {address}: {why}")
            if time.monotonic() > deadline:
                raise RankLostError(f"rank {r} did not join the engine at {address} within {timeout_s:.0f} s")
            time.sleep(0.05)
