"""The internal plane is closed (issue 54): every gRPC call carries the cluster token and every server checks it
before any handler runs (unary and streaming calls alike), refusals are counted; with certificates, mutual TLS; a
token file others may read is refused; ``dualpath serve``'s cluster is closed with no setup."""

from __future__ import annotations

import datetime
import os

import grpc
import pytest

from dualpath.core.errors import ConfigError
from dualpath.core.messages import Ack, RequestRef, TokenEvent
from dualpath.core.rpc import (
    ENGINE_METHODS,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    Client,
    PlaneAuth,
    RpcError,
    ThreadedServer,
    ensure_cluster_token,
)


class _Engine:
    """A test double for an engine: ``Health`` answers, ``Stream`` sends one token."""

    def Health(self, ref: RequestRef, ctx) -> Ack:
        return Ack(True, ref.request_id)

    async def Stream(self, ref: RequestRef, ctx):
        yield TokenEvent(ref.request_id, 7, finish_reason="length")


def _serve(auth: PlaneAuth, refused: list) -> ThreadedServer:
    server = ThreadedServer("Engine", max_workers=2)
    server.start(ENGINE_METHODS, _Engine(), "127.0.0.1:0", on_refused=lambda: refused.append(1), auth=auth)
    return server


def test_calls_without_the_token_are_refused_before_any_handler_and_counted():
    refused: list = []
    server = _serve(PlaneAuth(token="s3cret"), refused)
    address = f"127.0.0.1:{server.port}"
    try:
        for auth in (PlaneAuth(), PlaneAuth(token="guess")):
            client = Client("Engine", ENGINE_METHODS, address, auth=auth)
            with pytest.raises(RpcError) as e:
                client.call("Health", RequestRef("x"), timeout=5)
            assert e.value.code is grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(RpcError, match="UNAUTHENTICATED"):
                list(client.stream("Stream", RequestRef("w"), timeout=5))  # a stream is refused the same way
            client.close()
        assert len(refused) == 4
        good = Client("Engine", ENGINE_METHODS, address, auth=PlaneAuth(token="s3cret"))
        assert good.call("Health", RequestRef("ok"), timeout=5).error == "ok"
        assert [ev.token_id for ev in good.stream("Stream", RequestRef("w"), timeout=5)] == [7]
        good.close()
        assert len(refused) == 4
    finally:
        server.stop(grace=0)


def test_a_token_file_others_can_read_is_refused(tmp_path, monkeypatch):
    f = tmp_path / "token"
    f.write_text("from-a-file\n")
    f.chmod(0o644)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.setenv(TOKEN_FILE_ENV, str(f))
    with pytest.raises(ConfigError, match="readable by others"):
        PlaneAuth.from_env()
    f.chmod(0o600)
    assert PlaneAuth.from_env().token == "from-a-file"


