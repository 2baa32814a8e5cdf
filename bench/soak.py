"""Soak: agents hammer ``dualpath serve`` for a while with what real clients send — multi-turn chats that grow,
streams they walk away from, parallel samples, JSON mode, patterns and choices, repeated turns and malformed
requests, with health probes (``/health_generate``) and an operator's short pauses (``/pause?mode=wait``) among
them — under a KV store cap small enough that blocks are evicted while other requests are about to load them.
Then it checks that nothing leaked and nothing went wrong:

- no 5xx, and every bad request a 4xx naming it; the server healthy at the end;
- a repeated greedy turn answers what it answered the first time (its KV then computed, now loaded or evicted);
- once the agents stop: no request in flight at the frontend, none held by any engine, the decode engines' KV
  caches empty again, the store under its cap (plus what one recount interval lets through).

    python bench/soak.py [--seconds 180 --agents 4 --storage-capacity 150MB --decode 1] [--model DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "support"))
from common import print_table, write_result  # noqa: E402

ACTIONS = (
    ("chat", 0.47),
    ("stream", 0.15),
    ("walk_away", 0.1),
    ("repeat", 0.08),
    ("samples", 0.05),
    ("json_mode", 0.04),
    ("pattern", 0.04),
    ("bad", 0.03),
    ("probe", 0.025),
    ("pause", 0.015),
)
PATTERNS = (
    (r"(PASS|FAIL): [a-z ]{1,24}\.", {}),
    (r"\d{1,4}", {}),
    (None, {"guided_choice": ["retry", "skip", "abort the build"]}),
    (
        None,
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "step",
                    "schema": {
                        "type": "object",
                        "properties": {
                            "step": {"type": "string", "pattern": "^[a-z]+-\\d{1,3}$"},
                            "why": {"type": "string", "maxLength": 30},
                        },
                        "required": ["step", "why"],
                        "additionalProperties": False,
                    },
                },
            }
        },
    ),
)
BAD = (
    {"messages": "not a list"},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
    {"messages": [{"role": "user", "content": "x " * 40_000}]},
    {"messages": [], "n": 99},
)


class Agent:
    """One client's conversation and its record of what happened."""

    def __init__(self, idx: int, url: str, model: str, rng: random.Random, stats: "Stats"):
        self.url, self.model, self.rng, self.stats = url, model, rng, stats
        system = f"[agent {idx}] You are a terse assistant for a build system. Answer in one short sentence. " * 5
        self.messages = [{"role": "system", "content": system}, {"role": "user", "content": "What failed?"}]
        self.answers: list[tuple[list, str]] = []  # (messages, greedy answer)

    def run(self, until: float) -> None:
        import httpx

        with httpx.Client(base_url=self.url, timeout=300) as http:
            while time.monotonic() < until:
                action = self.rng.choices([a for a, _ in ACTIONS], [w for _, w in ACTIONS])[0]
                t = time.perf_counter()
                try:
                    getattr(self, action)(http)
                except Exception as e:  # noqa: BLE001 - recorded: any exception is a finding
                    self.stats.problem(f"{action}: {type(e).__name__}: {e}")
                self.stats.done(action, time.perf_counter() - t)
                if len(self.messages) > 24:  # a new conversation (the old one's blocks age out of the store)
                    self.messages = self.messages[:1] + [{"role": "user", "content": f"New task {self.rng.random()}"}]

    def _post(self, http, body: dict, want: int = 200) -> dict:
        r = http.post("/v1/chat/completions", json={"model": self.model, **body})
        self.stats.status(r.status_code)
        if r.status_code != want:
            raise AssertionError(f"status {r.status_code} (wanted {want}): {r.text[:200]}")
        return r.json()

    def chat(self, http) -> None:
        body = self._post(http, {"messages": self.messages, "max_tokens": 8, "temperature": 0})
        answer = body["choices"][0]["message"]["content"]
        self.answers.append((list(self.messages), answer))
        self.stats.tokens(body["usage"])
        self._turn(answer)

    def stream(self, http) -> None:
        body = {"model": self.model, "messages": self.messages, "max_tokens": 8, "temperature": 0, "stream": True}
        text = []
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            self.stats.status(r.status_code)
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise AssertionError(f"stream error: {chunk['error']}")
                    if chunk["choices"]:
                        text.append(chunk["choices"][0]["delta"].get("content") or "")
        self._turn("".join(text))

    def walk_away(self, http) -> None:
        body = {"model": self.model, "messages": self.messages, "max_tokens": 200, "temperature": 0.7, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            self.stats.status(r.status_code)
            for i, _ in enumerate(r.iter_lines()):
                if i >= 2:
                    break

    def repeat(self, http) -> None:
        if not self.answers:
            return
        messages, before = self.rng.choice(self.answers[-6:])
        body = self._post(http, {"messages": messages, "max_tokens": 8, "temperature": 0})
        self.stats.repeat(
            body["choices"][0]["message"]["content"] == before,
            body["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0),
        )

    def samples(self, http) -> None:
        body = self._post(
            http,
            {
                "messages": self.messages,
                "max_tokens": 8,
                "temperature": 0.8,
                "n": 3,
                "seed": self.rng.randrange(1 << 30),
            },
        )
        if len(body["choices"]) != 3:
            raise AssertionError(f"{len(body['choices'])} choices for n=3")

    def json_mode(self, http) -> None:
        body = self._post(
            http,
            {
                "messages": self.messages + [{"role": "user", "content": "Reply in JSON."}],
                "max_tokens": 24,
                "temperature": 0,
                "response_format": {"type": "json_object"},
            },
        )
        choice = body["choices"][0]
        if choice["finish_reason"] == "stop":
            json.loads(choice["message"]["content"])

    def pattern(self, http) -> None:
        """guided_regex, guided_choice, or a schema with string rules: what ends must match."""
        pattern, extra = self.rng.choice(PATTERNS)
        ask = {"guided_regex": pattern} if pattern else extra
        body = self._post(
            http,
            {
                "messages": self.messages + [{"role": "user", "content": "Verdict?"}],
                "max_tokens": 24,
                "temperature": 0.7,
                **ask,
            },
        )
        choice = body["choices"][0]
        if choice["finish_reason"] != "stop":
            return
        text = choice["message"]["content"]
        if (
            pattern
            and not re.fullmatch(pattern, text, re.ASCII)
            or "guided_choice" in ask
            and text not in ask["guided_choice"]
        ):
            raise AssertionError(f"{text!r} does not match {ask}")
        if "response_format" in ask:
            value = json.loads(text)
            if not re.fullmatch(r"[a-z]+-\d{1,3}", value["step"]) or len(value["why"]) > 30:
                raise AssertionError(f"{text!r} breaks the schema's string rules")

    def probe(self, http) -> None:
        """/health_generate: 200, or 503 only while another agent has generation paused."""
        r = http.get("/health_generate")
        if r.status_code == 503 and "paused" in r.json().get("error", ""):
            return  # told as it should be (not a 5xx of the soak's)
        self.stats.status(r.status_code)
        if r.status_code != 200:
            raise AssertionError(f"/health_generate: {r.status_code} {r.text[:200]}")

    def pause(self, http) -> None:
        """An operator's pause that lets what runs finish (mode wait): the others' requests wait in the queue."""
        r = http.post("/pause", params={"mode": "wait", "timeout": 60})
        self.stats.status(r.status_code)
        time.sleep(self.rng.uniform(0.05, 0.5))
        http.post("/resume").raise_for_status()  # another agent's pause may have ended this one: a no-op then
        if r.status_code != 200 or r.json().get("num_aborted_requests") != 0:
            raise AssertionError(f"/pause?mode=wait: {r.status_code} {r.text[:200]}")

    def bad(self, http) -> None:
        self._post(http, dict(self.rng.choice(BAD)), want=400)

    def _turn(self, answer: str) -> None:
        self.messages += [
            {"role": "assistant", "content": answer},
            {
                "role": "user",
                "content": f"Log line {self.rng.randrange(10**6)}: error in step {self.rng.randrange(100)}. Next?",
            },
        ]


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.actions: Counter = Counter()
        self.statuses: Counter = Counter()
        self.latency: dict[str, list[float]] = {}
        self.problems: list[str] = []
        self.prompt = self.cached = self.completion = 0
        self.repeats = self.repeats_same = self.repeats_cached = 0

    def done(self, action: str, seconds: float) -> None:
        with self.lock:
            self.actions[action] += 1
            self.latency.setdefault(action, []).append(seconds)

    def status(self, code: int) -> None:
        with self.lock:
            self.statuses[code] += 1

    def problem(self, text: str) -> None:
        with self.lock:
            self.problems.append(text)

    def tokens(self, usage: dict) -> None:
        with self.lock:
            self.prompt += usage["prompt_tokens"]
            self.completion += usage["completion_tokens"]
            self.cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    def repeat(self, same: bool, cached: int) -> None:
        with self.lock:
            self.repeats += 1
            self.repeats_same += same
            self.repeats_cached += cached > 0


def scrape(url: str) -> dict[str, float]:
    """A Prometheus page as {series: value}."""
    import httpx

    out = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


def settle(front: str, sched: str, timeout: float = 60.0) -> tuple[dict, dict]:
    """Metrics once nothing is in flight anywhere (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        f, s = scrape(f"{front}/metrics"), scrape(f"{sched}/metrics")
        busy = f.get("dualpath_requests_in_flight", 0) + sum(
            v for k, v in s.items() if k.startswith("dualpath_engine_requests{")
        )
        if not busy or time.monotonic() > deadline:
            return f, s
        time.sleep(0.5)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=180)
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--storage-capacity", default="150MB")
    ap.add_argument("--decode", type=int, default=1, help="decode engines (each writes the store: they share its cap)")
    ap.add_argument("--model", default=None, help="checkpoint (default: the server's default model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import httpx
    from serve_process import ServeProcess

    from dualpath.core.paths import parse_size

    cap = parse_size(args.storage_capacity)
    extra = ["--model", args.model] if args.model else []
    # the operator's pauses are admin routes: on, and (with no admin key) answered on loopback only
    server = ServeProcess(
        *extra,
        "--kv-store",
        tempfile.mkdtemp(prefix="dualpath-soak-kv-"),
        "--storage-capacity",
        str(cap),
        "--decode",
        str(args.decode),
        "--host",
        "127.0.0.1",
        "--enable-admin-api",
    )
    stats = Stats()
    try:
        sched = re.search(r"scheduler metrics at (\S+)/metrics", server.log.read_text()).group(1)
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        until = time.monotonic() + args.seconds
        agents = [Agent(i, server.url, model, random.Random(args.seed * 1000 + i), stats) for i in range(args.agents)]
        threads = [threading.Thread(target=a.run, args=(until,), daemon=True) for a in agents]
        start = time.perf_counter()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(10)
            with stats.lock:
                print(
                    f"[{time.perf_counter() - start:5.0f} s] requests {sum(stats.actions.values())}, "
                    f"problems {len(stats.problems)}, statuses {dict(stats.statuses)}",
                    flush=True,
                )
        wall = time.perf_counter() - start
        front, sched_m = settle(server.url, sched)
        healthy = httpx.get(f"{server.url}/health").status_code == 200
    finally:
        server.stop()
    kv_use = {k: v for k, v in sched_m.items() if k.startswith("dualpath_engine_kv_cache_usage{")}
    used = max(v for k, v in sched_m.items() if k.startswith("dualpath_storage_used_bytes{"))
    written = sum(
        v for k, v in sched_m.items() if k.startswith("dualpath_engine_kv_bytes_total{") and 'path="storage_write"' in k
    )
    checks = {
        "no 5xx": not any(code >= 500 for code in stats.statuses),
        "no problems": not stats.problems,
        "healthy at the end": healthy,
        "nothing in flight": front.get("dualpath_requests_in_flight", 0) == 0,
        "engines hold nothing": not any(v for k, v in sched_m.items() if k.startswith("dualpath_engine_requests{")),
        "decode KV caches empty": all(v == 0 for k, v in kv_use.items() if 'role="decode"' in k),
        "store under its cap": used <= cap * 1.05,
        "the cap was reached (blocks evicted)": written > cap,
        "repeats answer the same": stats.repeats_same == stats.repeats,
    }
    rows = [
        {
            "action": a,
            "count": stats.actions[a],
            "p50_s": statistics.median(stats.latency[a]),
            "max_s": max(stats.latency[a]),
        }
        for a, _ in ACTIONS
        if stats.actions[a]
    ]
    print_table(rows, ["action", "count", "p50_s", "max_s"])
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    for p in stats.problems[:20]:
        print("  problem:", p)
    result = {
        "seconds": wall,
        "agents": args.agents,
        "decode_engines": args.decode,
        "model": model,
        "storage_capacity": cap,
        "storage_used_at_end": used,
        "statuses": {str(k): v for k, v in stats.statuses.items()},
        "prompt_tokens": stats.prompt,
        "cached_tokens": stats.cached,
        "completion_tokens": stats.completion,
        "repeats": stats.repeats,
        "repeats_same": stats.repeats_same,
        "repeats_cached": stats.repeats_cached,
        "storage_written": written,
        "rows": rows,
        "checks": checks,
        "problems": stats.problems[:50],
    }
    print("wrote", write_result("soak", result, args.out))
    return result


if __name__ == "__main__":
    main()
