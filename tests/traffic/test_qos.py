"""Priority classes on the wire (issue 48, item 3): one QoS config; the KV transport's TCP sockets marked with the KV
traffic class; an engine's ranks started with NCCL's classes; and, in the slow run, the benchmark's short form on
a shaped link between two network namespaces: the collectives under a KV flood do better with the classes than
without."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dualpath.cli import build_parser, engine_config, qos_config
from dualpath.core.config import EngineProcessConfig, QosConfig, TransportConfig
from dualpath.core.errors import ConfigError
from netns_hosts import netns_missing
from dualpath.traffic import qos

ROOT = Path(__file__).resolve().parents[2]
HAS_UCX = importlib.util.find_spec("ucxx") is not None


# --- the config ---------------------------------------------------------------------------------------------------
def test_one_config_gives_every_class():
    q = QosConfig()
    assert (q.kv_service_level, q.kv_dscp, q.collective_service_level, q.collective_dscp) == (2, 10, 0, 26)
    assert q.kv_traffic_class == 40 and q.collective_traffic_class == 104  # DSCP << 2: RoCE TC and IP TOS alike
    assert q.collective_env() == {"NCCL_IB_SL": "0", "NCCL_IB_TC": "104"}
    assert q.transport_fields() == {"kv_service_level": 2, "kv_traffic_class": 40}
    t = TransportConfig()  # a transport built without a QoS config still puts KV on the default low class
    assert (t.kv_service_level, t.kv_traffic_class) == (2, 40)
    off = QosConfig.off()
    assert off.kv_traffic_class == off.collective_traffic_class == 0 and off.collective_env()["NCCL_IB_SL"] == "0"


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"kv_dscp": 26}, "one DSCP (26)"),  # KV on the collectives' class: the fabric could not tell them apart
        ({"collective_service_level": 2}, "one service level (2)"),
        ({"kv_dscp": 64}, "kv_dscp must be a DSCP"),
        ({"collective_service_level": 16}, "collective_service_level must be an InfiniBand service level"),
    ],
)
def test_bad_classes_are_refused_with_the_numbers(fields, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        QosConfig(**fields)


def _engine_args(*extra: str):
    return build_parser().parse_args(
        ["engine", "--role", "prefill", "--scheduler", "127.0.0.1:1", "--model", "/nonexistent/model", *extra]
    )


def test_engine_flags_build_the_transport_and_the_qos_config_from_one_source():
    cfg = engine_config(
        _engine_args(
            "--transport",
            "ucx",
            "--kv-service-level",
            "5",
            "--kv-dscp",
            "8",
            "--collective-service-level",
            "1",
            "--collective-dscp",
            "34",
        )
    )
    assert cfg.qos == QosConfig(kv_service_level=5, kv_dscp=8, collective_service_level=1, collective_dscp=34)
    assert (cfg.transport.kv_service_level, cfg.transport.kv_traffic_class) == (5, 32)
    assert engine_config(_engine_args()).qos == QosConfig()  # the defaults
    # the former flag names the KV class as a byte
    assert qos_config(_engine_args("--kv-traffic-class", "40")).kv_dscp == 10
    for bad in (["--kv-traffic-class", "42"], ["--kv-traffic-class", "40", "--kv-dscp", "12"]):
        with pytest.raises(ConfigError):
            qos_config(_engine_args(*bad))
    with pytest.raises(ConfigError, match="not the QoS config's"):  # a transport at odds with the config
        EngineProcessConfig(role="prefill", model="m", scheduler="s", transport=TransportConfig(kv_traffic_class=0))


def test_a_cluster_passes_its_classes_to_every_engine(tmp_path, tiny_dirs):
    from dualpath.launcher import ClusterSpec, LocalCluster, qos_args
    from dualpath.serving.serve import cluster_spec

    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            str(tiny_dirs["llama"]),
            "--kv-dscp",
            "12",
            "--collective-dscp",
            "46",
            "--collective-service-level",
            "3",
        ]
    )
    spec, _, _ = cluster_spec(args)
    want = QosConfig(kv_dscp=12, collective_dscp=46, collective_service_level=3)
    assert spec.qos == want
    cluster = LocalCluster(ClusterSpec(model=str(tiny_dirs["llama"]), qos=want), run_dir=str(tmp_path))
    argv = cluster._engine_args("decode", 0, 0)
    assert engine_config(build_parser().parse_args(argv)).qos == want
    assert qos_args(QosConfig()) and "--kv-dscp" not in LocalCluster(
        ClusterSpec(model=str(tiny_dirs["llama"])), run_dir=str(tmp_path / "d")
    )._engine_args("decode", 0, 0)


def test_the_engine_process_hands_the_collective_classes_to_its_ranks(tmp_path):
    """``run_engine`` puts NCCL's classes in its environment before it builds the engine, whose ranks are processes
    it starts (``dualpath.engines.parallel.ranks.start_ranks``: ``subprocess.Popen`` without an environment of its own)."""
    script = textwrap.dedent("""
        import os, subprocess, sys
        import dualpath.engines.prefill
        from dualpath.cli import build_parser, engine_config
        from dualpath.processes import run_engine

        class Engine:  # stands in for the prefill engine: starts a "rank" the way start_ranks does
            def __init__(self, cfg):
                child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('NCCL_IB_SL'), "
                                        "os.environ.get('NCCL_IB_TC'))"], capture_output=True, text=True)
                print("rank sees", child.stdout.strip(), flush=True)
                raise SystemExit(0)

        dualpath.engines.prefill.PrefillEngine = Engine
        args = build_parser().parse_args(["engine", "--role", "prefill", "--scheduler", "127.0.0.1:1", "--model",
                                          "/nonexistent/model", "--collective-service-level", "5",
                                          "--collective-dscp", "34"])
        run_engine(engine_config(args))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_") and k != "DUALPATH_PARENT_PID"}
    env["NCCL_IB_SL"] = "7"  # a stale value in the environment: the config wins
    r = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stderr
    assert "rank sees 5 136" in r.stdout, r.stdout + r.stderr
    assert "NCCL_IB_SL=7 in the environment" in r.stderr


