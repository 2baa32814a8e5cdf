"""Parallel sampling against ``dualpath serve``: ``n`` choices of one agentic turn as one request (the prompt's
stored KV loaded once, the decode engine forking the choices off its blocks) against the same ``n`` choices as
``n`` requests of their own (what the server did before: each loads the whole context from storage), in the same
run, on the same stored context, under a storage read cap (the bottleneck DualPath is about).

Both ways give the same tokens (choice i is sampled with seed + i either way); the bench checks that, then reports
the wall time to the last choice and the KV bytes read from storage.

    python bench/parallel_sampling.py [--n 4 8] [--context 2048] [--storage-read-bps 2e8] [--model DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "support"))
from common import print_table, write_result  # noqa: E402

TOOL_OUTPUT = "$ pytest -q tests/test_parser.py\n..F.\nFAILED tests/test_parser.py::test_nested - AssertionError\n"


def context_prompt(tag: str, tokens: int) -> str:
    """An agent's context: a tagged system prompt and tool outputs, about ``tokens`` long for SmolLM2's tokenizer."""
    return f"[{tag}] You are a coding agent. " + TOOL_OUTPUT * max(1, tokens // 40)


def one_request(client, model, prompt, n, args) -> tuple[list[str], int]:
    r = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=args.max_tokens,
        temperature=1.0,
        seed=args.seed,
        n=n,
        extra_body={"dualpath": {"usage": True}},
    )
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    return texts, r.usage.model_extra["dualpath"]["kv_bytes_loaded"]


def separate_requests(client, model, prompt, n, args) -> tuple[list[str], int]:
    """The old way: choice i as a request of its own with seed + i, all at once."""
    texts, loaded = [None] * n, [0] * n

    def run(i):
        r = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=args.max_tokens,
            temperature=1.0,
            seed=args.seed + i,
            extra_body={"dualpath": {"usage": True}},
        )
        texts[i], loaded[i] = r.choices[0].text, r.usage.model_extra["dualpath"]["kv_bytes_loaded"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return texts, sum(loaded)


def measure(client, model, n, args) -> dict:
    row = {"n": n}
    for repeat in range(args.repeats):
        prompt = context_prompt(f"n{n}-r{repeat}", args.context)
        client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)  # the context stored
        for name, fn in (("separate", separate_requests), ("parallel", one_request)):
            t = time.perf_counter()
            texts, loaded = fn(client, model, prompt, n, args)
            wall = time.perf_counter() - t
            row[f"{name}_s"] = min(row.get(f"{name}_s", wall), wall)
            row[f"{name}_kv_mb"] = loaded / 1e6
            row.setdefault("texts", {})[name] = texts
        if row["texts"]["separate"] != row["texts"]["parallel"]:
            raise SystemExit(f"n={n}: the choices differ between the two ways")
    del row["texts"]
    row["speedup"] = row["separate_s"] / row["parallel_s"]
    row["kv_read_ratio"] = row["separate_kv_mb"] / max(row["parallel_kv_mb"], 1e-9)
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--context", type=int, default=2048, help="about this many prompt tokens, stored beforehand")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--storage-read-bps", type=float, default=2e8, help="each node's storage read cap (0: none)")
    ap.add_argument("--model", default=None, help="checkpoint (default: the server's default model)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import openai
    from serve_process import ServeProcess

    extra = ["--model", args.model] if args.model else []
    server = ServeProcess(
        *extra,
        "--kv-store",
        tempfile.mkdtemp(prefix="dualpath-bench-kv-"),
        "--storage-read-bps",
        str(args.storage_read_bps),
        "--max-model-len",
        str(args.context * 2),
    )
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        measure(client, model, 2, argparse.Namespace(**{**vars(args), "repeats": 1, "context": 64}))  # warm-up
        rows = [measure(client, model, n, args) for n in args.n]
    finally:
        server.stop()
    print_table(rows, ["n", "separate_s", "parallel_s", "speedup", "separate_kv_mb", "parallel_kv_mb", "kv_read_ratio"])
    result = {
        "context_tokens": args.context,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "storage_read_bps": args.storage_read_bps,
        "model": model,
        "rows": rows,
    }
    print("wrote", write_result("parallel_sampling", result, args.out))
    return result


if __name__ == "__main__":
    main()
