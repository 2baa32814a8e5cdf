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
            grown[:self.n] = self._buf[:self.n]
            self._buf = grown
        self._buf[self.n:self.n + len(tokens)] = tokens
        self.n += len(tokens)

    def propose(self, k: int, min_n: int, max_n: int) -> list[int]:
        """Up to ``k`` tokens: those after the latest earlier occurrence of the last ``n`` tokens, for the largest
        ``n`` in ``[min_n, max_n]`` that occurs earlier (a longer match predicts better); [] when none does."""
        a, length = self._buf, self.n
        for n in range(min(max_n, length - 1), min_n - 1, -1):
            suffix = a[length - n:length]
            starts = a[:length - n] == suffix[0]  # candidate starts s < length - n: a follower exists
            for i in range(1, n):
                starts &= a[i:length - n + i] == suffix[i]
            hits = np.flatnonzero(starts)
            if len(hits):
                s = int(hits[-1]) + n
                return a[s:min(s + k, length)].tolist()
        return []
