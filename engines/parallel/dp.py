"""Data-parallel attention: D engines that attend over their own requests and share an MoE model's experts.

Each engine of the group is a whole engine to the scheduler (its own requests, paged KV cache, DRAM buffer and
traffic manager) holding every weight but the routed experts, of which it holds E/D. In every MoE layer the
engines exchange their tokens (``dualpath.engines.experts``, each rank's own tokens), so a forward on one engine
needs all of them: the collectives of the group must come in the same order on every engine.

The protocol, a sequence of units on every engine:
- a **sync**: an all-gather of (whether this engine starts a forward now, its last forward's own seconds). An
  engine syncs at the start of each forward (``CausalLM.begin``) and, when it has none to run, at each turn of its
  loop (``idle``);
- if any engine of the group started a forward, **one dispatch per MoE layer**, in layer order: the engines with a
  forward run it, the others an idle pass (no tokens of their own; their experts still serve the others' tokens).
A forward stopped part way (a layer's KV failed to arrive) runs its missing dispatches idle (``settle``). Units pair
up by order whatever each engine does between them, so no engine needs to know what the others are doing; any other
use of the group's collectives would break the pairing.

Balance (the paper's "all GPUs of an EP group finish attention at the same time", max/avg 1.06): each sync carries
the engine's last forward time outside the MoE exchanges, so every engine knows the group's max/avg of it.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from dualpath.core.config import ParallelConfig
from dualpath.core.errors import RankLostError
from dualpath.engines.comm import Comm, join
from dualpath.engines.experts import Compute, Dispatch

log = logging.getLogger(__name__)


class DPGroup(Dispatch):
    """This engine's hold on its data-parallel group; its MoE layers dispatch through it (it counts them).
    Called from the engine's loop thread only."""

    def __init__(self, comm: Comm, inner: Dispatch, on_lost: Callable[[str], None] | None = None):
        super().__init__(comm, inner.experts, replicated=False)
        self.inner, self.on_lost = inner, on_lost
        self.layers: list = []  # the model's MoE blocks in layer order (``attach``)
        self.backend, self.dtype = "torch", torch.float32  # their kernels, the model's activations
        self.done = 0  # dispatches of the current unit so far
        self.started = 0.0  # when this engine's current forward began (0: none)
        self.exchange_s = 0.0  # of it, seconds inside the MoE exchanges (waiting for the others included)
        self.own_s = 0.0  # the last forward's seconds outside them: its attention and dense layers
        self.units = self.forwards = 0
        self.balance: list[float] = []  # max/avg of the engines' own seconds, per unit where all ran a forward

    # --- the protocol -------------------------------------------------------------------------------------------
    def begin_forward(self) -> None:
        """A forward starts on this engine (``CausalLM.begin``): sync, then its dispatches run it."""
        self.settle()
        self._sync(True)
        self.forwards += 1
        self.started, self.exchange_s = time.perf_counter(), 0.0

    def idle(self) -> bool:
        """This engine has no forward to run now: sync, and if another engine started one, serve its MoE layers.
        Returns whether one did."""
        self.settle()
        if not self._sync(False):
            return False
        for moe in self.layers:
            moe.idle(self.backend, self.dtype)
        return True

    def settle(self) -> None:
        """End the current unit: a forward stopped part way runs its missing dispatches idle."""
        if self.started:
            self.own_s = time.perf_counter() - self.started - self.exchange_s
            self.started = 0.0
        for moe in self.layers[self.done :]:
            moe.idle(self.backend, self.dtype)
        self.done = len(self.layers)

    def routed(self, x, weights, ids, compute: Compute, partial=None) -> torch.Tensor:
        start = time.perf_counter()
        try:
            out = self.inner.routed(x, weights, ids, compute)
        except dist.DistError as e:
            self._lose(f"an engine of the data-parallel group stopped answering in an MoE layer: {e}")
        self.done += 1
        if self.started:
            self.exchange_s += time.perf_counter() - start
        return out

    def _sync(self, forward: bool) -> bool:
        """Whether any engine starts a forward in this unit; records the group's balance."""
        try:
            rows = self.comm.gather_objects((forward, self.own_s if forward else 0.0))
        except dist.DistError as e:
            self._lose(f"an engine of the data-parallel group stopped answering: {e}")
        self.units += 1
        busy = [s for f, s in rows if f]
        if busy and len(busy) == len(rows) and min(busy) > 0:
            self.balance.append(max(busy) / (sum(busy) / len(busy)))
            del self.balance[:-256]
        self.done = 0 if busy else len(self.layers)
        return bool(busy)

    def _lose(self, why: str):
        log.error("%s; this engine leaves service", why)
        if self.on_lost is not None:
            self.on_lost(why)
        raise RankLostError(why)

    def stats(self) -> dict:
        """Units synced, forwards run, and the attention time balance: max/avg over the group, mean of recent
        units where every engine ran a forward (None: none yet)."""
        mean = sum(self.balance) / len(self.balance) if self.balance else None
        return {"units": self.units, "forwards": self.forwards, "attention_max_over_avg": mean}


def join_group(p: ParallelConfig, device: str) -> Comm:
    """Join the data-parallel group ``p`` describes (rank 0 hosts its rendezvous at ``data_parallel_master``);
    ``RankLostError`` naming the engine that does not come within ``join_timeout_s``."""
    host, _, port = p.data_parallel_master.rpartition(":")
    store = None
    if p.data_parallel_rank == 0:
        try:
            store = dist.TCPStore(
                host,
                int(port),
                p.data_parallel_size,
                is_master=True,
                timeout=timedelta(seconds=p.join_timeout_s),
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as e:
            raise RankLostError(
                f"cannot host the data-parallel group's rendezvous on {p.data_parallel_master}: {e}"
            ) from None
    return join(p.data_parallel_rank, device, p, host, store=store, port=int(port), size=p.data_parallel_size)


def attach(model, comm: Comm, dispatch: str, on_lost: Callable[[str], None] | None = None) -> DPGroup:
    """Make ``model`` (its experts this engine's E/D, ``TPShard.dp_rank``) one engine of ``comm``'s group: its MoE
    layers dispatch each engine's own tokens by ``dispatch``, and each forward syncs first."""
    from dualpath.engines.models.moe import MoE
    from dualpath.engines.experts import make_dispatch

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    group = DPGroup(comm, make_dispatch(dispatch, comm, layers[0].part.experts, replicated=False), on_lost)
    group.layers, group.backend, group.dtype = layers, model.kernels, model.embed_tokens.dtype
    for moe in layers:
        moe.dispatch = group
    model.dp = group
    return group
