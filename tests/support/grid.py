"""Parameter grids whose full cross product is for the slow run: the default run takes a covering subset.

``covering(names, axes, strength=2)`` gives ``pytest.mark.parametrize`` arguments over every combination of the
axes' values; the combinations outside a greedy ``strength``-wise covering set are marked slow. With strength 2,
every pair of values of any two axes still meets in the default run (a kernel sees each head layout with each
length case, and each dtype with both); with strength 1, every value of every axis runs at least once.
``python -m pytest -m slow`` runs the rest.
"""

from __future__ import annotations

from itertools import combinations, product
from typing import Sequence

import pytest


def covering(names: str, axes: Sequence[Sequence], strength: int = 2) -> tuple[str, list]:
    sizes = [len(a) for a in axes]
    groups = list(combinations(range(len(axes)), min(strength, len(axes))))
    combos = list(product(*map(range, sizes)))
    need = {(g, tuple(c[d] for d in g)) for c in combos for g in groups}
    keep: set[tuple[int, ...]] = set()
    while need:  # greedy: the combination covering most uncovered tuples, the first such in grid order
        best = max(combos, key=lambda c: sum((g, tuple(c[d] for d in g)) in need for g in groups))
        keep.add(best)
        need -= {(g, tuple(best[d] for d in g)) for g in groups}
    labels = [n.strip() for n in names.split(",")]
    params = [
        pytest.param(
            *(a[i] for a, i in zip(axes, c)),
            marks=() if c in keep else pytest.mark.slow,
            id="-".join(f"{n}{i}" for n, i in zip(labels, c)),
        )
        for c in combos
    ]
    return names, params
