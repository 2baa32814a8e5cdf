"""Turns (blocks, layers, tokens) on two sides into transport segments, merging runs contiguous on both sides.

Both sides name blocks by slot in their own layout (``dualpath.core.geometry``); block ``j`` of the request is local
slot ``local_slots[j]`` and remote slot ``remote_slots[j]``. Token ranges cut the first and last blocks, so a
decode engine can receive only the miss tokens of a layer beside hit KV that is already there.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from dualpath.core.geometry import BlockLayout
from dualpath.traffic.transport.base import Segment


def plan_segments(
    local_region: int,
    local_layout: BlockLayout,
    local_slots: Sequence[int],
    remote_region: int,
    remote_layout: BlockLayout,
    remote_slots: Sequence[int],
    layers: Iterable[int],
    tokens: tuple[int, int] | None = None,
) -> list[Segment]:
    """Segments moving ``tokens`` (default: all tokens of all listed blocks) of every layer in ``layers``."""
    if len(local_slots) != len(remote_slots):
        raise ValueError(f"{len(local_slots)} local slots for {len(remote_slots)} remote slots")
    geom = local_layout.geometry
    bs, tb = geom.block_size, geom.token_bytes
    first, last = tokens if tokens is not None else (0, len(local_slots) * bs)
    if not 0 <= first <= last <= len(local_slots) * bs:
        raise ValueError(f"token range [{first}, {last}) outside {len(local_slots)} blocks")
    raw = []
    for layer in layers:
        for j in range(first // bs, -(-last // bs)):
            lo, hi = max(first, j * bs) - j * bs, min(last, (j + 1) * bs) - j * bs
            if hi <= lo:
                continue
            raw.append(
                Segment(
                    local_region,
                    local_layout.offset(local_slots[j], layer) + lo * tb,
                    remote_region,
                    remote_layout.offset(remote_slots[j], layer) + lo * tb,
                    (hi - lo) * tb,
                )
            )
    return merge_segments(raw)


def merge_segments(segments: list[Segment]) -> list[Segment]:
    """Join segments that continue each other on both sides (order-independent)."""
    out: list[Segment] = []
    for s in sorted(segments, key=lambda s: (s.local_region, s.local_offset)):
        if out:
            p = out[-1]
            if (
                p.local_region == s.local_region
                and p.remote_region == s.remote_region
                and p.local_offset + p.nbytes == s.local_offset
                and p.remote_offset + p.nbytes == s.remote_offset
            ):
                out[-1] = Segment(p.local_region, p.local_offset, p.remote_region, p.remote_offset, p.nbytes + s.nbytes)
                continue
        out.append(s)
    return out
