"""Intra-engine scheduling for prefill: FIFO batches under a compute quota (the paper's §6, 300 ms default).

Each request contributes ``(cached, new)`` tokens; a fitted cost model predicts the batch's prefill time. Whole
requests join FIFO while the prediction stays under the quota; the first that does not fit is chunk-prefilled
with the largest chunk that does (binary search over whole blocks), and the batch closes. Pure functions of
plain data: the engine passes its queue, the model and the quota.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class CostModel:
    """``t = fixed + per_token × Σ new + attention × Σ new × (cached + new / 2)`` seconds.

    The last term is the work of causal attention over cached plus new tokens; the per-token term covers the
    projections and MLP. Fitted from timed forwards at engine start (``fit``), or given in the config.
    """

    fixed: float = 0.0
    per_token: float = 1e-4
    attention: float = 0.0

    def predict(self, items: Sequence[tuple[int, int]]) -> float:
        if not items:
            return 0.0
        new = sum(n for _, n in items)
        attn = sum(n * (c + n / 2) for c, n in items)
        return self.fixed + self.per_token * new + self.attention * attn

    def tokens_in(self, seconds: float) -> int:
        """New tokens one batch prefills in ``seconds`` by the per-token term (attention over cached tokens left
        out): the scheduler's beta for 5 s."""
        return int(max(0.0, seconds - self.fixed) / self.per_token) if self.per_token > 0 else 0

    @classmethod
    def fit(cls, samples: Sequence[tuple[Sequence[tuple[int, int]], float]]) -> "CostModel":
        """Non-negative least squares over (batch items, measured seconds) samples."""
        rows = np.array([[1.0, sum(n for _, n in it), sum(n * (c + n / 2) for c, n in it)] for it, _ in samples])
        y = np.array([t for _, t in samples])
        active = [0, 1, 2]
        while True:  # drop a negative coefficient and refit: tiny NNLS for three unknowns
            coef, *_ = np.linalg.lstsq(rows[:, active], y, rcond=None)
            if (coef >= 0).all() or len(active) == 1:
                break
            active.pop(int(np.argmin(coef)))
        full = np.zeros(3)
        full[active] = np.maximum(coef, 0)
        return cls(*map(float, full))


@dataclass(frozen=True)
class Pending:
    """A request waiting for prefill: ``cached`` tokens already have KV, ``remaining`` prompt tokens do not."""

    request_id: str
    cached: int
    remaining: int


def form_batch(
    queue: Sequence[Pending],
    model: CostModel,
    quota_s: float,
    block_size: int,
    max_tokens: int | None = None,
    max_blocks: int | None = None,
) -> list[tuple[str, int]]:
    """(request id, new tokens this batch) for a FIFO prefix of ``queue``.

    ``max_tokens`` bounds the batch's new tokens and ``max_blocks`` the workspace blocks it needs (each request
    needs ``ceil((cached + new) / block_size)``). The head of the queue always makes progress: if not even one
    block of it fits the quota, it runs alone with one block.
    """
    out: list[tuple[str, int]] = []
    items: list[tuple[int, int]] = []
    blocks = tokens = 0

    def fits(c: int, n: int) -> bool:
        if max_tokens is not None and tokens + n > max_tokens:
            return False
        if max_blocks is not None and blocks + -(-(c + n) // block_size) > max_blocks:
            return False
        return model.predict(items + [(c, n)]) <= quota_s

    for p in queue:
        if fits(p.cached, p.remaining):
            n = p.remaining
        else:
            n = _largest_chunk(p, fits, block_size)
            if n == 0:
                if not out:  # progress guarantee for the head of the queue
                    n = min(p.remaining, block_size - p.cached % block_size)
                else:
                    break
        out.append((p.request_id, n))
        items.append((p.cached, n))
        blocks += -(-(p.cached + n) // block_size)
        tokens += n
        if n < p.remaining:
            break  # a chunked request closes the batch
    return out


def _largest_chunk(p: Pending, fits, block_size: int) -> int:
    """Largest chunk that fits and ends on a block boundary (so the next chunk starts aligned); 0 if none."""
    first_end = (p.cached // block_size + 1) * block_size  # end of the block the chunk starts in
    lo, hi = 0, (p.cached + p.remaining - first_end) // block_size + 1  # number of whole block ends to try
    best = 0
    while lo < hi:  # find the largest k with chunk ending at first_end + (k-1) × block_size fitting
        mid = (lo + hi + 1) // 2
        n = first_end + (mid - 1) * block_size - p.cached
        if 0 < n < p.remaining and fits(p.cached, n):
            best, lo = n, mid
        else:
            hi = mid - 1
    return best
