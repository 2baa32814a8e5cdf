"""``dualpath status``: with no ``--scheduler`` it finds this host's ``dualpath serve`` by the record the run keeps
(``dualpath.runs``: its scheduler and cluster-token file), drops records of runs that are gone, prints the stats as
a table (``--json``: the stats), and says what to give where nothing runs. A real scheduler process answers (no
engines: fast); the slow test runs ``dualpath serve`` itself."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dualpath.runs import LocalRun, announce, local_runs, this_run, withdraw
from dualpath.status import render

ROOT = Path(__file__).resolve().parents[2]
STATS = {
    "engines_alive_by_role": {"prefill": 1, "decode": 1},
    "in_flight": 2,
    "submitted": 7,
    "finished": 5,
    "global_queue": 1,
    "prefill_queue": 0,
    "decode_queue": 0,
    "waiting_by_priority": {"0": 1},
    "index_blocks": 12,
    "block_size": 64,
    "prompt_tokens": 1000,
    "hit_tokens": 640,
    "path_pe": 3,
    "path_de": 2,
    "scheduling_policy": "fcfs",
    "weights_version": "step-7",
    "missing": [],
    "storage_read_bytes": {"n0": 2_500_000},
    "node_read_q_tokens": {"n0": 128},
    "engines": {
        "prefill-0": {
            "role": "prefill",
            "node": "n0",
            "group": "",
            "requests": 1,
            "tokens": 300,
            "capacity_tokens": 2048,
            "free_tokens": 1748,
            "storage_used_bytes": 0,
        },
        "decode-0": {
            "role": "decode",
            "node": "n0",
            "group": "",
            "requests": 1,
            "tokens": 1024,
            "capacity_tokens": 4096,
            "free_tokens": 3072,
            "storage_used_bytes": 1_500_000,
            "storage_capacity_bytes": 10**9,
        },
    },
}


def status(env, *args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "dualpath.cli", "status", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def plain_env(cache):
    """This process's environment without a cluster token, its records under ``cache``."""
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("DUALPATH_CLUSTER_TOKEN")},
        "DUALPATH_CACHE_DIR": str(cache),
    }


def test_the_table_shows_engines_load_kv_use_queues_and_weights():
    text = render(STATS, LocalRun("127.0.0.1:5", "/tmp/run", api="http://127.0.0.1:8000/v1", model="m", pid=42))
    lines = text.splitlines()
    assert "scheduler 127.0.0.1:5" in lines[0] and "pid 42" in lines[0] and "http://127.0.0.1:8000/v1" in lines[0]
    assert "weights step-7" in text and "engines alive: 1 prefill, 1 decode" in text
    assert "2 in flight" in text and "global 1" in text and "priority 0: 1" in text and "640 of 1,000" in text
    head = next(i for i, line in enumerate(lines) if line.startswith("ENGINE"))
    assert lines[head].split() == [
        "ENGINE",
        "ROLE",
        "NODE",
        "GROUP",
        "REQUESTS",
        "TOKENS",
        "KV",
        "USED",
        "KV",
        "STORE",
        "ALIVE",
    ]
    decode = lines[head + 1].split()  # engines by name: decode-0 first
    assert decode[:6] == ["decode-0", "decode", "n0", "-", "1", "1024"] and "25.0%" in decode and "yes" in decode
    assert "1.5 MB / 1.0 GB" in lines[head + 1] and "14.6% of 2,048" in lines[head + 2]
    assert any(line.split() == ["n0", "2.5", "MB", "128"] for line in lines)
    assert "NOT SERVING: no decode engine" in render({**STATS, "missing": ["no decode engine"]}, LocalRun("x:1", ""))


