"""Tensor parallelism on CPU: one engine's model split across 1 and 2 ranks (``LLM(..., tensor_parallel_size=N)``),
a small random Llama (8 heads, 4 KV heads, 4 layers, hidden 512, MLP 1536, vocabulary 8192), float32, one thread
per rank.

Measured per tensor-parallel size, each in a fresh process (so one size's memory is not the next one's):

1. memory: the bytes of weights rank 0 holds (its parameters: each rank reads only its slices of the checkpoint),
   and how much the process's peak RSS grew while the model loaded (``VmHWM`` after ``clear_refs``; Linux; the
   other ranks' whole-process peak RSS, torch included, is recorded beside it);
2. time: a prefill of one prompt (``--prompt-tokens``, one output token), and a decode step of a batch (the
   greedy batch of ``--max-tokens`` minus its one-token prefill, per further token): best of ``--repeats``;
3. outputs: every greedy reply at TP 2 must equal TP 1's (the shards' partial sums add up to the same logits).

On a CPU, at this size, a decode step's two all-reduces per layer (gloo, through the loopback) cost more than its
halved matrix products save, and a prefill about breaks even: the time rows say what the collectives cost here, not
what GPUs gain. Memory per rank is the point of this bench.

    python bench/tensor_parallel.py [--quick] [--sizes 1 2] [--batch 4] [--max-tokens 32] [--prompt-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from common import best_of, print_table, write_result  # noqa: E402 - after the path

MODEL = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 8192,
}
QUICK_MODEL = {**MODEL, "num_hidden_layers": 2}


def _status_kib(pid: int | str, key: str) -> int | None:
    """``key`` (VmRSS, VmHWM) of process ``pid`` in KiB, from /proc (None where there is none)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux 4.0+)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def worker(args) -> dict:
    """One tensor-parallel size in this process: load, measure, generate; the numbers as a dict."""
    import time

    import torch

    torch.set_num_threads(1)
    from dualpath import LLM, SamplingParams

    rss0 = _status_kib("self", "VmRSS")
    reset = _reset_peak()
    t = time.perf_counter()
    llm = LLM(args.model, num_kv_blocks=args.kv_blocks, block_size=16, tensor_parallel_size=args.worker)
    load_s = time.perf_counter() - t
    peak = _status_kib("self", "VmHWM")
    try:
        others = [p.pid for p in getattr(llm.ranks, "procs", ())]
        row = {
            "tp": args.worker,
            "load_s": load_s,
            "rank0_weight_bytes": sum(p.numel() * p.element_size() for p in llm.model.parameters()),
            "rank0_load_rss_growth_bytes": (peak - rss0) * 1024 if reset and peak and rss0 else None,
            "other_ranks_peak_rss_bytes": [(_status_kib(pid, "VmHWM") or 0) * 1024 for pid in others],
        }
        vocab = llm.model_config.vocab_size
        long_prompt = [(i * 7919) % (vocab // 2) + vocab // 4 for i in range(args.prompt_tokens)]
        prompts = [[(i * 31 + k * 17) % (vocab // 2) + 3 for k in range(16 + 4 * i)] for i in range(args.batch)]
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        got = {}
        row["prefill_s"] = best_of(lambda: llm.generate(long_prompt, one), args.repeats)
        row["prefill_tok_s"] = args.prompt_tokens / row["prefill_s"]
        batch_prefill_s = best_of(lambda: llm.generate(prompts, one), args.repeats)
        batch_s = best_of(lambda: got.update(outs=llm.generate(prompts, greedy)), args.repeats)
        row["decode_step_s"] = max(batch_s - batch_prefill_s, 0.0) / max(args.max_tokens - 1, 1)
        row["decode_tok_s"] = args.batch / row["decode_step_s"] if row["decode_step_s"] else None
        row["outputs"] = [list(o.token_ids) for o in got["outs"]]
    finally:
        llm.close()
    return row


def run_size(args, tp: int) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        str(tp),
        "--model",
        args.model,
        "--batch",
        str(args.batch),
        "--max-tokens",
        str(args.max_tokens),
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--repeats",
        str(args.repeats),
        "--kv-blocks",
        str(args.kv_blocks),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=args.timeout, env=env)
    if res.returncode:
        raise SystemExit(f"tensor-parallel size {tp} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="a smoke run in well under a minute: 2 layers, short prompts, one repeat"
    )
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes (the first: reference)")
    ap.add_argument("--model", default=None, help="a dense Llama-family checkpoint (default: a random one, built)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-blocks", type=int, default=256, help="KV cache blocks of 16 tokens")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per size")
    ap.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)  # one size, in its own process
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return {}
    if args.quick:
        args.batch, args.max_tokens, args.prompt_tokens, args.repeats = 2, 6, 64, 1
    shape = QUICK_MODEL if args.quick else MODEL
    if args.model is None:
        from dualpath.checkpoints.tiny import build_tiny_checkpoint

        args.model = str(build_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="tp-bench-")) / "llama", "llama", **shape))
        model = {"built": "llama", **shape}
    else:
        model = {"dir": args.model}

    rows = [run_size(args, tp) for tp in args.sizes]
    ref = rows[0]
    for r in rows:
        r["weight_bytes_vs_first"] = r["rank0_weight_bytes"] / ref["rank0_weight_bytes"]
        r["prefill_vs_first"] = r["prefill_s"] / ref["prefill_s"]
        r["decode_step_vs_first"] = r["decode_step_s"] / ref["decode_step_s"] if ref["decode_step_s"] else None
        r["outputs_equal_first"] = r["outputs"] == ref["outputs"]
    print_table(
        rows,
        [
            "tp",
            "rank0_weight_bytes",
            "weight_bytes_vs_first",
            "rank0_load_rss_growth_bytes",
            "load_s",
            "prefill_s",
            "prefill_vs_first",
            "decode_step_s",
            "decode_step_vs_first",
            "outputs_equal_first",
        ],
    )
    result = {
        "model": model,
        "quick": args.quick,
        "threads_per_rank": 1,
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens,
        "repeats": args.repeats,
        "rows": rows,
        "outputs_equal": all(r["outputs_equal_first"] for r in rows),
    }
    print("wrote", write_result("tensor_parallel", result, args.out))
    if not result["outputs_equal"]:
        print("MISMATCH: a tensor-parallel size's greedy replies differ from the first size's", file=sys.stderr)
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
