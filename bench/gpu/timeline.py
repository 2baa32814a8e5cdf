"""Where a call leaves the GPU idle: its wall time split into the lead before the first kernel, the gaps between
kernels and the tail after the last, from a profiler trace (plain numbers in, so it is tested without a GPU).

A call whose device time is well below its wall time is either host-bound somewhere (a gap inside: a host sync,
host work between launches) or slow to start or finish (the lead: building inputs; the tail: sampling, outputs).
"""

from __future__ import annotations

from typing import Sequence


def timeline(
    call: tuple[float, float], kernels: Sequence[tuple[float, float, str]], top: int = 5, min_gap: float = 20.0
) -> dict:
    """``call``: the call's (start, end); ``kernels``: each device activity's (start, end, name), same clock
    (microseconds). Returns lead, tail and summed inner gaps (seconds), how many inner gaps exceed ``min_gap``
    microseconds, and the ``top`` largest with the activities on either side."""
    spans = sorted(k for k in kernels if k[1] > call[0] and k[0] < call[1])
    if not spans:
        return {
            "lead_seconds": (call[1] - call[0]) / 1e6,
            "tail_seconds": 0.0,
            "gap_seconds": 0.0,
            "gaps": 0,
            "largest_gaps": [],
        }
    gaps, busy_until, before = [], spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start - busy_until > min_gap:
            gaps.append((start - busy_until, before, name))
        if end >= busy_until:  # activities may overlap (a copy beside a kernel): the idle time starts after both
            busy_until, before = end, name
    gaps.sort(reverse=True)
    return {
        "lead_seconds": max(0.0, spans[0][0] - call[0]) / 1e6,
        "tail_seconds": max(0.0, call[1] - busy_until) / 1e6,
        "gap_seconds": sum(g for g, _, _ in gaps) / 1e6,
        "gaps": len(gaps),
        "largest_gaps": [{"seconds": g / 1e6, "after": a[:60], "before": b[:60]} for g, a, b in gaps[:top]],
    }
