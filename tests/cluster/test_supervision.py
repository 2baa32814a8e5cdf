"""The single-host supervisor (``dualpath serve``'s): a dead or hung engine or scheduler comes back by itself, the
requests it held are served elsewhere or after it returns, equal to the one-process reference; every port comes from
the range given; a new run rotates the last run's logs."""

import signal
import threading
import time

import pytest

from dualpath import LLM, SamplingParams
from dualpath.client import ClusterClient
from dualpath.core.errors import ConfigError
from dualpath.launcher import ClusterSpec, LocalCluster, RestartPolicy, parse_port_range, rotate_log
from cluster_calls import generate_during

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8)
FAST = RestartPolicy(max_restarts=3, backoff_s=0.2, health_interval_s=0.5, health_timeout_s=1.0, health_failures=3)


def spec(model, kv, **kw):
    base = dict(
        model=str(model),
        num_prefill=1,
        num_decode=1,
        block_size=BS,
        kv_store=str(kv),
        buffer_bytes=8 << 20,
        cache_bytes=16 << 20,
        workspace_tokens=2048,
        cost_model="0.001,0.0001,0",
        heartbeat_timeout_s=3.0,
        restart=FAST,
    )
    return ClusterSpec(**{**base, **kw})


def prompt(seed: int, n: int = 70) -> list[int]:
    return [(seed * 31 + i * 7) % 250 + 3 for i in range(n)]


