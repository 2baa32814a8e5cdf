"""The FP8 GEMMs' tiles on a GPU: device time of ``w8a16_linear`` (decode rows) and ``w8a8_linear`` (prefill rows)
over a small grid of tiles, warps and stages, against cuBLAS bfloat16 on the same shapes, for choosing the
kernels' defaults (``dualpath.kernels.triton_fp8``). Report only.

Device time, not a call's: each case is captured as a CUDA graph of ``REPS`` calls and replayed, so the host's
launch cost (tens of microseconds for a Triton launch from Python, more than a decode-sized GEMM takes) is out of
it; ``eager_s`` is one plain call for comparison. The calls cycle over copies of the weight that together pass the
L2 cache (60 MB on an H200), as a model's step reads each weight once. Shapes: Llama-3-8B's projections and the
GPU bench's 1.1B Llama's. The default tiles' rows carry their error against float64 (``rel_err``: w8a16 against the
exact product over the stored weights; w8a8 against ``w8a8_reference`` and, ``rel_err_vs_w8a16_exact``, the exact
product, the activations' rounding included).

    python bench/gpu/fp8_tiles.py --out OUT.json [--smoke]

``--smoke``: toy shapes on CPU under TRITON_INTERPRET=1 (plain timing), to check the script itself.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
from common import machine, print_table, rel_err  # noqa: E402

from dualpath.kernels.fp8 import Fp8Weight, quantize_blocks  # noqa: E402

SHAPES = {
    "8b_qkv": (6144, 4096),
    "8b_o": (4096, 4096),
    "8b_gate_up": (28672, 4096),
    "8b_down": (4096, 14336),
    "1b_qkv": (2560, 2048),
    "1b_gate_up": (11264, 2048),
    "1b_down": (2048, 5632),
}
SMOKE_SHAPES = {"8b_qkv": (64, 256), "1b_down": (32, 256)}  # the first swept
REPS = 20
# (block_n, block_k, num_warps, num_stages); block_m follows the rows (16 up to 64)
W8A16_TILES = [(64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 4, 3), (128, 128, 8, 4), (32, 128, 4, 4)]
# (block_m, block_n, block_k, num_warps, num_stages)
W8A8_TILES = [
    (64, 128, 128, 4, 3),
    (128, 128, 128, 8, 3),
    (128, 128, 128, 4, 3),
    (128, 256, 128, 8, 3),
    (64, 256, 128, 8, 3),
    (128, 128, 128, 8, 4),
]


def device_time(calls, dev: torch.device) -> float:
    """Seconds per call of ``calls`` (a list of thunks, run in turn): replays of their CUDA graph on a GPU."""
    run = lambda: [c() for c in calls]  # noqa: E731
    if dev.type != "cuda":
        t = time.perf_counter()
        run()
        return (time.perf_counter() - t) / len(calls)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # compiles, and the allocator's first blocks, outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(max(1, REPS // len(calls))):
            run()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (5 * max(1, REPS // len(calls)) * len(calls))


def eager_time(fn, dev: torch.device) -> float:
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / 10


def weights(n: int, k: int, block, dev, copies: int):
    w16 = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(copies)]
    return w16, [Fp8Weight(*quantize_blocks(w, block), block) for w in w16]


def case(name, rows, n, k, kind, tile, fn, t16, dev, extra=None) -> dict:
    try:
        t = device_time(fn, dev)
        return {
            "shape": name,
            "rows": rows,
            "n": n,
            "k": k,
            "kernel": kind,
            "tile": tile,
            "seconds": t,
            "time_vs_cublas_bf16": t / t16,
            "weight_bytes_per_s": n * k / t,
            **(extra or {}),
        }
    except Exception as e:  # noqa: BLE001 - a tile that does not fit is a row, not the end
        return {"shape": name, "rows": rows, "kernel": kind, "tile": tile, "error": f"{type(e).__name__}: {e}"[:300]}


def sweep(shapes, row_counts, dev, smoke: bool) -> list[dict]:
    from dualpath.kernels.fp8 import w8a8_reference
    from dualpath.kernels.triton_fp8 import quantize_activations, w8a8_linear, w8a16_linear

    block, sweep_w8a8_from = (128, 128), 64 if smoke else 512
    out = []
    for name, (n, k) in shapes.items():
        copies = 1 if smoke else max(1, -(-120_000_000 // (n * k)))  # fp8 copies past L2 (bf16: twice that)
        w16, w8 = weights(n, k, block, dev, copies)
        for m in row_counts:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            t16 = device_time([lambda w=w: torch.nn.functional.linear(x, w) for w in w16], dev)
            out.append(
                {
                    "shape": name,
                    "rows": m,
                    "n": n,
                    "k": k,
                    "kernel": "cublas_bf16",
                    "seconds": t16,
                    "weight_bytes_per_s": 2 * n * k / t16,
                    "eager_s": eager_time(lambda: torch.nn.functional.linear(x, w16[0]), dev),
                }
            )
            exact = x.double() @ w8[0].dequantize(torch.float64).t()
            if m < 128:
                out.append(
                    case(
                        name,
                        m,
                        n,
                        k,
                        "w8a16",
                        "default",
                        [lambda w=w: w8a16_linear(x, w) for w in w8],
                        t16,
                        dev,
                        {
                            "eager_s": eager_time(lambda: w8a16_linear(x, w8[0]), dev),
                            "rel_err": rel_err(w8a16_linear(x, w8[0]), exact),
                        },
                    )
                )
                tiles = W8A16_TILES if name in ("8b_qkv", "8b_down") else []
                for (bn, bk, warps, stages), splits in itertools.product(tiles, (1, None)):
                    fn = [
                        lambda w=w: w8a16_linear(
                            x, w, block_n=bn, block_k=bk, num_splits=splits, num_warps=warps, num_stages=stages
                        )
                        for w in w8
                    ]
                    out.append(case(name, m, n, k, "w8a16", [bn, bk, warps, stages, splits or "auto"], fn, t16, dev))
            if m >= 64:
                y = w8a8_linear(x, w8[0])
                out.append(
                    case(
                        name,
                        m,
                        n,
                        k,
                        "w8a8",
                        "default",
                        [lambda w=w: w8a8_linear(x, w) for w in w8],
                        t16,
                        dev,
                        {
                            "eager_s": eager_time(lambda: w8a8_linear(x, w8[0]), dev),
                            "rel_err": rel_err(y, w8a8_reference(x.double(), w8[0])),
                            "rel_err_vs_w8a16_exact": rel_err(y, exact),
                        },
                    )
                )
                out.append(case(name, m, n, k, "act_quant", "", [lambda: quantize_activations(x, block[1])], t16, dev))
                tiles = W8A8_TILES if m >= sweep_w8a8_from and name.startswith("8b_") else []
                for bm, bn, bk, warps, stages in tiles:
                    fn = [
                        lambda w=w: w8a8_linear(
                            x, w, block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages
                        )
                        for w in w8
                    ]
                    out.append(case(name, m, n, k, "w8a8", [bm, bn, bk, warps, stages], fn, t16, dev))
            del exact
        w16 = w8 = None  # (freed before the next shape's; the lambdas above ran already)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def best(rows: list[dict]) -> list[dict]:
    """Per shape, rows and kernel: cuBLAS, the default tile and the fastest tile."""
    table = []
    for key in sorted({(r["shape"], r["rows"]) for r in rows}, key=lambda s: (s[0], s[1])):
        group = [r for r in rows if (r["shape"], r["rows"]) == key and "seconds" in r]
        for kind in ("w8a16", "w8a8"):
            mine = [r for r in group if r["kernel"] == kind]
            if not mine:
                continue
            default = next((r for r in mine if r["tile"] == "default"), {})
            fast = min(mine, key=lambda r: r["seconds"])
            table.append(
                {
                    "shape": key[0],
                    "rows": key[1],
                    "kernel": kind,
                    "default ÷ cublas": default.get("time_vs_cublas_bf16"),
                    "best ÷ cublas": fast["time_vs_cublas_bf16"],
                    "best tile": str(fast["tile"]),
                    "best us": fast["seconds"] * 1e6,
                }
            )
    return table


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    t = time.perf_counter()
    rows = sweep(
        SMOKE_SHAPES if args.smoke else SHAPES, (1, 16, 64) if args.smoke else (1, 16, 64, 512, 4096), dev, args.smoke
    )
    result = {
        "benchmark": "fp8_tiles",
        "machine": machine(),
        "smoke": args.smoke,
        "reps": REPS,
        "rows": rows,
        "summary": best(rows),
        "wall_seconds": time.perf_counter() - t,
    }
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print_table(
        result["summary"], ["shape", "rows", "kernel", "default ÷ cublas", "best ÷ cublas", "best tile", "best us"]
    )
    for r in rows:
        if "error" in r:
            print(f"{r['shape']} {r['rows']} {r['kernel']} {r['tile']}: {r['error']}")
    return result


if __name__ == "__main__":
    main()
