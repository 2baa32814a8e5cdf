"""Transport bandwidth per backend against a plain memory copy, and high-priority latency under a bulk
low-priority stream, each against a baseline measured in the same run.

    python bench/transport.py [--backends shm ucx nixl] [--out bench/results/transport.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import best_of, print_table, write_result  # noqa: E402

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
REGION = 256 << 20


def _pair(backend: str, chunk_bytes: int):
    from dualpath.core.config import TransportConfig
    from dualpath.traffic.transport import make_transport
    from dualpath.traffic.transport.peer import PeerProcess

    config = TransportConfig(name=backend, chunk_bytes=chunk_bytes, op_timeout_s=60)
    peer = PeerProcess(config, REGION)
    me = make_transport(config, "me")
    mem = me.allocate(REGION)
    mem.tensor.fill_(1)
    local = me.register(mem).region_id
    me.add_peer("peer", peer.address, peer.regions)
    return me, peer, local, peer.regions[0].region_id


def bandwidth(backend: str, sizes: list[int], total: int) -> list[dict]:
    from dualpath.traffic.transport import Op, Segment

    me, peer, lid, rid = _pair(backend, chunk_bytes=1 << 20)
    src, dst = torch.ones(REGION, dtype=torch.uint8), torch.zeros(REGION, dtype=torch.uint8)
    rows = []
    try:
        for size in sizes:
            n = max(1, min(total, REGION) // size)
            segs = [Segment(lid, i * size, rid, i * size, size) for i in range(n)]
            nbytes = n * size

            def memcpy():
                for i in range(n):
                    dst[i * size : (i + 1) * size].copy_(src[i * size : (i + 1) * size])

            t_copy = best_of(memcpy, repeats=3)
            t_read = best_of(lambda: me.submit("peer", Op.READ, segs).wait(120), repeats=3)
            t_write = best_of(lambda: me.submit("peer", Op.WRITE, segs).wait(120), repeats=3)
            rows.append(
                {
                    "backend": backend,
                    "segment_bytes": size,
                    "memcpy_GBps": nbytes / t_copy / 1e9,
                    "read_GBps": nbytes / t_read / 1e9,
                    "write_GBps": nbytes / t_write / 1e9,
                    "read_vs_memcpy": t_copy / t_read,
                    "write_vs_memcpy": t_copy / t_write,
                }
            )
    finally:
        me.close()
        peer.stop()
    return rows


def priority_latency(backend: str, probes: int = 20) -> dict:
    """Latency of 64 KiB high-priority transfers, idle and while a 1 GiB low-priority stream runs."""
    from dualpath.traffic.transport import Op, Priority, Segment

    me, peer, lid, rid = _pair(backend, chunk_bytes=256 << 10)
    small = [Segment(lid, 0, rid, 0, 64 << 10)]

    def probe() -> float:
        h = me.submit("peer", Op.READ, small, Priority.HIGH)
        h.wait(60)
        return h.finished_at - h.submitted_at

    try:
        for _ in range(5):
            probe()
        idle = [probe() for _ in range(probes)]
        bulk = me.submit("peer", Op.WRITE, [Segment(lid, 0, rid, 0, REGION)] * 4, Priority.LOW)  # 1 GiB
        busy = []
        while not bulk.done() and len(busy) < probes:
            time.sleep(0.005)
            busy.append(probe())
        overtaken = not bulk.done()
        bulk.wait(300)
    finally:
        me.close()
        peer.stop()
    med_idle, med_busy = statistics.median(idle), statistics.median(busy)
    return {
        "backend": backend,
        "idle_us": med_idle * 1e6,
        "busy_us": med_busy * 1e6,
        "busy_vs_idle": med_busy / med_idle,
        "probes_during_bulk": len(busy),
        "bulk_still_running": overtaken,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", nargs="+", default=["shm", "ucx", "nixl"])
    ap.add_argument("--total-bytes", type=int, default=128 << 20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    bw, prio = [], []
    for b in args.backends:
        bw += bandwidth(b, SIZES, args.total_bytes)
        prio.append(priority_latency(b))
    print_table(
        bw, ["backend", "segment_bytes", "memcpy_GBps", "read_GBps", "write_GBps", "read_vs_memcpy", "write_vs_memcpy"]
    )
    print()
    print_table(prio, ["backend", "idle_us", "busy_us", "busy_vs_idle", "probes_during_bulk"])
    result = {
        "bandwidth": bw,
        "priority": prio,
        "targets": {"shm_vs_memcpy_at_1MiB_and_up": 0.7, "priority_busy_vs_idle_max": 2.0},
    }
    print("wrote", write_result("transport", result, args.out))
    return result


if __name__ == "__main__":
    main()
    os._exit(0)  # NIXL crashes at interpreter exit otherwise
