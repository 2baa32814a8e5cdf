"""Compile every Triton kernel for a GPU without one: Triton ships ``ptxas``, so a kernel goes all the way to a
cubin for a named target (default ``cuda:90``, the H200). The real wrappers (``decode_attention``,
``prefill_attention``, block moves) are called on CPU tensors of the engines' and the GPU bench's shapes and
launch options; each kernel's ``run`` is replaced by a recorder, and each recorded launch is compiled ahead of
time with the specializations a real launch gets (16-byte-aligned pointers, integers divisible by 16). This
catches what the interpreter cannot: type errors the compiler rejects, and shared memory over the device limit.

    python tests/support/triton_compile.py [--target cuda:90] [--all] [--jobs N]     (prints one JSON line per launch)

``--all`` adds the GPU bench's tuning configurations to the engines' defaults.
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before any kernel is defined: compile, do not interpret

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dualpath.kernels import (
    triton_attention as ta,
    triton_elementwise as te,
    triton_fp8,
    triton_kv,
    triton_moe,  # noqa: E402
    triton_sparse,
)
from dualpath.kernels.sparse_attention import IndexQuery  # noqa: E402
from dualpath.kernels.fp8 import Fp8Weight  # noqa: E402
from dualpath.kernels.attention import gqa_split, mla_split  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))
from configs import DECODE_CONFIGS, PREFILL_CONFIGS  # noqa: E402  (the GPU bench's tuning sweep)

TYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.float8_e4m3fn: "fp8e4nv",
}
SHARED_LIMIT = {80: 166912, 89: 101376, 90: 232448}  # bytes of shared memory a block may use, by compute capability


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    return "fp32"


def compile_launch(fn, args: tuple, kwargs: dict, target: GPUTarget) -> dict:
    """Compile one recorded launch; returns its name, options and the cubin's shared memory."""
    launch = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(fn.arg_names, args)) | kwargs
    signature, constants, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        v = values[p.name]
        if p.is_constexpr:
            signature[p.name], constants[p.name] = "constexpr", v
            continue
        signature[p.name] = _arg_type(v)
        aligned = (
            v.data_ptr() % 16 == 0
            if isinstance(v, torch.Tensor)
            else (isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0)
        )
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    backend = triton.compiler.make_backend(target)
    cc = triton.compile(src, target=target, options=backend.parse_options(launch).__dict__)
    return {
        "kernel": fn.__name__,
        "launch": launch,
        "shared_bytes": cc.metadata.shared,
        "constexprs": {k: v for k, v in constants.items() if not isinstance(v, bool)},
        **ptxas_usage(cc.asm["ptx"]),
    }


def ptxas_usage(ptx: str) -> dict:
    """Registers per thread and bytes spilled, from Triton's own ``ptxas -v`` (a speed signal, not a failure)."""
    arch = re.search(r"^\.target\s+(\w+)", ptx, re.M).group(1)
    try:  # the ptxas Triton itself used for this architecture (Triton >= 3.4 keeps two)
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(int(re.sub(r"\D", "", arch))).path
    except (ImportError, AttributeError):
        ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        res = subprocess.run(
            [str(ptxas), f"-arch={arch}", "-v", f.name, "-o", os.devnull], capture_output=True, text=True, timeout=120
        )
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spills = re.search(r"(\d+) bytes spill stores", res.stderr)
    return {"registers": int(regs.group(1)) if regs else None, "spill_bytes": int(spills.group(1)) if spills else None}


