"""The serving bench's pure parts (``serve_bench.py``): its workloads, how the server and ``dualpath bench agentic``
are started (their options), the open-loop load generator over the OpenAI API, and the summaries with their
targets. No torch, no bench imports: ``tests/docs/test_gpu_e2e.py`` loads this file by itself."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass

AGENTIC_TARGETS = {"jct_vs_basic": 0.55, "jct_vs_oracle": 1.10}
SERVING_TARGET = 0.9  # the server's output tokens/s over the offline LLM's, saturated


@dataclass(frozen=True)
class Workload:
    """Requests of random prompt and output lengths (uniform in the ranges, inclusive), token ids from ``vocab``."""

    requests: int
    prompt_lens: tuple[int, int]
    output_lens: tuple[int, int]
    seed: int = 0
    vocab: int = 32000

    def draw(self) -> list[tuple[list[int], int]]:
        """``(prompt ids, output length)`` of every request, the same for a seed."""
        rng = random.Random(self.seed)
        return [
            (
                [rng.randrange(3, self.vocab) for _ in range(rng.randint(*self.prompt_lens))],
                rng.randint(*self.output_lens),
            )
            for _ in range(self.requests)
        ]


@dataclass(frozen=True)
class ServeSetup:
    """How the server runs on the device: every engine on ``device``, the decode engine's part of it."""

    device: str = "cuda:0"
    dtype: str = "bfloat16"
    decode_share: float = 0.5  # --gpu-memory-utilization: the prefill engine takes its weights from the rest
    max_num_seqs: int = 64  # the decode engine's batch (``dualpath engine``'s default), the offline LLM's too

    def serve_args(self, model: str, kv_store: str) -> list[str]:
        args = [model, "--device", self.device, "--dtype", self.dtype, "--kv-store", kv_store]
        args += ["--host", "127.0.0.1", "--disable-log-requests", "--prefill", "1", "--decode", "1"]
        if self.device.startswith("cuda"):
            args += ["--gpu-memory-utilization", str(self.decode_share)]
        return args


FULL = Workload(requests=256, prompt_lens=(128, 1024), output_lens=(64, 256))
TINY = Workload(requests=8, prompt_lens=(8, 40), output_lens=(4, 12))


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile of ``values`` by nearest rank (the smallest value with at least ``q``% of them at or
    below it); None when there are none."""
    if not values:
        return None
    return sorted(values)[max(1, math.ceil(q / 100 * len(values))) - 1]


@dataclass
class Reply:
    """One streamed request as the client saw it (seconds from its send)."""

    sent: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    error: str = ""

    def feed(self, line: str, now: float) -> None:
        """One line of the event stream: a chunk's token ids move the first and last token times."""
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        chunk = json.loads(line[6:])
        n = sum(len(c.get("token_ids") or ()) for c in chunk.get("choices", ()))
        if n:
            self.first = self.first if self.first is not None else now - self.sent
            self.last, self.tokens = now - self.sent, self.tokens + n

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first."""
        return (self.last - self.first) / (self.tokens - 1) if self.tokens > 1 else None


def load_summary(replies: list[Reply], wall: float, rate: float) -> dict:
    """Throughput, TTFT and TPOT of one load run (failed requests counted apart)."""
    ok = [r for r in replies if not r.error and r.tokens]
    ttft, tpot = [r.first for r in ok], [r.tpot for r in ok if r.tpot is not None]
    tokens = sum(r.tokens for r in ok)
    return {
        "rate_per_s": rate,
        "requests": len(replies),
        "failed": len(replies) - len(ok),
        "errors": sorted({r.error for r in replies if r.error})[:5],
        "seconds": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "tpot_mean_s": statistics.fmean(tpot) if tpot else None,
    }


async def _one(client, url: str, model: str, prompt: list[int], n: int, start: float, at: float) -> Reply:
    await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
    reply = Reply(time.perf_counter())
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    body.update(stream=True, return_token_ids=True)
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                reply.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return reply
            async for line in r.aiter_lines():
                reply.feed(line, time.perf_counter())
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        reply.error = f"{type(e).__name__}: {e}"
    return reply


async def open_loop(url: str, model: str, work: list[tuple[list[int], int]], rate: float) -> dict:
    """Send ``work`` at a fixed ``rate`` (requests/s: request i at i / rate, whatever came back), streamed."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()
        replies = await asyncio.gather(
            *(_one(client, url, model, p, n, start, i / rate) for i, (p, n) in enumerate(work))
        )
        wall = time.perf_counter() - start
    return load_summary(list(replies), wall, rate)


@dataclass(frozen=True)
class AgenticRun:
    """``dualpath bench agentic``'s options here: on the one device, 1P2D, Basic, DualPath and Oracle."""

    device: str = "cuda:0"
    dtype: str = "bfloat16"
    agents: int = 32
    scale: float = 0.05
    turns_scale: float = 0.1
    prefill: int = 1
    decode: int = 2
    cache_bytes: str = "8G"
    block_size: int = 64
    systems: str = "basic,dualpath,oracle"

    def args(self, model: str, out: str) -> list[str]:
        pairs = {k.replace("_", "-"): v for k, v in asdict(self).items()}
        return ["bench", "agentic", "--model", model, "--out", out] + [
            a for k, v in pairs.items() for a in (f"--{k}", str(v))
        ]


AGENTIC_SMOKE = AgenticRun(
    device="cpu", dtype="float32", agents=3, scale=0.03, turns_scale=0.05, decode=1, cache_bytes="64M", block_size=16
)


def agentic_ratios(result: dict) -> dict:
    """DualPath's JCT over Basic's and Oracle's, each system's JCT, TTFT, TPOT and hit rate, against the targets."""
    keys = ("job_completion_time_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "hit_rate", "storage_read_max_over_avg")
    rows = {r["system"]: {k: r.get(k) for k in keys} for r in result["systems"]}
    dp = next((r for r in result["systems"] if r["system"] == "dualpath"), {})
    ratios = {k: dp.get(k) for k in AGENTIC_TARGETS}
    met = {k: v is not None and v <= AGENTIC_TARGETS[k] for k, v in ratios.items()}
    return {"cap_bps": result["cap_bps"], "systems": rows, **ratios, "targets": AGENTIC_TARGETS, "met": met}
