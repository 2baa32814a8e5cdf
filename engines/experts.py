"""Expert parallelism: which routed experts each rank of an engine holds, and how an MoE layer's tokens reach them.

An MoE layer routes each token to ``k`` experts; under expert parallelism (``--enable-expert-parallel``) rank r holds
experts ``[r·E/N, (r+1)·E/N)`` (``ExpertMap``, vLLM's contiguous expert map). A ``Dispatch`` moves each (token,
expert) pair to the rank holding the expert and the weighted output back: by all-to-all (``AllToAllDispatch``, the
DeepEP shape: each pair crosses the network once each way) or by all-gather and reduction (``AllGatherDispatch``,
for a backend without all-to-all, and the simplest where every rank holds the same tokens already). A DeepEP or
NIXL-EP backend is a third ``Dispatch``.

Tokens are ``replicated`` when attention is tensor-parallel (after its all-reduce every rank holds every token) or
each rank's own when attention is data-parallel (each rank attends over its own requests).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from dualpath.core.errors import ConfigError

DISPATCHES = ("all_to_all", "all_gather")

# compute(x [P, H], local expert ids [P], weights [P]) -> weight × expert(x) [P, H]: this rank's experts on pairs
Compute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ExpertMap:
    """Rank ``rank`` of ``size`` holds routed experts ``[first, first + per_rank)``."""

    num_experts: int
    rank: int = 0
    size: int = 1

    def __post_init__(self):
        if self.num_experts % self.size:
            raise ConfigError(
                f"{self.num_experts} routed experts do not divide among {self.size} expert-parallel "
                f"ranks; use a size that divides {self.num_experts}"
            )

    @property
    def per_rank(self) -> int:
        return self.num_experts // self.size

    @property
    def first(self) -> int:
        return self.rank * self.per_rank

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        """The rank holding each expert of ``ids``."""
        return torch.div(ids, self.per_rank, rounding_mode="floor")


def local_pairs(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: ExpertMap, compute: Compute
) -> torch.Tensor:
    """``[T, H]``: for each row of ``x``, the weighted sum of those of its experts (``ids [T, k]``) this rank holds
    (zero where it holds none)."""
    mine = (ids >= experts.first) & (ids < experts.first + experts.per_rank)
    token, slot = torch.nonzero(mine, as_tuple=True)
    out = torch.zeros_like(x)
    if token.numel():
        out.index_add_(0, token, compute(x[token], ids[token, slot] - experts.first, weights[token, slot]))
    return out


class Dispatch(ABC):
    """Moves an MoE layer's (token, expert) pairs to the ranks holding the experts and their outputs back.

    ``MoE.add_to`` calls ``routed`` on every rank of the engine, layer by layer in the same order (each call is a
    few collectives: a rank that skips one hangs the others until the collective timeout). It may not change the
    routing, keep state between calls, or reorder rows."""

    def __init__(self, comm, experts: ExpertMap, replicated: bool):
        self.comm, self.experts, self.replicated = comm, experts, replicated

    @abstractmethod
    def routed(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        compute: Compute,
        partial: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Each row of ``x [T, H]``'s routed experts' weighted sum (routing ``weights``, ``ids [T, k]``), plus the
        sum over ranks of ``partial [T, H]`` (a tensor-parallel shared expert's part, replicated tokens only; a
        backend that reduces anyway adds it in the same reduction)."""


class AllGatherDispatch(Dispatch):
    """Every rank sees every token and runs its own experts on them; the partial sums are added up. With replicated
    tokens that is one all-reduce (the shared expert's part rides in it); with each rank's own tokens, the tokens
    and routing are all-gathered first and the sums reduce-scattered back."""

    def routed(self, x, weights, ids, compute, partial=None):
        if self.replicated:
            out = local_pairs(x, weights, ids, self.experts, compute)
            return self.comm.all_reduce(out if partial is None else out.add_(partial))
        counts = self.comm.gather_objects(x.shape[0])
        most = max(counts)
        if most == 0:  # no rank has a token (every rank agrees: the counts are everyone's)
            return torch.zeros_like(x)
        every = [self.comm.all_gather(_pad(t, most), dim=0) for t in (x, weights, ids)]
        keep = torch.cat([torch.arange(n) + r * most for r, n in enumerate(counts)]).to(x.device)
        out = local_pairs(*(t.index_select(0, keep) for t in every), self.experts, compute)
        rows = torch.zeros(len(counts) * most, x.shape[1], dtype=x.dtype, device=x.device).index_copy_(0, keep, out)
        mine = self.comm.reduce_scatter(rows)
        return mine[: x.shape[0]]


class AllToAllDispatch(Dispatch):
    """Each pair goes to its expert's rank and back by all-to-all with per-rank counts. With replicated tokens each
    rank dispatches its share of the rows (1/N of them) and the rows are all-gathered at the end, so no pair is
    computed twice."""

    def routed(self, x, weights, ids, compute, partial=None):
        rows = (
            torch.tensor_split(torch.arange(x.shape[0], device=x.device), self.comm.size)[self.comm.rank]
            if self.replicated
            else None
        )
        mine = x if rows is None else x.index_select(0, rows)
        out = self._exchange(
            mine,
            weights if rows is None else weights.index_select(0, rows),
            ids if rows is None else ids.index_select(0, rows),
            compute,
        )
        if rows is not None:
            out = self._gather_rows(out, x.shape[0])
        return out if partial is None else out.add_(self.comm.all_reduce(partial))

    def _exchange(self, x, weights, ids, compute) -> torch.Tensor:
        k = ids.shape[1]
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)
        ids, weights = ids.reshape(-1), weights.reshape(-1)
        order = torch.argsort(self.experts.owner(ids), stable=True)
        token, ids, weights = token[order], ids[order], weights[order]
        send = torch.bincount(self.experts.owner(ids), minlength=self.comm.size)
        recv = self.comm.all_to_all(send)  # how many pairs each rank sends this one
        send, recv = send.tolist(), recv.tolist()
        got_x = self.comm.all_to_all(x.index_select(0, token), recv, send)
        got_ids = self.comm.all_to_all(ids, recv, send)
        got_w = self.comm.all_to_all(weights, recv, send)
        y = compute(got_x, got_ids - self.experts.first, got_w) if got_x.shape[0] else got_x
        back = self.comm.all_to_all(y, send, recv)
        return torch.zeros_like(x).index_add_(0, token, back)

    def _gather_rows(self, out: torch.Tensor, total: int) -> torch.Tensor:
        """Every rank's share of the rows (``tensor_split``'s, so sizes differ by at most one), in order."""
        most = -(-total // self.comm.size)
        every = self.comm.all_gather(_pad(out, most), dim=0)
        sizes = [len(s) for s in torch.tensor_split(torch.arange(total), self.comm.size)]
        return torch.cat([every[r * most : r * most + n] for r, n in enumerate(sizes)])


def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if t.shape[0] < rows else t


def make_dispatch(kind: str, comm, experts: ExpertMap, replicated: bool) -> Dispatch:
    """The ``kind`` backend (``DISPATCHES``)."""
    if kind == "all_to_all":
        return AllToAllDispatch(comm, experts, replicated)
    if kind == "all_gather":
        return AllGatherDispatch(comm, experts, replicated)
    raise ConfigError(f"unknown MoE dispatch {kind!r}; one of {', '.join(DISPATCHES)}")
