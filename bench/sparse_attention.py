"""DeepSeek-V3.2's sparse attention in the torch reference: MLA attention over every cached token (V3's) against
the indexer's choice of ``topk`` tokens and attention over those alone (V3.2's), at V3.2's shapes (MLA latent 512 +
rope 64, indexer 64 heads x 128, topk 2,048) and growing contexts, in the same run: a decode step of ``--batch``
sequences, and a prefill of ``--prefill`` new tokens of one sequence.

    python bench/sparse_attention.py [--contexts 4096 16384 32768] [--batch 8] [--prefill 256] [--heads 16]

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
from dualpath.kernels.attention import mla_attention  # noqa: E402
from dualpath.kernels.sparse_attention import IndexQuery  # noqa: E402

LATENT, ROPE, NOPE, VALUE = 512, 64, 128, 128
INDEX_HEADS, INDEX_DIM = 64, 128


def measure(
    step: str, new_lens: list[int], context: int, heads: int, topk: int, repeats: int, dtype: torch.dtype
) -> dict:
    """Sequence i has ``context - new_lens[i]`` cached tokens and ``new_lens[i]`` new ones."""
    t, width = sum(new_lens), LATENT + ROPE + INDEX_DIM
    cached = [torch.randn(context - n, width, dtype=dtype) for n in new_lens]
    new = torch.randn(t, width, dtype=dtype)
    q_nope, q_pe = torch.randn(t, heads, NOPE, dtype=dtype), torch.randn(t, heads, ROPE, dtype=dtype)
    w = torch.randn(heads, NOPE + VALUE, LATENT, dtype=dtype) * LATENT**-0.5
    index = IndexQuery(
        torch.randn(t, INDEX_HEADS, INDEX_DIM, dtype=dtype),
        torch.randn(t, INDEX_HEADS, dtype=dtype),
        LATENT + ROPE,
        topk,
        INDEX_DIM**-0.5,
    )

    def attend(ix):
        return lambda: mla_attention(
            q_nope, q_pe, new, cached, new_lens, w[:, :NOPE], w[:, NOPE:], LATENT, 0.07, index=ix
        )

    dense, sparse = best_of(attend(None), repeats), best_of(attend(index), repeats)
    return {
        "step": step,
        "sequences": len(new_lens),
        "new_tokens": t,
        "context": context,
        "heads": heads,
        "topk": topk,
        "dense_ms": 1e3 * dense,
        "sparse_ms": 1e3 * sparse,
        "dense_over_sparse": dense / sparse,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prefill", type=int, default=256)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = []
    for context in args.contexts:
        rows.append(measure("decode", [1] * args.batch, context, args.heads, args.topk, args.repeats, dtype))
        rows.append(measure("prefill", [args.prefill], context, args.heads, args.topk, args.repeats, dtype))
        print(f"context {context}: done", file=sys.stderr, flush=True)
    path = write_result("sparse_attention", {"dtype": args.dtype, "rows": rows}, args.out)
    print_table(
        rows,
        ["step", "sequences", "new_tokens", "context", "heads", "topk", "dense_ms", "sparse_ms", "dense_over_sparse"],
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