def wait_for(cond, what: str = "", timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what or "timed out"
        time.sleep(0.05)


def test_rotate_log_keeps_the_last_runs(tmp_path):
    log = tmp_path / "prefill-0.log"
    for run in range(5):
        rotate_log(log, keep=3)
        log.write_text(f"run {run}")
    assert log.read_text() == "run 4"
    assert [(tmp_path / f"prefill-0.log.{i}").read_text() for i in (1, 2, 3)] == ["run 3", "run 2", "run 1"]
    assert not (tmp_path / "prefill-0.log.4").exists()


def test_engines_take_their_ports_from_the_range_and_too_small_a_range_is_refused():
    assert parse_port_range("20000-20008") == (20000, 20008)
    for bad in ("20000", "9-2", "0-5", "a-b"):
        with pytest.raises(ConfigError):
            parse_port_range(bad)
    c = LocalCluster(ClusterSpec(model="m", num_prefill=2, num_decode=1, engine_ports=(20000, 20008)))
    ports = []
    for role, i in (("prefill", 0), ("prefill", 1), ("decode", 0)):
        args = c._engine_args(role, i, i)
        ports.append((int(args[args.index("--port") + 1]), int(args[args.index("--transport-port") + 1])))
    assert ports == [(20000, 20001), (20003, 20004), (20006, 20007)]
    with pytest.raises(ConfigError, match="room for 3 engines"):
        c._engine_args("decode", 1, 3)


def test_restart_backoff_doubles_to_its_cap():
    p = RestartPolicy(max_restarts=9, backoff_s=1.0, max_backoff_s=30.0)
    assert [p.delay(n) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]


@pytest.mark.slow  # (the default run stays under 10 minutes)
def test_a_killed_prefill_engine_comes_back_and_serves_what_it_held(tiny_dirs, tmp_path):
    """Requests in flight when the only prefill engine is killed are served once the supervisor brought it back,
    equal to the one-process reference."""
    reference = LLM(str(tiny_dirs["llama"]), block_size=BS)
    with LocalCluster(
        spec(tiny_dirs["llama"], tmp_path / "kv", engine_wait_timeout_s=60.0), run_dir=str(tmp_path / "run")
    ) as c:
        client = ClusterClient(c.scheduler_address, timeout=120, reconnect_s=60)
        results = generate_during(client, [prompt(i) for i in range(4)], GREEDY, lambda: c.kill("prefill-0"))
        for i, got in enumerate(results):
            assert got.token_ids == reference.generate(prompt(i), GREEDY)[0].token_ids
        wait_for(lambda: len(c.child("prefill-0").restarts) == 1 and c.child("prefill-0").ready_path.exists())
        assert "restarted by the supervisor (exited with -9)" in (tmp_path / "run" / "prefill-0.log").read_text()
        client.close()


@pytest.mark.slow  # ~20 s: a scheduler restart, then three missed health checks and an engine restart
def test_a_killed_scheduler_and_a_hung_decode_engine_come_back(tiny_dirs, tmp_path):
    """A request sent while the scheduler is down is served by the scheduler the supervisor restarted on its port;
    a decode engine that stops answering (SIGSTOP) is killed after its failed health checks and restarted. Every
    reply equals the one-process reference."""
    reference = LLM(str(tiny_dirs["llama"]), block_size=BS)
    with LocalCluster(
        spec(tiny_dirs["llama"], tmp_path / "kv", engine_wait_timeout_s=60.0), run_dir=str(tmp_path / "run")
    ) as c:
        client = ClusterClient(c.scheduler_address, timeout=120, reconnect_s=60)
        assert client.generate(prompt(9), GREEDY).token_ids  # (the client learns the model from a live scheduler)
        c.kill("scheduler")
        got = client.generate(prompt(10), GREEDY)  # sent while it is down: submitted again once it is back
        assert got.token_ids == reference.generate(prompt(10), GREEDY)[0].token_ids
        assert len(c.child("scheduler").restarts) == 1

        decode = c.child("decode-0")
        decode.proc.send_signal(signal.SIGSTOP)
        wait_for(lambda: decode.restarts, "the hung decode engine was not restarted")
        got = client.generate(prompt(11), GREEDY)
        assert got.token_ids == reference.generate(prompt(11), GREEDY)[0].token_ids
        assert "did not answer 3 health checks in a row" in (tmp_path / "run" / "decode-0.log").read_text()
        client.close()


@pytest.mark.slow  # (the default run stays under 10 minutes)
def test_past_the_restart_cap_a_waiting_request_fails_as_unavailable_within_the_bound(tiny_dirs, tmp_path):
    with LocalCluster(
        spec(
            tiny_dirs["llama"],
            tmp_path / "kv",
            restart=RestartPolicy(),
            engine_wait_timeout_s=2.0,
            heartbeat_timeout_s=1.0,
        ),
        run_dir=str(tmp_path / "run"),
    ) as c:
        client = ClusterClient(c.scheduler_address, timeout=60)
        assert client.generate(prompt(1), GREEDY).token_ids
        c.kill("prefill-0")
        start = time.monotonic()
        with pytest.raises(Exception, match="no prefill engine") as e:
            client.generate(prompt(2), GREEDY)
        took = time.monotonic() - start
        assert took < 15, took
        assert "unavailable" in str(e.value) or "prefill-0 is gone" in str(e.value), e.value
        assert client.stats()["missing"][0].startswith("no prefill engine alive for")
        client.close()


@pytest.mark.slow  # ~12 s: a scheduler, a prefill engine and a node's decode engine
def test_a_node_whose_engine_stops_answering_exits_and_its_alive_file_goes_stale(tiny_dirs, tmp_path):
    """``dualpath node`` (a Kubernetes pod's or Slurm step's engines): while its engines run and answer, the alive file
    stays fresh (the liveness probe reads its age); one engine wedged (SIGSTOP) fails its health checks, the node
    stops them all and exits 1, so the pod's container restarts."""
    from dualpath.launcher import NodeEngines, NodeSpec

    with LocalCluster(
        spec(tiny_dirs["llama"], tmp_path / "kv", num_decode=0, restart=RestartPolicy()), run_dir=str(tmp_path / "run")
    ) as c:
        engine_args = (
            "--model",
            str(tiny_dirs["llama"]),
            "--block-size",
            str(BS),
            "--kv-store",
            str(tmp_path / "kv"),
            "--buffer-bytes",
            str(8 << 20),
            "--cache-bytes",
            str(16 << 20),
        )
        node = NodeEngines(
            NodeSpec("decode", c.scheduler_address, engines=1, torch_threads=1, engine_args=engine_args),
            run_dir=str(tmp_path / "node"),
        )
        node.restart = RestartPolicy(health_interval_s=0.5, health_timeout_s=0.5, health_failures=2)
        alive = tmp_path / "alive"
        node.start(120)
        try:
            code: list = []
            waiter = threading.Thread(target=lambda: code.append(node.wait(str(alive))), daemon=True)
            waiter.start()
            wait_for(alive.exists, "the alive file was never written")
            first = alive.stat().st_mtime
            wait_for(lambda: alive.stat().st_mtime > first, "the alive file is not kept fresh")
            node.children[0].proc.send_signal(signal.SIGSTOP)
            waiter.join(30)
            assert code == [1] and all(ch.proc.poll() is not None for ch in node.children)
            stale = alive.stat().st_mtime
            time.sleep(1.2)
            assert alive.stat().st_mtime == stale
        finally:
            node.stop()
