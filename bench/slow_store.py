"""A slow KV store: turns of agent conversations against ``dualpath serve`` whose storage reads are capped low,
with the scheduler recomputing a stored prefix that is slower to load (the default) ÷ loading every stored block
(``--load-every-hit``, the paper's systems), same run, same conversations (each server its own store).

What it shows: the time to first token of turns whose context is stored, and how much of it was loaded vs
recomputed. At the default cap (4 MB/s: ~90 SmolLM2 tokens/s in float32, 46 KB each) loading a 1,400-token context
takes ~16 s, computing it on these CPUs ~8 s; at 20 MB/s loading is the faster (~3 s) and both systems load.

    python bench/slow_store.py [--storage-read-bps 4e6 --agents 2 --turns 3 --context 1500] [--model DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "support"))
from common import print_table, write_result  # noqa: E402


def conversation_turns(http, model: str, agent: int, args) -> list[dict]:
    system = f"[agent {agent}] You review build logs. Answer in one short sentence. " + " ".join(
        f"Rule {i}: report the first failing step and its exit code." for i in range(args.context // 16)
    )
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Step 3 failed with exit 2."}]
    out = []
    for turn in range(args.turns):
        t = time.perf_counter()
        body = http.post(
            "/v1/chat/completions",
            json={"model": model, "messages": messages, "max_tokens": 1, "temperature": 0, "dualpath": {"usage": True}},
        ).json()
        ttft = time.perf_counter() - t
        usage = body["usage"]
        out.append(
            {
                "turn": turn,
                "ttft_s": ttft,
                "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                "kv_bytes_loaded": usage["dualpath"]["kv_bytes_loaded"],
            }
        )
        messages += [
            {"role": "assistant", "content": body["choices"][0]["message"]["content"] or "ok"},
            {"role": "user", "content": f"Step {turn + 4} failed with exit {turn + 1}. Next?"},
        ]
    return out


def later_turns(args, *serve_args: str) -> list[dict]:
    """The agents' conversations against a fresh ``dualpath serve`` with ``serve_args`` (its own store, reads
    capped at ``args.storage_read_bps``): every turn after each agent's first."""
    import httpx
    from serve_process import ServeProcess

    server = ServeProcess(
        *(["--model", args.model] if args.model else []),
        *serve_args,
        "--kv-store",
        tempfile.mkdtemp(prefix="dualpath-bench-kv-"),
        "--storage-read-bps",
        str(args.storage_read_bps),
    )
    try:
        with httpx.Client(base_url=server.url, timeout=600) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            turns = [t for a in range(args.agents) for t in conversation_turns(http, model, a, args)]
    finally:
        server.stop()
    return [t for t in turns if t["turn"] > 0]


def run(system: str, args) -> dict:
    later = later_turns(args, *(["--load-every-hit"] if system == "load every hit" else []))
    return {
        "system": system,
        "turns": len(later) + args.agents,
        "ttft_later_p50_s": statistics.median(t["ttft_s"] for t in later),
        "ttft_later_mean_s": statistics.mean(t["ttft_s"] for t in later),
        "loaded_share": sum(t["cached_tokens"] for t in later) / sum(t["prompt_tokens"] for t in later),
        "context_tokens": statistics.mean(t["prompt_tokens"] for t in later),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--storage-read-bps", type=float, default=4e6)
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--context", type=int, default=1500, help="about this many tokens of system prompt")
    ap.add_argument("--model", default=None, help="checkpoint (default: the server's default model)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = [run("load every hit", args), run("recompute slow prefixes", args)]
    for r in rows:
        r["ttft_vs_load_every_hit"] = r["ttft_later_p50_s"] / rows[0]["ttft_later_p50_s"]
    print_table(
        rows,
        [
            "system",
            "turns",
            "context_tokens",
            "ttft_later_p50_s",
            "ttft_later_mean_s",
            "loaded_share",
            "ttft_vs_load_every_hit",
        ],
    )
    result = {"storage_read_bps": args.storage_read_bps, "agents": args.agents, "turns": args.turns, "rows": rows}
    print("wrote", write_result("slow_store", result, args.out))
    return result


if __name__ == "__main__":
    main()
