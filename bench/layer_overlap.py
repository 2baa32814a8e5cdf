"""Per-layer overlap of KV loading with compute in the prefill engine.

A prefill of N new tokens over C cached tokens whose KV is in storage, read at a capped bandwidth (the storage NIC
emulation). Times, in one run: (a) compute alone, KV already resident; (b) the load alone; the layerwise engine
(layer l+1 read while layer l computes); and the basic engine (load everything, then compute).
Target: layerwise <= 1.15 x max(a, b).

    python bench/layer_overlap.py [--cached 2048 --new 256] [--model DIR] [--out bench/results/layer_overlap.json]
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


def build(args):
    from dualpath.core.config import CacheConfig, EngineConfig, EngineProcessConfig, StorageConfig, TransportConfig
    from dualpath.core.messages import EngineInfo, Role
    from dualpath.engines.prefill import PrefillEngine
    from dualpath.traffic.buffer import BufferPool
    from dualpath.traffic.transport import make_transport

    cfg = EngineProcessConfig(
        role="prefill",
        model=args.model,
        scheduler="127.0.0.1:1",
        engine_id="bench-pe",
        engine=EngineConfig(device=args.device, dtype=args.dtype, cache=CacheConfig(block_size=64)),
        transport=TransportConfig(name="shm"),
        storage=StorageConfig(root=args.kv_store, io_threads=2),
        buffer_bytes=args.buffer_bytes,
        workspace_tokens=args.cached + args.new + 128,
        cost_model=(0.0, 1e-4, 0.0),
        torch_threads=args.threads,
    )
    pe = PrefillEngine(cfg)
    g = pe.geometry
    de_t = make_transport(TransportConfig(name="shm"), "bench-de")
    de_mem = de_t.allocate(args.buffer_bytes)
    de_region = de_t.register(de_mem).region_id
    de_pool = BufferPool(g, args.buffer_bytes // g.full_block_bytes, de_mem)
    de_info = EngineInfo(
        "bench-de",
        Role.DECODE,
        "n1",
        "127.0.0.1:1",
        "shm",
        de_t.address(),
        [r.to_dict() for r in de_t.regions()],
        de_region,
        de_pool.num_slots,
        g.block_size,
        g.num_layers,
        pe.fingerprint.hex(),
        0,
    )
    return pe, de_t, de_pool, de_info


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--cached", type=int, default=2048)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--buffer-bytes", type=int, default=160 << 20)
    ap.add_argument("--read-bps", type=float, default=0.0, help="storage cap (default: matched to compute)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.model is None:
        from dualpath.checkpoints.smollm2 import default_model_dir

        args.model = str(default_model_dir())
    args.kv_store = tempfile.mkdtemp(prefix="dualpath-overlap-")

    from dualpath.core.geometry import block_hashes
    from dualpath.core.messages import Assignment, ReadPath
    from dualpath.engines.prefill import Job
    from dualpath.engines.sampler import make_generator
    from dualpath.core.sampling_params import SamplingParams

    pe, de_t, de_pool, de_info = build(args)
    g = pe.geometry
    pe.transport.add_peer("bench-de", de_t.address(), de_t.regions())
    tokens = torch.randint(3, min(20000, pe.model.config.vocab_size), (args.cached + args.new,)).tolist()
    keys = block_hashes(tokens[: args.cached], pe.fingerprint, g.block_size)
    dt = getattr(torch, args.dtype)
    blocks = [torch.randn(g.full_block_bytes // g.dtype_bytes).to(dt).view(torch.uint8) for _ in keys]
    assert pe.storage.write(keys, blocks).result() == [None] * len(keys)
    n_blocks = g.num_blocks(len(tokens))
    de_slots = de_pool.allocate(n_blocks, "r")
    params = SamplingParams(temperature=0, max_tokens=1)

    def job(layerwise: bool):
        a = Assignment("r", tokens, params.to_dict(), [k.hex() for k in keys], ReadPath.PE, layerwise, de_info)
        j = Job(a, params, [make_generator(params)], len(keys), tokens, keys, hit_tokens=len(keys) * g.block_size)
        j.pe_slots = pe.buffer.allocate(n_blocks, "r")
        j.de_slots = de_slots
        j.computed = j.local_tokens = args.cached
        return j

    def load(j):
        j.layer_loads = pe.traffic.load_layers(keys, j.pe_slots[: len(keys)])
        return j.layer_loads

    def run(layerwise: bool, preload: bool) -> float:
        j = job(layerwise)
        if preload:
            for f in load(j):
                f.result()
        t = time.perf_counter()
        if not preload:
            load(j)
        ws = pe.workspace if layerwise else pe._basic_workspace()
        pe._prefill([(j, args.new)], ws, basic=not layerwise)
        elapsed = time.perf_counter() - t
        pe.buffer.free_owner("r")
        return elapsed

    def load_alone() -> float:
        j = job(True)
        t = time.perf_counter()
        for f in load(j):
            f.result()
        elapsed = time.perf_counter() - t
        pe.buffer.free_owner("r")
        return elapsed

    run(True, preload=True)  # warm up
    compute = min(run(True, preload=True) for _ in range(args.repeats))
    hit_bytes = len(keys) * g.full_block_bytes
    cap = args.read_bps or hit_bytes / compute  # the hardest case: loading takes as long as computing
    pe.accounting.bandwidth_bps = cap
    pe.accounting._burst = cap * 0.05
    loading = min(load_alone() for _ in range(args.repeats))
    layerwise = min(run(True, preload=False) for _ in range(args.repeats))
    basic = min(run(False, preload=False) for _ in range(args.repeats))
    row = {
        "cached": args.cached,
        "new": args.new,
        "compute_s": compute,
        "load_s": loading,
        "layerwise_s": layerwise,
        "basic_s": basic,
        "layerwise_vs_max": layerwise / max(compute, loading),
        "basic_vs_max": basic / max(compute, loading),
        "read_cap_MBps": cap / 1e6,
    }
    print_table([row], list(row))
    result = {
        "model": Path(args.model).name,
        "device": args.device,
        "dtype": args.dtype,
        "row": row,
        "hit_bytes": hit_bytes,
        "target": "layerwise <= 1.15 x max(compute, load)",
    }
    print("wrote", write_result("layer_overlap" if args.device == "cpu" else "layer_overlap_gpu", result, args.out))
    pe.stop()
    de_t.close()
    return result


if __name__ == "__main__":
    main()
    os._exit(0)
