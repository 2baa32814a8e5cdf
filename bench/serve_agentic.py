"""Simulated agents doing multi-turn chat against ``dualpath serve``: TTFT, TPOT, throughput and cache-hit rate
per read-path mode, each against ``basic`` in the same run (one server; the mode is chosen per request).

Each agent keeps one conversation: a long system prompt, then turns that append the model's reply and a new tool
result, as coding agents do. Every mode gets fresh conversations (a mode tag in the system prompt), so no mode
reuses another's stored KV.

    python bench/serve_agentic.py [--agents 4 --turns 5] [--model DIR] [--out bench/results/serve_agentic.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "support"))
from common import print_table, write_result  # noqa: E402

TOOL_OUTPUT = (
    "$ pytest -q tests/test_parser.py\n..F.\nFAILED tests/test_parser.py::test_nested - "
    "AssertionError: expected 3 tokens, got 2\n"
)


def agent(client, model, mode, idx, args, out: list):
    system = (
        f"[{mode}-{idx}] You are a coding agent working in a repository. Think briefly, then act. "
        "Keep every answer under two sentences. "
    ) * 6
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Fix the failing test."}]
    for turn in range(args.turns):
        start, first, text, chunks, usage = time.perf_counter(), None, [], 0, None
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=args.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"dualpath": {"mode": mode, "usage": True}},
        )
        for ch in stream:
            if ch.usage is not None:
                usage = ch.usage
            if ch.choices and ch.choices[0].delta.content:
                now = time.perf_counter()
                first = first or now
                text.append(ch.choices[0].delta.content)
                chunks += 1
        end = time.perf_counter()
        n = usage.completion_tokens
        out.append(
            {
                "mode": mode,
                "turn": turn,
                "ttft": (first or end) - start,
                "tpot": (end - first) / max(1, n - 1) if first else 0.0,
                "completion_tokens": n,
                "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": usage.prompt_tokens_details.cached_tokens,
                "path": usage.model_extra["dualpath"]["read_path"],
            }
        )
        messages += [
            {"role": "assistant", "content": "".join(text)},
            {"role": "user", "content": TOOL_OUTPUT + f"(turn {turn})"},
        ]


def run_mode(client, model, mode, args) -> dict:
    out: list = []
    threads = [threading.Thread(target=agent, args=(client, model, mode, i, args, out)) for i in range(args.agents)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    later = [r for r in out if r["turn"] > 0]
    return {
        "mode": mode,
        "requests": len(out),
        "wall_s": wall,
        "ttft_p50_s": statistics.median(r["ttft"] for r in out),
        "ttft_later_turns_p50_s": statistics.median(r["ttft"] for r in later) if later else 0.0,
        "tpot_p50_s": statistics.median(r["tpot"] for r in out),
        "output_tok_s": sum(r["completion_tokens"] for r in out) / wall,
        "hit_rate": sum(r["cached_tokens"] for r in out) / sum(r["prompt_tokens"] for r in out),
        "paths": sorted({r["path"] for r in later}),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--model", default=None, help="checkpoint (default: the server's default model)")
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import tempfile

    import openai
    from serve_process import ServeProcess

    extra = ["--model", args.model] if args.model else []
    server = ServeProcess(
        *extra,
        "--prefill",
        str(args.prefill),
        "--decode",
        str(args.decode),
        "--kv-store",
        tempfile.mkdtemp(prefix="dualpath-bench-kv-"),
    )
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        rows = [run_mode(client, model, mode, args) for mode in ("basic", "pe", "de", "dualpath")]
    finally:
        server.stop()
    base = rows[0]
    for r in rows:
        r["ttft_vs_basic"] = r["ttft_later_turns_p50_s"] / base["ttft_later_turns_p50_s"]
        r["throughput_vs_basic"] = r["output_tok_s"] / base["output_tok_s"]
    print_table(
        rows,
        [
            "mode",
            "requests",
            "ttft_p50_s",
            "ttft_later_turns_p50_s",
            "tpot_p50_s",
            "output_tok_s",
            "hit_rate",
            "ttft_vs_basic",
            "throughput_vs_basic",
        ],
    )
    result = {
        "agents": args.agents,
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "engines": f"{args.prefill}P{args.decode}D",
        "model": model,
        "rows": rows,
    }
    print("wrote", write_result("serve_agentic", result, args.out))
    return result


if __name__ == "__main__":
    main()