def test_records_of_runs_that_are_gone_are_dropped_and_the_newest_comes_first(tmp_path, monkeypatch):
    monkeypatch.setenv("DUALPATH_CACHE_DIR", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()
    announce(LocalRun("127.0.0.1:1", "/a", pid=gone.pid, started=1.0))
    older = announce(LocalRun("127.0.0.1:2", "/b", pid=os.getppid(), started=2.0))
    mine = announce(this_run("127.0.0.1:3", tmp_path, tmp_path / "no-token", "http://x/v1", "m"))
    assert [r.scheduler for r in local_runs()] == ["127.0.0.1:3", "127.0.0.1:2"]
    assert not (tmp_path / "runs" / f"{gone.pid}.json").exists()  # removed once found stale
    assert local_runs()[0].token_file == ""  # (no token file: none named)
    withdraw(mine)
    withdraw(older)
    assert local_runs() == []


def test_nothing_running_says_what_to_give(tmp_path):
    from dualpath.status import STANDALONE, _listening

    if _listening(STANDALONE):  # (a `dualpath scheduler` on its default port would be shown instead)
        pytest.skip(f"a scheduler listens at {STANDALONE}")
    r = status(plain_env(tmp_path))
    assert r.returncode == 1 and "--scheduler HOST:PORT" in r.stdout and str(tmp_path / "runs") in r.stdout, r
    r = status(plain_env(tmp_path), "--json")
    assert r.returncode == 1 and "--scheduler" in json.loads(r.stdout)["error"]


@pytest.fixture
def scheduler(tmp_path):
    """A `dualpath scheduler` closed by a cluster token (no engines), and its token file (mode 0600)."""
    token = tmp_path / "cluster-token"
    token.write_text("s3cret-token")
    token.chmod(0o600)
    ready = tmp_path / "scheduler.ready"
    env = {**plain_env(tmp_path / "cache"), "DUALPATH_CLUSTER_TOKEN": "s3cret-token"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dualpath.cli",
            "--log-level",
            "WARNING",
            "scheduler",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--ready-file",
            str(ready),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the scheduler did not start"
        time.sleep(0.05)
    yield f"127.0.0.1:{ready.read_text().split()[0]}", token
    proc.terminate()
    proc.wait(30)


def test_status_finds_this_hosts_serve_and_calls_with_its_token(scheduler, tmp_path):
    address, token = scheduler
    env = plain_env(tmp_path / "cache")
    refused = status(env, "--scheduler", address)  # named, without the token: refused, saying what to set
    assert refused.returncode == 1 and refused.stdout.startswith("refused:"), refused
    os.environ["DUALPATH_CACHE_DIR"] = str(tmp_path / "cache")
    try:
        record = announce(
            LocalRun(address, str(tmp_path), str(token), "http://127.0.0.1:9/v1", "tiny", os.getpid(), time.time())
        )
    finally:
        del os.environ["DUALPATH_CACHE_DIR"]
    r = status(env)
    assert r.returncode == 0, r
    assert r.stdout.startswith(f"scheduler {address} | dualpath serve pid {os.getpid()}"), r.stdout
    assert "ENGINE" in r.stdout and "engines alive: 0 prefill, 0 decode" in r.stdout
    data = json.loads(status(env, "--json").stdout)
    assert data["engines"] == {} and data["in_flight"] == 0
    waited = status(env, "--wait-decode", "1", "--timeout", "1")  # the option works as before: no engine comes
    assert waited.returncode == 1 and waited.stdout.startswith("timed out:")
    assert status(env, "--run-dir", str(tmp_path)).returncode == 0  # the run directory's ready file and token
    withdraw(record)


@pytest.mark.slow
def test_status_of_a_running_serve_with_no_options(tiny_dirs, tmp_path):
    from serve_process import ServeProcess

    cache = tmp_path / "cache"
    os.environ["DUALPATH_CACHE_DIR"] = str(cache)  # (the serve process inherits it)
    try:
        server = ServeProcess(
            "--model",
            str(tiny_dirs["llama"]),
            "--block-size",
            "16",
            "--buffer-bytes",
            str(8 << 20),
            "--cache-bytes",
            str(32 << 20),
            "--workspace-tokens",
            "2048",
            "--kv-store",
            str(tmp_path / "kv"),
            "--max-model-len",
            "512",
            "--torch-threads",
            "1",
        )
    finally:
        del os.environ["DUALPATH_CACHE_DIR"]
    try:
        r = status(plain_env(cache))
        assert r.returncode == 0, r
        assert f"API {server.url}/v1" in r.stdout and "prefill-0" in r.stdout and "decode-0" in r.stdout
        data = json.loads(status(plain_env(cache), "--json", "--wait-prefill", "1", "--wait-decode", "1").stdout)
        assert sorted(data["engines"]) == ["decode-0", "prefill-0"]
    finally:
        assert server.stop() == 0, server.log_tail()
    assert not list((cache / "runs").glob("*.json"))  # withdrawn when it stopped