def test_a_launcher_gives_its_clusters_one_token(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    ensure_cluster_token()
    first = os.environ[TOKEN_ENV]
    ensure_cluster_token()
    assert os.environ[TOKEN_ENV] == first and len(first) >= 40


def _pki(tmp_path):
    """A CA and two certificates it signed for 127.0.0.1 (server and client), and one it did not sign."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(name, key, issuer_name, issuer_key, ca=False):
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(issuer_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
            )
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        return b.sign(issuer_key, hashes.SHA256())

    def write(name, obj, key=False):
        path = tmp_path / name
        data = (
            obj.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
            if key
            else obj.public_bytes(serialization.Encoding.PEM)
        )
        path.write_bytes(data)
        path.chmod(0o600)
        return data

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dualpath-ca")])
    ca = write("ca.pem", cert("dualpath-ca", ca_key, ca_name, ca_key, ca=True))
    out = {}
    for who, signer in (("server", ca_key), ("client", ca_key), ("rogue", None)):
        key = ec.generate_private_key(ec.SECP256R1())
        issuer_key = signer or key
        issuer = ca_name if signer else x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, who)])
        out[who] = PlaneAuth(
            token="t",
            cert=write(f"{who}.pem", cert(who, key, issuer, issuer_key)),
            key=write(f"{who}.key", key, key=True),
            ca=ca,
        )
    return out


def test_mutual_tls_refuses_a_client_without_a_certificate_the_ca_signed(tmp_path):
    pki = _pki(tmp_path)
    refused: list = []
    server = _serve(pki["server"], refused)
    address = f"127.0.0.1:{server.port}"
    try:
        good = Client("Engine", ENGINE_METHODS, address, auth=pki["client"])
        assert good.call("Health", RequestRef("tls"), timeout=10).error == "tls"
        good.close()
        for auth in (pki["rogue"], PlaneAuth(token="t")):  # another CA's certificate; plain text
            client = Client("Engine", ENGINE_METHODS, address, auth=auth)
            with pytest.raises(RpcError, match="UNAVAILABLE"):
                client.call("Health", RequestRef("x"), timeout=5)
            client.close()
    finally:
        server.stop(grace=0)


def test_tls_needs_all_three_files(monkeypatch, tmp_path):
    monkeypatch.setenv("DUALPATH_TLS_CERT", str(tmp_path / "c.pem"))
    monkeypatch.delenv("DUALPATH_TLS_KEY", raising=False)
    monkeypatch.delenv("DUALPATH_TLS_CA", raising=False)
    with pytest.raises(ConfigError, match="mutual TLS needs all of"):
        PlaneAuth.from_env()


def test_a_launched_clusters_plane_refuses_callers_without_its_token(tiny_dirs, tmp_path, monkeypatch):
    """The attacks of issue 54 against a running cluster, by a process that reaches its ports but lacks its token:
    a submission, a rogue engine's registration, the scheduler's stats, an engine's token stream; each is refused
    and counted, while the cluster's own clients (which inherit the token) are served."""
    import time

    from dualpath import SamplingParams
    from dualpath.client import ClusterClient
    from dualpath.launcher import ClusterSpec, LocalCluster
    from dualpath.core.messages import EngineInfo, Role, SubmitRequest, pack_tokens
    from dualpath.core.rpc import SCHEDULER_METHODS

    spec = ClusterSpec(
        model=str(tiny_dirs["llama"]),
        block_size=16,
        kv_store=str(tmp_path / "kv"),
        buffer_bytes=8 << 20,
        cache_bytes=16 << 20,
        workspace_tokens=2048,
        cost_model="0.001,0.0001,0",
    )
    with LocalCluster(spec, run_dir=str(tmp_path / "run")) as c:
        client = ClusterClient(c.scheduler_address, timeout=60)
        assert client.generate(list(range(3, 40)), SamplingParams(temperature=0, max_tokens=4)).token_ids
        monkeypatch.delenv(TOKEN_ENV)
        rogue = Client("Scheduler", SCHEDULER_METHODS, c.scheduler_address)
        info = EngineInfo("rogue", Role.DECODE, "n", "127.0.0.1:1", "shm", {}, [], 1, 64, 16, 2, "ab" * 16, 10_000)
        with pytest.raises(RpcError, match="UNAUTHENTICATED"):
            rogue.call("Register", info, timeout=5)
        with pytest.raises(RpcError, match="UNAUTHENTICATED"):
            rogue.call("Stats", RequestRef(""), timeout=5)
        with pytest.raises(RpcError, match="UNAUTHENTICATED"):
            list(
                rogue.stream(
                    "Submit", SubmitRequest("x", pack_tokens(range(40)), SamplingParams().to_dict()), timeout=5
                )
            )
        engine = Client("Engine", ENGINE_METHODS, c.engine_addresses["decode-0"])
        with pytest.raises(RpcError, match="UNAUTHENTICATED"):
            list(engine.stream("Stream", RequestRef("x.0"), timeout=5))
        token_file = c.token_file  # how another process of the host calls in (`dualpath status`)
        assert oct(token_file.stat().st_mode & 0o777) == "0o600"
        monkeypatch.setenv(TOKEN_FILE_ENV, str(token_file))
        assert Client("Scheduler", SCHEDULER_METHODS, c.scheduler_address).call("Stats", RequestRef(""), timeout=5)
        monkeypatch.delenv(TOKEN_FILE_ENV)
        import subprocess
        import sys

        status = subprocess.run(
            [sys.executable, "-m", "dualpath.cli", "status", "--scheduler", c.scheduler_address, "--timeout", "60"],
            capture_output=True,
            text=True,
            timeout=60,
            env={k: v for k, v in os.environ.items() if not k.startswith(TOKEN_ENV)},
        )
        assert status.returncode == 1 and status.stdout.startswith("refused:"), status.stdout + status.stderr
        assert "DUALPATH_CLUSTER_TOKEN_FILE" in status.stdout  # at once, with what to do: not after --timeout
        deadline = time.monotonic() + 10  # the engine's refusal arrives with its next report
        while client.stats()["rpc_refused"] < 5 and time.monotonic() < deadline:
            time.sleep(0.1)
        stats = client.stats()
        assert stats["rpc_refused"] == 5 and "rogue" not in stats["engines"]
        client.close()