def recorded_launches(all_configs: bool, fp8: bool = True) -> list[tuple]:
    """(kernel, args, kwargs, what) of every launch the wrappers make for the shapes below; ``fp8``: attention
    over e4m3 caches too (GPUs of compute capability 8.9 and up)."""
    launches = []
    kernels = (
        ta._prefill_kernel,
        ta._decode_split_kernel,
        ta._decode_reduce_kernel,
        triton_kv._move_kernel,
        triton_moe._moe_up_kernel,
        triton_moe._moe_down_kernel,
        te._rms_norm_kernel,
        te._rope_qkv_kernel,
        te._rope_kernel,
        te._silu_mul_kernel,
        triton_fp8._w8a16_kernel,
        triton_fp8._w8a16_swap_kernel,
        triton_fp8._w8a8_kernel,
        triton_fp8._act_quant_kernel,
        triton_sparse._index_score_kernel,
        triton_sparse._sparse_split_kernel,
    )
    for k in kernels:
        k.run = lambda *a, grid, warmup, _k=k, **kw: launches.append((_k, a, kw, what))
    bf16, f32, f8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
    cases = [  # (what, Hq, RowLayout, dtype, cache dtype): Llama-3-8B, TinyLlama (the bench), an fp32 engine,
        # DeepSeek-V3 MLA; and over e4m3 caches (--kv-cache-dtype fp8)
        ("gqa 32/8x128 bf16", 32, gqa_split(8, 128), bf16, bf16),
        ("gqa 32/4x64 bf16", 32, gqa_split(4, 64), bf16, bf16),
        ("gqa 4/2x64 fp32", 4, gqa_split(2, 64), f32, f32),
        ("mla 128 heads 512+64 bf16", 128, mla_split(512, 576), bf16, bf16),
    ] + (
        [
            ("gqa 32/8x128 bf16 over fp8", 32, gqa_split(8, 128), bf16, f8),
            ("mla 128 heads 512+64 bf16 over fp8", 128, mla_split(512, 576), bf16, f8),
        ]
        if fp8
        else []
    )
    prefill_cfgs = [dict()] + (
        [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s) for bm, bn, w, s in PREFILL_CONFIGS]
        if all_configs
        else []
    )
    decode_cfgs = [dict()] + (
        [dict(num_splits=sp, block_n=bn, num_warps=w) for sp, bn, w in DECODE_CONFIGS] if all_configs else []
    )
    for what, hq, layout, dtype, cache_dtype in cases:
        row = layout.v_offset + layout.num_kv_heads * layout.v_dim if layout.v_offset else layout.k_dim
        cache = torch.zeros(8, 64, row, dtype=cache_dtype)
        tables = torch.zeros(2, 4, dtype=torch.long)
        q = torch.zeros(3, hq, layout.k_dim, dtype=dtype)
        new = torch.zeros(3, row, dtype=dtype)
        tuned = what.startswith("gqa") and cache_dtype == bf16  # the bench tunes bf16 GQA; the rest run the defaults
        for cfg in prefill_cfgs if tuned else prefill_cfgs[:1]:
            ta.prefill_attention(q, new, cache, tables[:1], [100], [3], layout, 0.1, **cfg)
        for cfg in decode_cfgs if tuned else decode_cfgs[:1]:
            ta.decode_attention(
                q[:2], new[:2], cache, tables, torch.tensor([5, 200], dtype=torch.int32), layout, 0.1, **cfg
            )
    for cache_dtype in (bf16, f8) if fp8 else (bf16,):  # DeepSeek-V3.2: 128 heads over the latent, its indexer
        what = f"sparse mla 128 heads, indexer 64x128 bf16{' over fp8' if cache_dtype == f8 else ''}"
        index = IndexQuery(torch.zeros(3, 64, 128, dtype=bf16), torch.zeros(3, 64), 576, 2048, 128**-0.5)
        triton_sparse.sparse_attention(
            torch.zeros(3, 128, 576, dtype=bf16),
            torch.zeros(3, 704, dtype=cache_dtype),
            torch.zeros(8, 64, 704, dtype=cache_dtype),
            torch.zeros(3, 4, dtype=torch.long),
            torch.tensor([100, 200, 50], dtype=torch.int32),
            [1, 1, 1],
            mla_split(512, 576),
            0.1,
            index,
        )
    what = "moe 7168/2048 top-8 bf16"  # DeepSeek-V3's expert shapes (8 of its 256 experts: the same kernels)
    gate_up, down = torch.empty(8, 4096, 7168, dtype=bf16), torch.empty(8, 7168, 2048, dtype=bf16)
    for t in (4, 512):  # a decode batch (16-row blocks) and a prefill chunk (64-row blocks)
        ids = torch.arange(t * 8).reshape(t, 8) % 8
        triton_moe.fused_moe(torch.zeros(t, 7168, dtype=bf16), torch.rand(t, 8), ids, gate_up, down)
    for native in (True, False) if fp8 else (False,):  # FP8 weights: e4m3 converted by the GPU, or as bytes
        what = f"fp8 weights {'native' if native else 'as bytes'}"
        ex = Fp8Weight(torch.empty(8, 4096, 7168, dtype=f8), torch.empty(8, 32, 56), (128, 128))
        for t in (4, 512):
            ids = torch.arange(t * 8).reshape(t, 8) % 8
            triton_moe.fused_moe(
                torch.zeros(t, 7168, dtype=bf16),
                torch.rand(t, 8),
                ids,
                ex,
                Fp8Weight(torch.empty(8, 7168, 2048, dtype=f8), torch.empty(8, 56, 16), (128, 128)),
                native=native,
            )
        w = Fp8Weight(torch.empty(6144, 4096, dtype=f8), torch.empty(48, 32), (128, 128))  # Llama-3-8B's qkv
        for m, splits in ((4, 8), (512, 1)):  # a decode step split along K, a prefill chunk
            triton_fp8.w8a16_linear(torch.zeros(m, 4096, dtype=bf16), w, num_splits=splits, native=native)
            triton_fp8.w8a16_linear(
                torch.zeros(m, 4096, dtype=bf16),
                w,
                torch.zeros(6144, dtype=bf16),
                torch.zeros(m, 6144, dtype=bf16),
                num_splits=splits,
                native=native,
            )
        for m, splits in ((1, None), (16, 4), (64, 1)):  # decode batches: the swap-AB GEMM, split or not
            triton_fp8.w8a16_swap_linear(torch.zeros(m, 4096, dtype=bf16), w, num_splits=splits, native=native)
        if native:  # the bench's sweep: e4m3 widened by Triton's direct conversion
            triton_fp8.w8a16_swap_linear(torch.zeros(16, 4096, dtype=bf16), w, native=native, direct=True)
        triton_fp8.w8a16_swap_linear(
            torch.zeros(64, 4096, dtype=bf16),
            w,
            torch.zeros(6144, dtype=bf16),
            torch.zeros(64, 6144, dtype=bf16),
            native=native,
        )
        small = Fp8Weight(torch.empty(2560, 2048, dtype=f8), torch.empty(20, 16), (128, 128))  # the 1.1B's qkv
        for m, x_k, weight in ((64, 4096, w), (64, 2048, small)):  # decode batches past 16 rows: both tiles
            triton_fp8.w8a16_linear(torch.zeros(m, x_k, dtype=bf16), weight, native=native)
    if fp8:  # prefill batches multiply FP8 by FP8 (activations quantized per row and K block)
        what = "fp8 weights x fp8 activations"
        triton_fp8.w8a8_linear(torch.zeros(512, 4096, dtype=bf16), w)
        triton_fp8.w8a8_linear(
            torch.zeros(512, 4096, dtype=bf16), w, torch.zeros(6144, dtype=bf16), torch.zeros(512, 6144, dtype=bf16)
        )
        ids = torch.arange(512 * 8).reshape(512, 8) % 8
        triton_moe.fused_moe(
            torch.zeros(512, 7168, dtype=bf16),
            torch.rand(512, 8),
            ids,
            ex,
            Fp8Weight(torch.empty(8, 7168, 2048, dtype=f8), torch.empty(8, 56, 16), (128, 128)),
            w8a8=True,
        )
    for hidden, inter, hq, hk, d in ((4096, 14336, 32, 8, 128), (2048, 5632, 32, 4, 64), (7168, 18432, 128, 1, 64)):
        what = f"layer element-wise {hidden}/{inter} {hq}/{hk}x{d} bf16"  # Llama-3-8B, TinyLlama, DeepSeek-V3
        x = torch.zeros(3, hidden, dtype=bf16)
        te.rms_norm(x, x[0], 1e-6)
        te.rms_norm(x, x[0], 1e-6, residual=x)
        te.rope_qkv(
            torch.zeros(3, (hq + 2 * hk) * d, dtype=bf16),
            torch.zeros(3, d // 2, dtype=bf16),
            torch.zeros(3, d // 2, dtype=bf16),
            hq,
            hk,
            d,
        )
        te.silu_and_mul(torch.zeros(3, 2 * inter, dtype=bf16))
    what = "mla rope and latent norm into the KV row bf16"  # DeepSeek-V3: 128 heads x (128 + 64), row 512 + 64
    q, ckv, row = (
        torch.zeros(3, 128, 192, dtype=bf16),
        torch.zeros(3, 576, dtype=bf16),
        torch.zeros(3, 576, dtype=bf16),
    )
    angles = torch.zeros(3, 32, dtype=bf16)
    te.apply_rope(q[..., 128:], angles, angles, True)
    te.apply_rope(ckv[:, 512:].view(3, 1, 64), angles, angles, True, out=row[:, 512:].view(3, 1, 64))
    te.rms_norm(ckv[:, :512], ckv[0, :512], 1e-6, out=row[:, :512])
    what = "block moves bf16"
    triton_kv.gather_blocks(torch.zeros(8, 64, 2048, dtype=bf16), torch.tensor([3, 1]))
    triton_kv.scatter_blocks(
        torch.zeros(8, 64, 2048, dtype=bf16), torch.tensor([3, 1]), torch.zeros(2, 64, 2048, dtype=bf16)
    )
    for row in (2048, 512, 576):  # a forward's KV rows into cache slots: Llama-3-8B, TinyLlama, DeepSeek-V3's latent
        what = f"cache row writes {row} bf16"
        triton_kv.scatter_blocks(
            torch.zeros(8 * 64, row, dtype=bf16), torch.tensor([3, 70]), torch.zeros(2, row, dtype=bf16)
        )
    what = "cache row writes 2048 into fp8 (as bytes)"
    triton_kv.scatter_blocks(torch.zeros(8 * 64, 2048, dtype=f8), torch.tensor([3, 70]), torch.zeros(2, 2048, dtype=f8))
    return launches


_LAUNCHES: list[tuple] = []  # what ``main`` compiles; filled before its pool forks (the workers read it)


def _compile(i: int, target: GPUTarget) -> dict:
    fn, a, kw, what = _LAUNCHES[i]
    try:
        out = compile_launch(fn, a, dict(kw), target)
        out["fits"] = out["shared_bytes"] <= SHARED_LIMIT.get(target.arch, 232448)
    except Exception as e:  # noqa: BLE001 - report every launch, then fail
        out = {"kernel": fn.__name__, "error": f"{type(e).__name__}: {str(e)[-600:]}", "fits": False}
    return out | {"case": what}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="cuda:90", help="backend:capability, e.g. cuda:90 (H100/H200), cuda:80")
    ap.add_argument("--all", action="store_true", help="also the GPU bench's tuning configurations")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiles at once (each is one core's)")
    args = ap.parse_args(argv)
    backend, cap = args.target.split(":")
    target = GPUTarget(backend, int(cap), 32)
    _LAUNCHES[:] = recorded_launches(args.all, fp8=int(cap) >= 89)
    failed = 0
    # LLVM and ptxas are single-threaded and the compiles independent: a pool of processes (forked, so the
    # recorded launches and their tensors need no pickling) takes the test's wall time down by the cores
    with multiprocessing.get_context("fork").Pool(max(1, min(args.jobs, len(_LAUNCHES)))) as pool:
        for out in pool.imap(functools.partial(_compile, target=target), range(len(_LAUNCHES))):
            failed += not out["fits"]
            print(json.dumps(out), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
