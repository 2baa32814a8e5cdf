"""Watching a server: one Prometheus ``/metrics`` on the API port holds the frontend's series and the scheduler's,
engines', KV cache's and transport's (pulled from the scheduler at each scrape), every series is documented in
docs/metrics.md, each request gets an access-log line (off with ``--disable-log-requests``), a stats line is logged
while busy and never while idle, and start-up reports each engine as it loads and becomes ready."""

import asyncio
import logging
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from dualpath.core.errors import DualPathError
from dualpath.launcher import Child, Supervisor
from dualpath.core.messages import TokenEvent
from dualpath.serving.openai_api import Frontend, FrontendConfig
from dualpath.serving.watch import Counts, StatsLine, log_stats, stats_line
from dualpath.scheduler.http import render

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
STATS = {  # a scheduler's stats with one of everything its series are made from
    "submitted": 4,
    "finished": 3,
    "path_pe": 2,
    "path_de": 1,
    "hit_tokens": 32,
    "blocks_evicted": 2,
    "global_queue": 1,
    "in_flight": 3,
    "waiting_by_priority": {"0": 1},
    "engines_alive": 2,
    "index_blocks": 5,
    "node_read_q_tokens": {"n0": 64},
    "node_alpha_tokens": {"n0": 300},
    "node_alpha_measured": {"n0": True},
    "storage_read_bytes": {"n0": 4096},
    "traffic_bytes": {"prefill-0": {"storage_read:kv": 4096}},
    "speculative": {"decode-0": {"drafted": 8, "accepted": 5}},
    "prefill_busy_max_over_avg": {"pg": 1.1},
    "engines": {
        "prefill-0": {
            "role": "prefill",
            "node": "n0",
            "group": "pg",
            "capacity_tokens": 1024,
            "free_tokens": 1024,
            "requests": 0,
            "measured_beta": 5000,
            "dp_balance": 1.05,
        },
        "decode-0": {
            "role": "decode",
            "node": "n0",
            "capacity_tokens": 1000,
            "free_tokens": 750,
            "requests": 2,
            "storage_used_bytes": 8192,
            "storage_capacity_bytes": 1 << 20,
        },
    },
}


class Handle:
    request_id = "fake"

    def __init__(self, tokens):
        self.tokens = tokens

    def events(self):
        for i, t in enumerate(self.tokens):
            last = i == len(self.tokens) - 1
            yield TokenEvent(
                "fake",
                t,
                finish_reason="length" if last else "",
                num_cached_tokens=16 if last else 0,
                path="pe" if last else "",
                storage_bytes=1024 if last else 0,
            )

    def cancel(self):
        pass


class FakeCluster:
    """In place of ``ClusterClient``: every request gets three tokens, its prompt's 16 first tokens loaded on the PE
    path; ``stats`` is what the scheduler would answer (None: it does not)."""

    def __init__(self):
        self.stats_reply: dict | None = dict(STATS)

    def start(self, prompt, sampling, request_id=None, mode="", label="", agent=None):
        return Handle([5, 6, 7])

    def stats(self):
        if self.stats_reply is None:
            raise DualPathError("the scheduler is unreachable")
        return self.stats_reply

    def block_size(self):
        return 16


def frontend(tiny_dirs, **config):
    config = {"log_requests": True, **config}  # (as serve and frontend run it)
    front = Frontend(
        FrontendConfig("m", str(tiny_dirs["llama"]), "unused:0", max_model_len=512, **config), client=FakeCluster()
    )
    return front, TestClient(front.app)


def complete(http):
    r = http.post("/v1/completions", json={"model": "m", "prompt": "hello there " * 10, "max_tokens": 3})
    assert r.status_code == 200, r.text
    return r.json()


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, name: str, **labels) -> float:
    family = fams[name.removesuffix("_total")] if name.removesuffix("_total") in fams else fams[name]
    return next(s.value for s in family.samples if s.name == name and labels.items() <= s.labels.items())


