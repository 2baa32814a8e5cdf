"""A decode engine killed mid-reply: agents stream long greedy replies from ``dualpath serve --decode 2``; once each
has ``--kill-after`` tokens, the process of decode engine 0 is killed (SIGKILL). With request migration (the
default) the replies that were on it go on from where they were on the other decode engine; the baseline, same
run, is ``--migration-limit 0``: those replies fail and each agent sends its request again from the start, as a
client of a server without migration must.

Reported per system: the replies that needed no second request, the stall of the replies that were on the killed
engine (from the kill until the reply has a token more than it had then: their time back to where the reader
was), what the frontend counted (moves, KV bytes loaded from storage), and whether every reply, moved or re-sent,
equals the same greedy reply in the other system (it must: both are the model's one greedy answer).

    python bench/migration.py [--agents 4 --context 400 --max-tokens 160 --kill-after 64] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "support"))
from common import print_table, write_result  # noqa: E402


def messages(agent: int, context: int) -> list[dict]:
    notes = " ".join(f"Note {agent}.{i}: step {i} of job {agent} ran for {i * 7 % 13} s." for i in range(context // 20))
    return [
        {"role": "system", "content": f"You are agent {agent}. Summarise the notes step by step. {notes}"},
        {"role": "user", "content": "Write the full summary, one line per step."},
    ]


class Agent:
    """One agent's reply, streamed; sent again from the start if a stream fails (``--migration-limit 0``)."""

    def __init__(self, http, model: str, agent: int, args):
        self.http, self.body = (
            http,
            {
                "model": model,
                "messages": messages(agent, args.context),
                "stream": True,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        self.ids: list[int] = []  # of the attempt being read
        self.arrivals: list[float] = []  # when each token of that attempt came
        self.attempts, self.error = 0, ""
        self.at_kill: int | None = None  # tokens the reader had when the engine was killed
        self.streaming = threading.Event()  # it has kill_after tokens
        self.kill_after = args.kill_after

    def run(self) -> None:
        while self.attempts < 3:
            self.attempts += 1
            self.ids, self.arrivals = [], []
            if self._stream():
                return

    def _stream(self) -> bool:
        """One attempt; whether it ended with a finish reason."""
        with self.http.stream("POST", "/v1/chat/completions", json=self.body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                body = json.loads(line[6:])
                if "error" in body:
                    self.error = body["error"]["message"]
                    return False
                for c in body["choices"]:
                    now = time.perf_counter()
                    for t in c.get("token_ids") or ():
                        self.ids.append(t)
                        self.arrivals.append(now)
                    if len(self.ids) >= self.kill_after:
                        self.streaming.set()
                    if c.get("finish_reason"):
                        return True
        return False

    def stall_s(self, killed_at: float) -> float:
        """From the kill until the reply (its last attempt) had a token more than the reader had then."""
        return self.arrivals[self.at_kill] - killed_at

    def gap_s(self) -> float:
        """Its median time between tokens before the kill."""
        return statistics.median(b - a for a, b in zip(self.arrivals[: self.at_kill], self.arrivals[1 : self.at_kill]))


def engine_pid(server, name: str) -> int:
    for pid in server.children():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--engine-id" in cmd and cmd[cmd.index(b"--engine-id") + 1] == name.encode():
            return pid
    raise RuntimeError(f"no {name} among the server's processes")


def metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^dualpath_{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def run(system: str, args) -> dict:
    import httpx
    from serve_process import ServeProcess

    limit = "3" if system == "migration" else "0"
    server = ServeProcess(
        *(["--model", args.model] if args.model else []),
        "--decode",
        "2",
        "--migration-limit",
        limit,
        "--kv-store",
        tempfile.mkdtemp(prefix="dualpath-bench-kv-"),
    )
    try:
        with httpx.Client(base_url=server.url, timeout=600) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            agents = [Agent(http, model, a, args) for a in range(args.agents)]
            threads = [threading.Thread(target=a.run) for a in agents]
            for t in threads:
                t.start()
            for a in agents:
                if not a.streaming.wait(300):
                    raise RuntimeError("an agent did not start streaming")
            for a in agents:
                a.at_kill = len(a.ids)
            killed_at = time.perf_counter()
            os.kill(engine_pid(server, "decode-0"), signal.SIGKILL)
            for t in threads:
                t.join(600)
            metrics = http.get("/metrics").text
    finally:
        server.stop()
    moves = metric(metrics, "request_migrations_total")
    # the replies the kill touched: those sent again, or (migration) as many as moved, the longest stalled
    by_stall = sorted(agents, key=lambda a: -a.stall_s(killed_at))
    hit = [a for a in agents if a.attempts > 1] if system == "send again" else by_stall[: int(moves)]
    return {
        "system": system,
        "agents": len(agents),
        "completed": sum(len(a.ids) == args.max_tokens for a in agents),
        "sent_again": sum(a.attempts > 1 for a in agents),
        "on_killed_engine": len(hit),
        "stall_p50_s": statistics.median(a.stall_s(killed_at) for a in hit) if hit else 0.0,
        "stall_max_s": max((a.stall_s(killed_at) for a in hit), default=0.0),
        "tokens_at_kill": statistics.mean(a.at_kill for a in agents),
        "token_gap_p50_s": statistics.median(a.gap_s() for a in agents),
        "migrations": moves,
        "kv_mb_loaded": metric(metrics, "kv_bytes_loaded_total") / 1e6,
        "per_agent": [
            {
                "tokens_at_kill": a.at_kill,
                "stall_s": a.stall_s(killed_at),
                "attempts": a.attempts,
                "token_gap_s": a.gap_s(),
            }
            for a in agents
        ],
        "replies": [a.ids for a in agents],
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--context", type=int, default=400, help="about this many tokens of system prompt per agent")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--kill-after", type=int, default=64, help="kill once every reply has this many tokens")
    ap.add_argument("--model", default=None, help="checkpoint (default: the server's default model)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = [run("migration", args), run("send again", args)]
    for r in rows:
        r["stall_vs_send_again"] = r["stall_p50_s"] / rows[1]["stall_p50_s"] if rows[1]["stall_p50_s"] else None
    same = rows[0].pop("replies") == rows[1].pop("replies")
    print_table(
        rows,
        [
            "system",
            "agents",
            "completed",
            "on_killed_engine",
            "sent_again",
            "tokens_at_kill",
            "token_gap_p50_s",
            "stall_p50_s",
            "stall_max_s",
            "stall_vs_send_again",
            "migrations",
            "kv_mb_loaded",
        ],
    )
    print("replies identical across the systems:", same)
    result = {
        "agents": args.agents,
        "context": args.context,
        "max_tokens": args.max_tokens,
        "kill_after": args.kill_after,
        "rows": rows,
        "replies_identical": same,
    }
    print("wrote", write_result("migration", result, args.out))
    return result


if __name__ == "__main__":
    main()
