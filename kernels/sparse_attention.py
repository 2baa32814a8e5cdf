"""DeepSeek-V3.2's sparse attention (DSA): the lightning indexer's choice of the tokens each query attends to.

Every token has an indexer key (``head_dim`` values stored after MLA's latent and rope key in its cached row). A
query token's indexer heads score each key it may see causally,

    score(q, k) = Σ_h weight_h(q) · relu(scale · q_h · k),

and the query attends to its ``topk`` best-scoring keys only (all of them while it sees no more than ``topk``).
Scores are float32 (as transformers computes them; float64 for float64 inputs). Ties at the cut go to the earliest
tokens: ``topk`` alone breaks them as it likes (differently for rows of other lengths), and they happen (a key
every head scores below zero scores exactly 0), so without a rule a chunked prefill would choose other tokens than
a whole one. The attention itself (``dualpath.kernels.attention.varlen_attention``) reads the keys from the same rows it
attends over, so new keys are scored as the cache holds them. This is the torch reference; ``dualpath.kernels.triton_sparse``
scores with a kernel and chooses with ``_top`` and ``listed`` on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SCORE_ELEMS = 1 << 26  # scores are computed in chunks of at most this many (256 MiB of float32)


@dataclass(frozen=True)
class IndexQuery:
    """The indexer's side of one forward: queries ``q [T, H, D]`` and their heads' weights ``weights [T, H]``
    (packed as the batch's new tokens), where the ``D`` key columns start in a KV row, how many tokens a query
    keeps, and the score's scale."""

    q: torch.Tensor
    weights: torch.Tensor
    key_offset: int
    topk: int
    scale: float

    def choose(self, rows: torch.Tensor, n_cached: int, sl: slice) -> torch.Tensor:
        """One sequence's new tokens (``sl`` of the batch) over its rows ``[C + n, W]`` (cached, then new): a bool
        ``[n, C + n]``, true at the keys each query attends to."""
        n = sl.stop - sl.start
        causal = torch.ones(n, rows.shape[0], dtype=torch.bool, device=rows.device).tril(diagonal=n_cached)
        if rows.shape[0] <= self.topk:
            return causal
        keys, q, w = self._keys(rows), self._cast(self.q[sl]), self._cast(self.weights[sl])
        step = max(1, _SCORE_ELEMS // (q.shape[1] * keys.shape[0]))
        chosen = torch.empty_like(causal)
        for r in range(0, n, step):
            score = self._score(q[r : r + step], w[r : r + step], keys, causal[r : r + step])
            chosen[r : r + step] = _top(score, self.topk)
        return chosen & causal  # a query seeing fewer than topk keys also "chose" some it may not see

    def choose_decode(self, rows: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One new token per sequence over padded rows ``[B, L, W]`` (sequence b's first ``lens[b] + 1``: its
        cached rows, then its new one): the indices ``[B, K]`` of the rows each attends to, ``K = min(topk, L)``,
        and which of them are real ``[B, K]`` (a sequence seeing fewer than K tokens)."""
        b, length = rows.shape[:2]
        seen = torch.arange(length, device=rows.device)[None, :] <= lens[:, None]
        k = min(self.topk, length)
        q, w = self._cast(self.q), self._cast(self.weights)
        step = max(1, _SCORE_ELEMS // (q.shape[1] * length))
        idx = torch.empty(b, k, dtype=torch.long, device=rows.device)
        for r in range(0, b, step):
            score = self._score(q[r : r + step], w[r : r + step], self._keys(rows[r : r + step]), seen[r : r + step])
            idx[r : r + step] = listed(_top(score, k), k)[0]  # exactly k per row
        return idx, seen.gather(1, idx)

    def _score(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Queries ``q [N, H, D]`` (head weights ``w [N, H]``) over keys ``[L, D]`` shared by all, or ``[N, L, D]``
        each its own: scores ``[N, L]``, -inf where not ``visible``."""
        scores = torch.relu(q @ keys.transpose(-1, -2) * self.scale)  # [N, H, L]
        return torch.einsum("nh,nhl->nl", w, scores).masked_fill(~visible, float("-inf"))

    def _keys(self, rows: torch.Tensor) -> torch.Tensor:
        return self._cast(rows[..., self.key_offset : self.key_offset + self.q.shape[-1]])

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.promote_types(self.q.dtype, torch.float32))


def listed(chosen: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bool ``[N, L]`` with at most ``k`` true per row as indices ``[N, k]`` (the true ones in order, then
    padding) and which of them are true ``[N, k]``. A stable sort, so no host sync."""
    idx = torch.sort(chosen.to(torch.int8), dim=-1, descending=True, stable=True).indices[:, :k]
    return idx, chosen.gather(1, idx)


def _top(score: torch.Tensor, k: int) -> torch.Tensor:
    """Exactly the ``k`` highest scores of each row, ties at the cut going to the earliest positions."""
    kth = score.topk(k, dim=-1).values[:, -1:]
    above, tied = score > kth, score == kth
    return above | (tied & (tied.cumsum(-1) <= k - above.sum(-1, keepdim=True)))