# --- /metrics -------------------------------------------------------------------------------------------------
def test_the_api_metrics_hold_the_frontend_scheduler_engine_kv_and_transport_series(tiny_dirs):
    _, http = frontend(tiny_dirs)
    complete(http)
    r = http.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    fams = families(r.text)  # the exposition parses
    assert value(fams, "dualpath_completion_tokens_total") == 3  # the frontend's
    assert value(fams, "dualpath_cached_tokens_total", path="pe") == 16
    assert value(fams, "dualpath_scheduler_up") == 1
    assert value(fams, "dualpath_scheduler_submitted_total") == 4  # the scheduler's
    assert value(fams, "dualpath_scheduler_read_path_total", path="de") == 1
    assert value(fams, "dualpath_engine_kv_cache_usage", engine="decode-0", role="decode") == 0.25  # engines'
    assert value(fams, "dualpath_engine_kv_cache_tokens", engine="prefill-0") == 1024
    assert value(fams, "dualpath_storage_used_bytes", node="n0") == 8192  # the KV store's
    assert value(fams, "dualpath_scheduler_blocks_evicted_total") == 2
    assert (
        value(fams, "dualpath_engine_kv_bytes_total", engine="prefill-0", path="storage_read", **{"class": "kv"})
        == 4096
    )  # the transport's


def test_without_the_scheduler_the_api_metrics_still_answer_with_scheduler_up_0(tiny_dirs):
    front, http = frontend(tiny_dirs)
    front.client.stats_reply = None
    fams = families(http.get("/metrics").text)
    assert value(fams, "dualpath_scheduler_up") == 0
    assert "dualpath_scheduler_submitted" not in fams and "dualpath_requests_in_flight" in fams


def test_the_scheduler_exposition_parses_and_every_series_is_documented(tiny_dirs):
    _, http = frontend(tiny_dirs)
    complete(http)
    http.get("/health")
    names = set(families(render(STATS))) | set(families(http.get("/metrics").text))
    documented = DOCS.read_text()
    missing = sorted(
        n
        for n in names
        if not n.endswith("_created") and f"`{n}_total`" not in documented and f"`{n}`" not in documented
    )
    assert not missing, f"series not in docs/metrics.md: {missing}"
    assert len(names) > 40


# --- the access log -------------------------------------------------------------------------------------------
def test_each_request_gets_an_access_line_with_its_tokens_path_and_times(tiny_dirs, caplog):
    front, http = frontend(tiny_dirs)
    with caplog.at_level(logging.INFO, logger="dualpath.access"):
        complete(http)
        http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    lines = [r.getMessage() for r in caplog.records if r.name == "dualpath.access"]
    assert len(lines) == 2, lines
    ok, bad = lines
    assert ok.startswith('"POST /v1/completions" 200 latency=') and "ttft=" in ok and "request_id=" in ok
    n_prompt = len(front.tokenizer.encode("hello there " * 10))
    assert f"prompt_tokens={n_prompt} generated_tokens=3 cached_tokens=16 read_path=pe" in ok
    assert bad.startswith('"POST /v1/completions" 404 latency=') and "prompt_tokens" not in bad


def test_probes_are_logged_at_debug_and_disable_log_requests_turns_the_log_off(tiny_dirs, caplog):
    _, http = frontend(tiny_dirs)
    with caplog.at_level(logging.INFO, logger="dualpath.access"):
        http.get("/metrics")  # a scrape every few seconds: DEBUG
    assert not [r for r in caplog.records if r.name == "dualpath.access"]
    caplog.clear()
    _, http = frontend(tiny_dirs, log_requests=False)
    with caplog.at_level(logging.DEBUG, logger="dualpath.access"):
        complete(http)
        http.get("/metrics")
    assert not [r for r in caplog.records if r.name == "dualpath.access"]


def test_the_serve_and_frontend_commands_take_disable_log_requests():
    from dualpath.cli import build_parser
    from dualpath.serving.serve import http_options

    for command in (["serve"], ["frontend", "--scheduler", "127.0.0.1:1"]):
        args = build_parser().parse_args([*command, "--disable-log-requests", "--disable-log-stats"])
        options = http_options(args)
        assert not options["log_requests"] and not options["log_stats"]
        assert http_options(build_parser().parse_args(command))["log_requests"]


# --- the stats line -------------------------------------------------------------------------------------------
class Clock:
    t = 100.0

    def __call__(self):
        return self.t


