"""FP8 at decode on a GPU (issue 52, "FP8 that pays"): the swap-AB w8a16 GEMM (``w8a16_swap_linear``, what
``fp8_linear`` runs for up to 64 rows) against the w8a16 kernel before it (``w8a16_linear``) and bfloat16
``torch.matmul`` (cuBLAS), and decode attention over an e4m3 KV cache against the bfloat16 cache's. Report only:
the targets are read off the JSON.

- ``gemm``: Llama-3-8B's projections (N x K of qkv, o, gate_up, down) at M = 1, 16, 64 rows: each kernel's device
  time, the weight bytes it reads per second over the measured copy bandwidth (``bw_vs_copy``: target >= 0.8 for
  the new kernel), and a small sweep of tiles and K splits (``sweep``) for choosing the defaults.
  ``layer``: a layer's four GEMMs summed per M, FP8 (new, old) over bfloat16: the 8B's FP8 decode step is
  mostly these (target for the step: <= 0.65x bfloat16's).
- ``attention``: decode attention, batch 64, 8 KV heads x 128 (32 query heads), contexts 2K, 16K and 32K, over an
  e4m3 cache (tiles of 32 and 64 keys) and a bfloat16 one (the default tile); ``fp8_vs_bf16`` is the default
  e4m3 time over bfloat16's (target at 32K: <= 0.6).

Device time from CUDA-graph replays (``fp8_tiles.device_time``), the weights cycled over copies past the L2 cache as
a model's step reads each once. Each default row carries its error against float64 (``rel_err``). The default rows
run first (GEMMs, then attention), then the sweep until ``--budget`` seconds from the start (default 60: the GPU
script gives this one ~90, and each new tile's first call compiles it, a second or two).

    python bench/gpu/fp8_decode.py --out OUT.json [--smoke] [--budget S]

``--smoke``: toy shapes on CPU under TRITON_INTERPRET=1 (plain timing), to check the script itself in seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
from common import machine, print_table, rel_err  # noqa: E402

from dualpath.kernels.attention import PagedKV, gqa_split, varlen_attention  # noqa: E402
from dualpath.kernels.kv_move import as_cached  # noqa: E402


def _sibling(name: str):
    """A script beside this one, by file (``bench/gpu`` on sys.path would shadow the ``kernels`` package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


fp8_tiles = _sibling("fp8_tiles")
device_time, weights = fp8_tiles.device_time, fp8_tiles.weights

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # Llama-3-8B
SMOKE_SHAPES = {"qkv": (96, 256), "down": (64, 160)}
ROWS = (1, 16, 64)
# (block_n, block_k, num_warps, num_stages, splits, direct): splits None is the kernel's own (``swap_splits``);
# direct: e4m3 widened by Triton's direct conversion, not through float32 (``_widened``)
SWAP_TILES = [
    (64, 128, 4, 4, None, True),
    (64, 128, 4, 4, 1, False),
    (64, 128, 4, 4, 2, False),
    (64, 128, 4, 4, 8, False),
    (64, 128, 4, 3, None, False),
    (64, 64, 4, 6, None, False),
    (128, 128, 8, 4, None, False),
]
SMOKE_TILES = SWAP_TILES[:3]
# splits None: the kernel's own (``decode_splits``); the smoke run's 2 spare the interpreter 64 splits' programs
ATTENTION = dict(batch=64, hk=8, hq=32, d=128, bs=64, contexts=(2048, 16384, 32768), splits=None)
SMOKE_ATTENTION = dict(batch=2, hk=2, hq=4, d=16, bs=16, contexts=(40, 100), splits=2)
FP8_TILES = (None, 32, 64)  # e4m3 decode tiles: the default (``decode_tile``), then each


class Budget:
    """Seconds left for the sweeps; the default rows always run."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds
        self.skipped = 0

    def left(self) -> bool:
        ok = time.perf_counter() < self.end
        self.skipped += not ok
        return ok


def copy_bandwidth(dev: torch.device, smoke: bool) -> float:
    """Bytes read plus written per second by a device copy of 1 GiB (2 MiB in the smoke run)."""
    n = (1 << 20) if smoke else (1 << 29)
    a = torch.empty(n, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    return 4 * n / device_time([lambda: b.copy_(a)], dev)


def gemm_rows(shapes: dict, dev: torch.device, copy_bw: float, smoke: bool, budget: Budget | None) -> list[dict]:
    """Without a ``budget``: the default rows (bfloat16, the old kernel, the new one, with their errors); with
    one: the new kernel's sweep until the budget runs out (run after the attention part, so that the compiles of
    the sweep's tiles cannot crowd out a default row)."""
    from dualpath.kernels.triton_fp8 import w8a16_linear, w8a16_swap_linear

    tiles = (SMOKE_TILES if smoke else SWAP_TILES) if budget else []
    out = []
    for name, (n, k) in shapes.items():
        copies = 1 if smoke else max(1, -(-120_000_000 // (n * k)))  # fp8 copies past L2 (bf16: twice the bytes)
        w16, w8 = weights(n, k, (128, 128), dev, copies)
        for m in ROWS:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            exact = None if budget else x.double() @ w8[0].dequantize(torch.float64).t()

            def row(kernel, tile, fn, nbytes, check=None):
                t = device_time(fn, dev)
                r = {"shape": name, "rows": m, "n": n, "k": k, "kernel": kernel, "tile": tile, "seconds": t}
                r |= {"bytes_per_s": nbytes / t, "bw_vs_copy": nbytes / t / copy_bw}
                if check is not None:
                    r["rel_err"] = rel_err(check(), exact)
                out.append(r)

            if not budget:
                row("bf16_matmul", "", [lambda w=w: torch.matmul(x, w.t()) for w in w16], 2 * n * k)
                old = [lambda w=w: w8a16_linear(x, w) for w in w8]
                row("w8a16_old", "default", old, n * k, lambda: w8a16_linear(x, w8[0]))
                new = [lambda w=w: w8a16_swap_linear(x, w) for w in w8]
                row("w8a16_swap", "default", new, n * k, lambda: w8a16_swap_linear(x, w8[0]))
            for bn, bk, warps, stages, splits, direct in tiles:
                if not budget.left():
                    break
                kw = dict(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, num_splits=splits, direct=direct)
                fn = [lambda w=w: w8a16_swap_linear(x, w, **kw) for w in w8]
                row("w8a16_swap", [bn, bk, warps, stages, splits or "auto", "direct" if direct else "f32"], fn, n * k)
        w16 = w8 = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def gemm_summary(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """Per shape and rows: the new kernel's default and best tile against the old kernel and bfloat16; per rows,
    a layer's four GEMMs summed."""
    table, layer = [], []
    for m in ROWS:
        sums = {"bf16_matmul": 0.0, "w8a16_old": 0.0, "w8a16_swap": 0.0}
        for name in dict.fromkeys(r["shape"] for r in rows):
            mine = [r for r in rows if r["shape"] == name and r["rows"] == m]
            if not mine:
                continue
            by = {r["kernel"]: r for r in mine if r["tile"] in ("", "default")}
            fast = min((r for r in mine if r["kernel"] == "w8a16_swap"), key=lambda r: r["seconds"])
            new, old, bf16 = by["w8a16_swap"], by["w8a16_old"], by["bf16_matmul"]
            for kind in sums:
                sums[kind] += by[kind]["seconds"]
            table.append(
                {
                    "shape": name,
                    "rows": m,
                    "new us": new["seconds"] * 1e6,
                    "new bw/copy": new["bw_vs_copy"],
                    "new/old": new["seconds"] / old["seconds"],
                    "new/bf16": new["seconds"] / bf16["seconds"],
                    "old/bf16": old["seconds"] / bf16["seconds"],
                    "best tile": str(fast["tile"]),
                    "best bw/copy": fast["bw_vs_copy"],
                    "rel_err": new["rel_err"],
                }
            )
        layer.append(
            {
                "rows": m,
                "bf16 us": sums["bf16_matmul"] * 1e6,
                "fp8 new/bf16": sums["w8a16_swap"] / sums["bf16_matmul"],
                "fp8 old/bf16": sums["w8a16_old"] / sums["bf16_matmul"],
            }
        )
    return table, layer


def paged(lens: list[int], width: int, bs: int, dev, dtype) -> PagedKV:
    """Each sequence's rows in shuffled blocks of a cache of ``dtype`` (random bfloat16 values, cast)."""
    need = [-(-n // bs) for n in lens]
    cache = torch.randn(sum(need), bs, width, dtype=torch.bfloat16, device=dev).to(dtype)
    order = torch.randperm(sum(need), device=dev).to(torch.int32)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32, device=dev)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = order[at : at + n]
        at += n
    return PagedKV(cache, tables, lens)


def attention_rows(p: dict, dev: torch.device, copy_bw: float) -> list[dict]:
    from dualpath.kernels import triton_attention as ta

    b, hk, hq, d = p["batch"], p["hk"], p["hq"], p["d"]
    layout = gqa_split(hk, d)
    out = []
    for ctx in p["contexts"]:
        for dtype, tiles in ((torch.bfloat16, (None,)), (torch.float8_e4m3fn, FP8_TILES)):
            cached = paged([ctx - 1] * b, 2 * hk * d, p["bs"], dev, dtype)
            q = torch.randn(b, hq, d, dtype=torch.bfloat16, device=dev)
            new = as_cached(torch.randn(b, 2 * hk * d, dtype=torch.bfloat16, device=dev), dtype)
            lens = torch.tensor(cached.lens, dtype=torch.int32, device=dev)
            kv_bytes = b * ctx * 2 * hk * d * dtype.itemsize
            for block_n in tiles:
                run = lambda bn=block_n: ta.decode_attention(  # noqa: E731
                    q, new, cached.cache, cached.block_tables, lens, layout, 0.088, p["splits"], block_n=bn
                )
                t = device_time([run], dev)
                r = {"ctx": ctx, "cache": str(dtype).split(".")[-1], "block_n": block_n or "default", "seconds": t}
                out.append(r | {"bytes_per_s": kv_bytes / t, "bw_vs_copy": kv_bytes / t / copy_bw})
            two = PagedKV(cached.cache, cached.block_tables[:2], cached.lens[:2])
            ref = varlen_attention(
                q[:2].double(), new[:2].double(), PagedKV(two.cache.double(), two.block_tables, two.lens), layout,
                [1, 1], 0.088,
            )  # fmt: skip
            got = ta.decode_attention(q[:2], new[:2], two.cache, two.block_tables, lens[:2], layout, 0.088, p["splits"])
            out[-len(tiles)]["rel_err"] = rel_err(got, ref)
    return out


def attention_summary(rows: list[dict]) -> list[dict]:
    table = []
    for ctx in dict.fromkeys(r["ctx"] for r in rows):
        mine = [r for r in rows if r["ctx"] == ctx]
        bf16 = next(r for r in mine if r["cache"] == "bfloat16")
        f8 = [r for r in mine if r["cache"] != "bfloat16"]
        default, fast = f8[0], min(f8, key=lambda r: r["seconds"])
        table.append(
            {
                "ctx": ctx,
                "bf16 us": bf16["seconds"] * 1e6,
                "bf16 bw/copy": bf16["bw_vs_copy"],
                "fp8 us": default["seconds"] * 1e6,
                "fp8 bw/copy": default["bw_vs_copy"],
                "fp8_vs_bf16": default["seconds"] / bf16["seconds"],
                "best fp8 tile": fast["block_n"],
                "best fp8_vs_bf16": fast["seconds"] / bf16["seconds"],
            }
        )
    return table


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--budget", type=float, default=60.0, help="seconds after which the sweep stops")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    budget = Budget(args.budget)
    copy_bw = copy_bandwidth(dev, args.smoke)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    gemm = gemm_rows(shapes, dev, copy_bw, args.smoke, None)
    attention = attention_rows(SMOKE_ATTENTION if args.smoke else ATTENTION, dev, copy_bw)
    gemm += gemm_rows(shapes, dev, copy_bw, args.smoke, budget)
    gemm_table, layer = gemm_summary(gemm)
    result = {
        "benchmark": "fp8_decode",
        "machine": machine(),
        "smoke": args.smoke,
        "copy_bytes_per_s": copy_bw,
        "gemm": gemm,
        "gemm_summary": gemm_table,
        "layer": layer,
        "attention": attention,
        "attention_summary": attention_summary(attention),
        "targets": {"gemm_bw_vs_copy": 0.8, "fp8_step_vs_bf16": 0.65, "attention_32k_fp8_vs_bf16": 0.6},
        "sweep_cases_skipped": budget.skipped,
        "wall_seconds": time.perf_counter() - t0,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    print_table(gemm_table, list(gemm_table[0]))
    print_table(layer, list(layer[0]))
    print_table(result["attention_summary"], list(result["attention_summary"][0]))
    print(f"{result['wall_seconds']:.1f} s, sweep cases skipped by the budget: {budget.skipped}")
    return result


if __name__ == "__main__":
    main()