# --- the marks ----------------------------------------------------------------------------------------------------
def test_a_marked_listener_marks_every_connection_it_accepts_and_the_marker_finds_outgoing_ones():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    marker = qos.SocketMarker(40, [port])
    marker.mark(force=True)
    assert qos.socket_tos(listener) == 40
    out = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    assert qos.socket_tos(accepted) == 40  # from the SYN-ACK on: the kernel copies the listener's TOS
    assert qos.socket_tos(out) == 0  # the side that connects is the library's: found by the peer's port
    other = socket.create_server(("127.0.0.1", 0))
    unrelated = socket.create_connection(other.getsockname())
    marker.add_remote_ports([port])
    assert marker.mark() >= 1 and qos.socket_tos(out) == 40
    assert qos.socket_tos(unrelated) == 0 and qos.socket_tos(other) == 0  # nothing else of the process
    for s in (listener, out, accepted, other, unrelated):
        s.close()


@pytest.mark.skipif(not HAS_UCX, reason="ucxx not installed")
def test_the_ucx_transports_kv_sockets_carry_the_kv_traffic_class():
    from dualpath.traffic.transport import Op, Priority, Segment, make_transport
    from dualpath.traffic.transport.peer import PeerProcess

    config = TransportConfig(name="ucx", op_timeout_s=20, kv_traffic_class=QosConfig().kv_traffic_class)
    peer = PeerProcess(config, 4 << 20)
    me = make_transport(config, "me")
    try:
        mem = me.allocate(4 << 20)
        lid = me.register(mem).region_id
        me.add_peer("peer", peer.address, peer.regions)
        rid = peer.regions[0].region_id
        me.submit("peer", Op.WRITE, [Segment(lid, 0, rid, 0, 2 << 20)], Priority.LOW).wait(30)
        me.submit("peer", Op.READ, [Segment(lid, 0, rid, 0, 4096)], Priority.HIGH).wait(30)
        ours, theirs = set(me.address()["kv_ports"]), set(peer.address["kv_ports"])
        assert me.address()["ports"]["LOW"] in ours and peer.address["ports"]["LOW"] in theirs
        kv, other = [], []
        for s in qos.own_tcp_sockets():
            (kv if s.local_port in ours or (not s.listening and s.remote_port in theirs) else other).append(s)
        connected = [s for s in kv if not s.listening]
        # the connection to the peer's KV listener, and the data connection UCX made for the transfer
        assert len(connected) >= 2, kv
        assert {qos.fd_tos(s.fd) for s in kv} == {40}, [(s, qos.fd_tos(s.fd)) for s in kv]
        high = [s for s in other if not s.listening and s.remote_port == peer.address["ports"]["HIGH"]]
        assert high and {qos.fd_tos(s.fd) for s in high} == {0}  # the high-priority class stays unmarked
    finally:
        me.close()
        peer.stop()


# --- the benchmark's short form -----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(netns_missing() is not None, reason=str(netns_missing()))
@pytest.mark.skipif(not HAS_UCX, reason="ucxx not installed")
def test_with_priorities_the_collectives_beat_the_unprioritized_case(tmp_path):
    out = tmp_path / "qos.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "bench" / "qos.py"),
            "--quick",
            "--out",
            str(out),
            "--plot",
            str(tmp_path / "qos.png"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    text, _ = proc.communicate(timeout=900)
    print(text)
    assert proc.returncode == 0, text
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"dpqos{proc.pid % 100000}a" not in ns and f"dpqos{proc.pid % 100000}b" not in ns  # cleaned up
    r = json.loads(out.read_text())
    cases = r["cases"]
    with_p, without = cases["with_priorities"], cases["no_priorities"]
    for name in ("all_reduce", "all_to_all"):
        assert with_p[name]["p99_ms"] < without[name]["p99_ms"], (name, with_p[name], without[name])
    # the marks were on the wire as configured, and nowhere without priorities
    assert with_p["kv_sockets_tos"] == [40] and with_p["collective_sockets_tos"] == [104]
    assert without["kv_sockets_tos"] == [0] and without["collective_sockets_tos"] == [0]
    assert with_p["bands"]["a"]["low"]["bytes"] > 0 and without["bands"]["a"]["low"]["bytes"] == 0
    assert (tmp_path / "qos.png").exists() or (tmp_path / "qos.svg").exists()
    print(
        "with priorities, p99 vs alone:",
        {n: round(with_p[n]["p99_vs_alone"], 2) for n in ("all_reduce", "all_to_all")},
        "KV share of the leftover rate:",
        round(with_p["kv_share_of_leftover"], 2),
        "targets met:",
        r["met"],
    )


def test_a_tensor_parallel_engines_collective_sockets_carry_the_high_class(tiny_dirs, monkeypatch):
    """Ranks joining their group mark its TCP connections (gloo's) with the collectives' TOS byte, as the engine
    gives NCCL it (``NCCL_IB_TC``): rank 0's sockets to rank 1 read it back."""
    from dualpath import LLM
    from dualpath.traffic.qos import own_tcp_sockets, fd_tos

    monkeypatch.setenv("NCCL_IB_TC", "104")
    with LLM(str(tiny_dirs["llama"]), num_kv_blocks=16, block_size=16, tensor_parallel_size=2):
        marked = [s for s in own_tcp_sockets() if fd_tos(s.fd) == 104]
        assert len(marked) >= 2  # (the group's connections, and the rendezvous')
