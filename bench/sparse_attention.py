"""DeepSeek-V3.2's sparse attention in the torch reference: a decode step's MLA attention over every cached token
(V3's) against the indexer's choice of ``topk`` tokens and attention over those alone (V3.2's), at V3.2's shapes
(MLA latent 512 + rope 64, indexer 64 heads x 128, topk 2,048) and growing contexts, in the same run.

    python bench/sparse_attention.py [--contexts 4096 16384 32768] [--batch 8] [--heads 16]

``--heads`` is the attention's query heads (V3.2 has 128; fewer keep a CPU run short: the indexer's cost does not
depend on it, so fewer heads understate the saving). Writes ``bench/results/sparse_attention.json``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import best_of, print_table, write_result  # noqa: E402
from kernels.attention import mla_attention  # noqa: E402
from kernels.sparse_attention import IndexQuery  # noqa: E402

LATENT, ROPE, NOPE, VALUE = 512, 64, 128, 128
INDEX_HEADS, INDEX_DIM = 64, 128


def step_inputs(batch: int, context: int, heads: int, dtype: torch.dtype):
    width = LATENT + ROPE + INDEX_DIM
    cached = [torch.randn(context - 1, width, dtype=dtype) for _ in range(batch)]
    new = torch.randn(batch, width, dtype=dtype)
    q_nope, q_pe = torch.randn(batch, heads, NOPE, dtype=dtype), torch.randn(batch, heads, ROPE, dtype=dtype)
    w_kv_b = torch.randn(heads, NOPE + VALUE, LATENT, dtype=dtype) * LATENT ** -0.5
    return cached, new, q_nope, q_pe, w_kv_b


def measure(batch: int, context: int, heads: int, topk: int, repeats: int, dtype: torch.dtype) -> dict:
    cached, new, q_nope, q_pe, w = step_inputs(batch, context, heads, dtype)
    index = IndexQuery(torch.randn(batch, INDEX_HEADS, INDEX_DIM, dtype=dtype),
                       torch.randn(batch, INDEX_HEADS, dtype=dtype), LATENT + ROPE, topk, INDEX_DIM ** -0.5)

    def attend(ix):
        return lambda: mla_attention(q_nope, q_pe, new, cached, [1] * batch, w[:, :NOPE], w[:, NOPE:], LATENT, 0.07,
                                     index=ix)

    dense, sparse = best_of(attend(None), repeats), best_of(attend(index), repeats)
    return {"batch": batch, "context": context, "heads": heads, "topk": topk, "dense_ms": 1e3 * dense,
            "sparse_ms": 1e3 * sparse, "dense_over_sparse": dense / sparse}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = []
    for context in args.contexts:
        rows.append(measure(args.batch, context, args.heads, args.topk, args.repeats, dtype))
        print(f"context {context}: done", file=sys.stderr, flush=True)
    path = write_result("sparse_attention", {"dtype": args.dtype, "rows": rows}, args.out)
    print_table(rows, ["batch", "context", "heads", "topk", "dense_ms", "sparse_ms", "dense_over_sparse"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