def test_the_stats_line_reports_a_busy_interval_and_nothing_while_idle():
    clock, counts = Clock(), [Counts()]
    line = StatsLine(lambda: counts[0], lambda: STATS, clock)
    clock.t += 10
    assert line.tick() is None  # idle: no tokens, nothing in flight
    counts[0] = Counts(prompt=400, generated=100, cached=(("de", 100.0), ("none", 0.0), ("pe", 200.0)), in_flight=2)
    clock.t += 10
    text = line.tick()
    assert text == (
        "Avg prompt throughput: 40.0 tokens/s, Avg generation throughput: 10.0 tokens/s, "
        "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, "
        "Prefix cache hit rate: 75.0% (de 25.0%, pe 50.0%)"
    )
    counts[0] = Counts(prompt=400, generated=150, cached=counts[0].cached, in_flight=1)
    clock.t += 10
    assert line.tick().startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 5.0 tokens/s")
    counts[0] = Counts(prompt=400, generated=150, cached=counts[0].cached)
    clock.t += 10
    assert line.tick() is None  # idle again


def test_the_frontends_stats_line_counts_its_requests_and_is_logged_while_busy(tiny_dirs, caplog):
    front, http = frontend(tiny_dirs)
    clock = Clock()
    line = stats_line(front, clock)
    complete(http)
    clock.t += 2
    text = line.tick()
    assert "Avg generation throughput: 1.5 tokens/s" in text and "Prefix cache hit rate" in text and "pe " in text
    clock.t += 2
    assert line.tick() is None

    def logged():
        return [r.getMessage() for r in caplog.records if r.name == "dualpath.stats"]

    async def a_while():  # the loop logs the busy interval, then nothing over the idle ones after it
        task = asyncio.create_task(log_stats(stats_line(front), interval_s=0.05))
        await asyncio.sleep(0.01)
        complete(http)
        for _ in range(200):
            if logged():
                break
            await asyncio.sleep(0.025)
        await asyncio.sleep(0.3)
        task.cancel()

    with caplog.at_level(logging.INFO, logger="dualpath.stats"):
        asyncio.run(a_while())
    lines = logged()
    assert len(lines) == 1 and lines[0].startswith("Avg prompt throughput:"), lines


# --- start-up -------------------------------------------------------------------------------------------------
def test_start_up_reports_each_engine_as_it_starts_and_is_ready(tmp_path):
    """What ``wait_ready`` reports, with stand-in children: the still-starting line (with each one's last log line)
    every ``progress_s``, then each engine's model, device and KV cache size from its ready file as it is ready."""
    lines = []
    sup = Supervisor(str(tmp_path), 1, "INFO", report=lines.append)
    children = []
    for name in ("prefill-0", "decode-0"):
        log_path = tmp_path / f"{name}.log"
        log_path.write_text("INFO dualpath.engines.models: llama: 1.0 MiB of weights on cpu in 0.5 s\n")
        cmd = [
            sys.executable,
            "-m",
            "dualpath.cli",
            "engine",
            "--role",
            name[:-2],
            "--model",
            "/m/llama",
            "--device",
            "cpu",
            "--ready-file",
            str(tmp_path / f"{name}.ready"),
        ]
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        children.append(Child(name, proc, log_path, tmp_path / f"{name}.ready", cmd))
    try:
        threading.Timer(0.3, lambda: (tmp_path / "decode-0.ready").write_text("decode-0 127.0.0.1:5 4096\n")).start()
        threading.Timer(0.6, lambda: (tmp_path / "prefill-0.ready").write_text("prefill-0 127.0.0.1:6 2048\n")).start()
        sup.wait_ready(children, timeout=10, progress_s=0.15)
    finally:
        for c in children:
            c.proc.kill()
            c.proc.wait()
    ready = [ln for ln in lines if " ready after " in ln]
    assert [ln.split()[0] for ln in ready] == ["decode-0", "prefill-0"]
    assert ready[0].startswith("decode-0 (llama on cpu) ready after ") and "KV cache 4,096 tokens" in ready[0]
    still = [ln for ln in lines if ln.startswith("still starting after")]
    assert still and "prefill-0 (INFO dualpath.engines.models: llama: 1.0 MiB of weights" in still[0]


def test_a_child_that_exits_while_starting_is_an_error_naming_it(tmp_path):
    sup = Supervisor(str(tmp_path), 1, "INFO", report=lambda line: None)
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    (tmp_path / "x.log").write_text("it broke\n")
    with pytest.raises(DualPathError, match="x exited with 3 while starting"):
        sup.wait_ready([Child("x", proc, tmp_path / "x.log", tmp_path / "x.ready", ["scheduler"])], timeout=10)
