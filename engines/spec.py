"""Proposals for speculative decoding by prompt lookup (n-gram matching over a sequence's own tokens).

Agents' replies repeat their context (file contents, paths, code being edited, earlier tool arguments), so the
tokens that followed an earlier occurrence of the last few tokens are often the next ones. ``LocalEngine`` feeds
them as drafts and keeps those the model itself draws (``SpeculativeConfig``).
"""

from __future__ import annotations

import numpy as np


class PromptLookup:
    """One sequence's tokens in a growable array, and the drafts they suggest. A lookup is a few vectorized
    comparisons over the tokens (microseconds at 32K tokens); no per-n-gram index is kept (it would cost tens of
    bytes per token per n in Python objects)."""

    def __init__(self, tokens: list[int]):
        self._buf = np.empty(max(64, 2 * len(tokens)), dtype=np.int64)
        self.n = 0
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        if self.n + len(tokens) > len(self._buf):
            grown = np.empty(2 * (self.n + len(tokens)), dtype=np.int64)
            grown[: self.n] = self._buf[: self.n]
            self._buf = grown
        self._buf[self.n : self.n + len(tokens)] = tokens
        self.n += len(tokens)

    def propose(self, k: int, min_n: int, max_n: int) -> list[int]:
        """Up to ``k`` tokens: those after the latest earlier occurrence of the last ``n`` tokens, for the largest
        ``n`` in ``[min_n, max_n]`` that occurs earlier (a longer match predicts better); [] when none does. One
        pass over the tokens finds where the last token occurs with a follower; each longer ``n`` only filters
        those places."""
        a, length = self._buf, self.n
        ends = np.flatnonzero(a[: length - 1] == a[length - 1]) if length > 1 else a[:0]
        best = -1
        for n in range(1, max_n + 1):
            if n > 1:
                ends = ends[ends >= n - 1]
                ends = ends[a[ends - (n - 1)] == a[length - n]]
            if not len(ends):
                break
            if n >= min_n:
                best = int(ends[-1])
        return a[best + 1 : min(best + 1 + k, length)].tolist() if best >= 0 else []
