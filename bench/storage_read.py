"""Read bandwidth of the fs storage backend (header checks, per-layer checksums, preadv into a DRAM buffer)
against a raw sequential read of the same bytes, in the same run. Warm (page cache) always; cold too when
this process may drop the page cache (root).

    python bench/storage_read.py [--blocks 256] [--root DIR] [--out bench/results/storage_read.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_result  # noqa: E402


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--root", default=None, help="directory to store blocks in (default: a temp dir)")
    ap.add_argument("--io-threads", type=int, default=0, help="0: the backend's default")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from dualpath.core.config import StorageConfig
    from dualpath.core.geometry import KVGeometry
    from dualpath.traffic.memory import HostMemory
    from dualpath.traffic.storage import make_storage

    # SmolLM2-135M's geometry in bfloat16: 30 layers x 64 tokens x 384 elements -> 1.4 MiB Full Blocks
    geom = KVGeometry(num_layers=30, block_size=64, kv_elems_per_token=384, dtype="bfloat16")
    root = Path(args.root or tempfile.mkdtemp(prefix="dualpath-bench-"))
    storage = make_storage(StorageConfig(root=str(root), io_threads=args.io_threads), geom, b"b" * 16)
    keys = [i.to_bytes(16, "little") for i in range(args.blocks)]
    g = torch.Generator().manual_seed(0)
    src = [torch.randint(0, 256, (geom.full_block_bytes,), dtype=torch.uint8, generator=g) for _ in keys]
    assert storage.write(keys, src).result() == [None] * len(keys)
    buf = HostMemory(args.blocks * geom.full_block_bytes)
    fb = geom.full_block_bytes
    dests = [buf.tensor[i * fb : (i + 1) * fb] for i in range(args.blocks)]
    header = bytearray(storage.header_size)
    paths = [storage.path(k) for k in keys]
    total = args.blocks * fb

    def raw_read():
        """The same bytes into the same destinations, sequentially, with no checks."""
        for p, d in zip(paths, dests):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.preadv(fd, [header, d.numpy()], 0)
            finally:
                os.close(fd)

    def ours():
        results = storage.read(keys, dests).result()
        assert results == [None] * len(keys), results[:3]

    rows = []
    modes = ["warm"] + (["cold"] if drop_caches() else [])
    for mode in modes:
        best_raw = best_ours = float("inf")
        for _ in range(3):
            for fn, name in ((raw_read, "raw"), (ours, "ours")):
                if mode == "cold":
                    drop_caches()
                else:
                    fn()  # warm the page cache
                t = time.perf_counter()
                fn()
                dt = time.perf_counter() - t
                if name == "raw":
                    best_raw = min(best_raw, dt)
                else:
                    best_ours = min(best_ours, dt)
        rows.append(
            {
                "cache": mode,
                "raw_GBps": total / best_raw / 1e9,
                "ours_GBps": total / best_ours / 1e9,
                "ours_vs_raw": best_raw / best_ours,
            }
        )
    assert all(torch.equal(d, s) for d, s in zip(dests, src))
    print_table(rows, ["cache", "raw_GBps", "ours_GBps", "ours_vs_raw"])
    result = {
        "blocks": args.blocks,
        "block_bytes": fb,
        "io_threads": args.io_threads,
        "rows": rows,
        "target": "ours >= 0.8 x raw sequential read",
    }
    print("wrote", write_result("storage_read", result, args.out))
    storage.close()
    return result


if __name__ == "__main__":
    main()
