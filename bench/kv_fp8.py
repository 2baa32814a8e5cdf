"""An 8-bit float KV cache (``--kv-cache-dtype fp8``) against the model's own dtype, same run, SmolLM2 in bfloat16:

1. serving: agent conversations against ``dualpath serve`` whose storage reads are capped (every stored prefix
   loaded: ``--load-every-hit``); KV bytes loaded per turn, bytes per stored block, and the time to first token
   of turns whose context is stored;
2. accuracy: prompt logprobs of chat prompts (every position of each) and greedy replies, fp8 against the bfloat16
   cache, with bfloat16 against float32 (both caches in the model's dtype) as the yardstick of an error users
   accept.

    python bench/kv_fp8.py [--storage-read-bps 2e7 --agents 2 --turns 3 --context 1500] [--model DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "support"))
from common import print_table, write_result  # noqa: E402
from slow_store import later_turns  # noqa: E402

PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "List five things to check when a build fails on CI, one line each.",
    "Summarise the plot of Romeo and Juliet for a ten-year-old.",
]


def serve(kv_cache_dtype: str, args) -> dict:
    later = later_turns(args, "--dtype", "bfloat16", "--kv-cache-dtype", kv_cache_dtype, "--load-every-hit")
    return {
        "kv_cache_dtype": kv_cache_dtype,
        "turns": len(later) + args.agents,
        "ttft_later_p50_s": statistics.median(t["ttft_s"] for t in later),
        "kv_bytes_per_cached_token": sum(t["kv_bytes_loaded"] for t in later)
        / max(1, sum(t["cached_tokens"] for t in later)),
        "kv_mb_loaded_later": sum(t["kv_bytes_loaded"] for t in later) / 1e6,
        "cached_share": sum(t["cached_tokens"] for t in later) / sum(t["prompt_tokens"] for t in later),
    }


def logprobs(model: str, dtype: str, kv_cache_dtype: str, max_tokens: int, quantization: str | None = None):
    """Each prompt's prompt logprobs and greedy reply under one (model dtype, KV dtype, weight quantization)."""
    from dualpath import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, quantization=quantization)
    convs = [[{"role": "user", "content": p}] for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=0)
    return [([lp.logprob for lp in o.prompt_logprobs[1:]], o.token_ids) for o in llm.chat(convs, params)]


def compare(name: str, a, b) -> dict:
    diffs = [abs(x - y) for (pa, _), (pb, _) in zip(a, b) for x, y in zip(pa, pb)]
    same = [
        next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), min(len(ra), len(rb)))
        for (_, ra), (_, rb) in zip(a, b)
    ]
    return {
        "comparison": name,
        "positions": len(diffs),
        "mean_abs_dlogprob": statistics.mean(diffs),
        "p99_abs_dlogprob": sorted(diffs)[int(0.99 * (len(diffs) - 1))],
        "max_abs_dlogprob": max(diffs),
        "greedy_tokens_equal_before_divergence": statistics.mean(same),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--storage-read-bps", type=float, default=2e7)
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--context", type=int, default=1500, help="about this many tokens of system prompt")
    ap.add_argument("--reply-tokens", type=int, default=48, help="greedy tokens per accuracy prompt")
    ap.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--skip-serving", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    result = {"storage_read_bps": args.storage_read_bps, "agents": args.agents, "turns": args.turns}
    if not args.skip_serving:
        rows = [serve("auto", args), serve("fp8", args)]
        for r in rows:
            r["ttft_vs_bf16_cache"] = r["ttft_later_p50_s"] / rows[0]["ttft_later_p50_s"]
            r["bytes_vs_bf16_cache"] = r["kv_bytes_per_cached_token"] / rows[0]["kv_bytes_per_cached_token"]
        print_table(
            rows,
            [
                "kv_cache_dtype",
                "turns",
                "cached_share",
                "kv_mb_loaded_later",
                "kv_bytes_per_cached_token",
                "bytes_vs_bf16_cache",
                "ttft_later_p50_s",
                "ttft_vs_bf16_cache",
            ],
        )
        result["serving"] = rows
    from dualpath.checkpoints.smollm2 import default_model_dir

    model = args.model or str(default_model_dir())
    fp32, bf16, fp8 = (
        logprobs(model, d, kv, args.reply_tokens)
        for d, kv in [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8")]
    )
    accuracy = [
        compare("bf16 model+cache vs fp32 (yardstick)", bf16, fp32),
        compare("fp8 cache vs bf16 cache (bf16 model)", fp8, bf16),
        compare("fp8 cache, bf16 model vs fp32", fp8, fp32),
    ]
    print_table(
        accuracy,
        [
            "comparison",
            "positions",
            "mean_abs_dlogprob",
            "p99_abs_dlogprob",
            "max_abs_dlogprob",
            "greedy_tokens_equal_before_divergence",
        ],
    )
    result["accuracy"] = accuracy
    print("wrote", write_result("kv_fp8", result, args.out))
    return result


if __name__ == "__main__":
    main()
