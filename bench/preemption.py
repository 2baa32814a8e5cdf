"""Priority preemption against ``dualpath serve --scheduling-policy priority``: background agents (priority 5) keep
the decode engine's memory full with long greedy replies, and urgent turns (priority -1) arrive every
``--interval`` seconds. With preemption (the default) an urgent turn that finds no room has a background reply
handed back (its blocks stored) and continued once there is room again; the baseline, same run, is
``--disable-priority-preemption``: the urgent turn waits for a background reply to end.

The decode engine's cache is sized from the model's KV geometry so that exactly ``--background`` replies fit and an
urgent one does not fit beside them. Prompts are token lists of exact lengths (``/v1/completions``).

Reported per system: the urgent turns' time to first token (p50, p90, max) and latency, an urgent turn's time to
first token on the idle cluster (the floor, measured first), the background tokens delivered per second while the
urgent turns arrived (counted as they stream), the preemptions the scheduler counted, and whether every reply (the
preempted and continued ones included) equals the same request's reply in the other system (it must: both are the
model's one greedy answer).

    python bench/preemption.py [--background 3 --urgent 6 --interval 6] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "support"))
from common import print_table, write_result  # noqa: E402

BLOCK = 64


def prompt(kind: str, i: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(f"{kind}-{i}")
    return [rng.randrange(3, vocab) for _ in range(n)]


def model_shape(model: str, blocks: int) -> tuple[int, int]:
    """The tokenizer's vocabulary size (what the server accepts in prompts), and the bytes of ``blocks`` KV blocks
    (float32)."""
    from dualpath.core.geometry import KVGeometry
    from dualpath.core.tokenizer import Tokenizer
    from dualpath.engines.models import open_checkpoint

    config = open_checkpoint(model).config
    return Tokenizer(model).vocab_size, KVGeometry.for_model(config, "float32", BLOCK).full_block_bytes * blocks


def stream(http, body: dict, on_tokens=lambda n: None) -> tuple[list[int], float, float]:
    """A streamed completion: its token ids, the seconds to its first token and to its end (``on_tokens``: called
    with the number of each chunk's tokens as they come)."""
    t0, first, ids = time.perf_counter(), None, []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True, "return_token_ids": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            for c in chunk["choices"]:
                ids += c.get("token_ids") or []
                on_tokens(len(c.get("token_ids") or ()))
                if ids and first is None:
                    first = time.perf_counter() - t0
    return ids, first if first is not None else float("nan"), time.perf_counter() - t0


def run(system: str, model: str, args) -> dict:
    import httpx
    from serve_process import ServeProcess

    fits = -(-(args.background_prompt + args.background_tokens) // BLOCK)
    urgent_blocks = -(-(args.urgent_prompt + args.urgent_tokens) // BLOCK)
    blocks = args.background * fits + urgent_blocks - 1  # the urgent turn never fits beside every background one
    vocab, memory = model_shape(model, blocks)
    flags = ["--disable-priority-preemption"] if system == "no preemption" else []
    server = ServeProcess(
        "--model",
        model,
        "--dtype",
        "float32",
        "--scheduling-policy",
        "priority",
        *flags,
        "--cache-bytes",
        str(memory),
        "--block-size",
        str(BLOCK),
        "--kv-store",
        tempfile.mkdtemp(prefix="dualpath-bench-kv-"),
    )
    replies: dict[str, list[int]] = {}
    urgent: list[dict] = []
    delivered, start = [0], [0.0]
    stop = threading.Event()
    try:
        with httpx.Client(base_url=server.url, timeout=600) as http:
            name = http.get("/v1/models").json()["data"][0]["id"]

            def background(a: int) -> None:
                for k in range(1000):
                    if stop.is_set():
                        return
                    body = {
                        "model": name,
                        "prompt": prompt("bg", a * 1000 + k, args.background_prompt, vocab),
                        "max_tokens": args.background_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                        "priority": 5,
                    }
                    replies[f"bg{a}.{k}"] = stream(http, body, count)[0]

            def count(n: int) -> None:  # background tokens delivered while urgent turns arrive
                if start[0] and not stop.is_set():
                    delivered[0] += n

            def turn(u: int) -> dict:
                body = {
                    "model": name,
                    "prompt": prompt("urgent", u, args.urgent_prompt, vocab),
                    "max_tokens": args.urgent_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "priority": -1,
                }
                ids, ttft, total = stream(http, body)
                replies[f"u{u}"] = ids
                return {"turn": u, "ttft_s": ttft, "latency_s": total}

            idle = min((turn(-1 - i) for i in range(2)), key=lambda t: t["ttft_s"])  # the floor: an idle cluster

            agents = [threading.Thread(target=background, args=(a,)) for a in range(args.background)]
            for t in agents:
                t.start()
                time.sleep(args.interval / args.background)  # staggered: replies end at different times
            start[0], turns = time.perf_counter(), []
            for u in range(args.urgent):
                time.sleep(max(0.0, start[0] + u * args.interval - time.perf_counter()))
                turns.append(threading.Thread(target=lambda u=u: urgent.append(turn(u))))
                turns[-1].start()
                print(f"{system}: urgent turn {u + 1}/{args.urgent} sent", flush=True)
            for t in turns:
                t.join(600)
            window = time.perf_counter() - start[0]
            stop.set()
            for t in agents:
                t.join(600)
            stats = http.get("/get_server_info").json()["internal_states"][0]  # the scheduler's
    finally:
        server.stop()
    ttft = sorted(u["ttft_s"] for u in urgent)
    return {
        "system": system,
        "urgent_turns": len(urgent),
        "idle_ttft_s": idle["ttft_s"],
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
        "ttft_max_s": ttft[-1],
        "latency_p50_s": statistics.median(u["latency_s"] for u in urgent),
        "background_tok_s": delivered[0] / window,
        "window_s": window,
        "preempted": stats["preempted"],
        "failed": stats["failed"],
        "per_turn": sorted(urgent, key=lambda u: u["turn"]),
        "replies": replies,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--background", type=int, default=3, help="background agents (their replies fill the cache)")
    ap.add_argument("--background-prompt", type=int, default=320)
    ap.add_argument("--background-tokens", type=int, default=128)
    ap.add_argument("--urgent", type=int, default=6, help="urgent turns, one every --interval s")
    ap.add_argument("--urgent-prompt", type=int, default=200)
    ap.add_argument("--urgent-tokens", type=int, default=16)
    ap.add_argument("--interval", type=float, default=6.0)
    ap.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from dualpath.checkpoints.smollm2 import default_model_dir

    model = args.model or str(default_model_dir())
    rows = [run("preemption", model, args), run("no preemption", model, args)]
    both = rows[0]["replies"].keys() & rows[1]["replies"].keys()
    same = all(rows[0]["replies"][k] == rows[1]["replies"][k] for k in both)
    for r in rows:
        r.pop("replies")
        r["ttft_p50_vs_no_preemption"] = r["ttft_p50_s"] / rows[1]["ttft_p50_s"]
        # (None when none streamed in the window: a toy model's tokens may wait for whole characters)
        r["background_vs_no_preemption"] = (
            r["background_tok_s"] / rows[1]["background_tok_s"] if rows[1]["background_tok_s"] else None
        )
    print_table(
        rows,
        [
            "system",
            "urgent_turns",
            "idle_ttft_s",
            "ttft_p50_s",
            "ttft_p90_s",
            "ttft_max_s",
            "latency_p50_s",
            "ttft_p50_vs_no_preemption",
            "background_tok_s",
            "background_vs_no_preemption",
            "preempted",
        ],
    )
    print(f"replies identical across the systems: {same} ({len(both)} compared)")
    result = {"args": vars(args), "rows": rows, "replies_compared": len(both), "replies_identical": same}
    print("wrote", write_result("preemption", result, args.out))
    return result


if __name__ == "__main__":
    main()
