"""Multi-host on one machine: scheduler and frontend on one host, a prefill node and a decode node on two others,
each host its own network namespace joined by veth, each engine node's NIC rate-limited with tc. KV moves between
the nodes over the ucx transport (TCP across the veths); a multi-turn conversation on both read paths must equal
the single-process reference token for token, and its KV bytes must have crossed the shaped links."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import openai
import pytest

from dualpath import LLM, SamplingParams
from dualpath.launcher import Supervisor
from netns_hosts import Hosts, netns_missing

BS = 16
RATE = "200mbit"
pytestmark = pytest.mark.skipif(netns_missing() is not None, reason=str(netns_missing()))
pytest.importorskip("ucxx")


@pytest.fixture(scope="module")
def cluster(tiny_dirs, tmp_path_factory):
    run, kv = tmp_path_factory.mktemp("mh-run"), tmp_path_factory.mktemp("mh-kv")
    hosts = Hosts(["head", "p0", "d0"], rates={"p0": RATE, "d0": RATE}).up()
    procs = Supervisor(str(run), torch_threads=1, log_level="INFO")
    head, model = hosts["head"], str(tiny_dirs["llama"])
    sched = f"{head.ip}:50051"
    try:
        s = procs.spawn(
            "scheduler",
            ["scheduler", "--host", head.ip, "--port", "50051", "--kv-store", str(kv), "--heartbeat-timeout", "10"],
            prefix=head.exec_prefix(),
        )
        procs.wait_ready([s], 120)
        engine = [
            "--",
            "--model",
            model,
            "--transport",
            "ucx",
            "--kv-store",
            str(kv),
            "--block-size",
            str(BS),
            "--buffer-bytes",
            str(8 << 20),
            "--cache-bytes",
            str(16 << 20),
            "--workspace-tokens",
            "2048",
            "--cost-model",
            "0.001,0.0001,0",
            "--storage-read-bps",
            str(50e6),
        ]
        nodes = [
            procs.spawn(
                role,
                [
                    "node",
                    "--role",
                    role,
                    "--scheduler",
                    sched,
                    "--engines",
                    "1",
                    "--node-id",
                    h,
                    "--host",
                    hosts[h].ip,
                    "--torch-threads",
                    "1",
                    "--run-dir",
                    str(run / h),
                    *engine,
                ],
                prefix=hosts[h].exec_prefix(),
            )
            for role, h in (("prefill", "p0"), ("decode", "d0"))
        ]
        fe = procs.spawn(
            "frontend",
            ["frontend", "--scheduler", sched, "--host", head.ip, "--port", "8000", "--model", model],
            prefix=head.exec_prefix(),
        )
        procs.wait_ready([*nodes, fe], 300)
        yield hosts, procs, f"http://{head.ip}:8000", sched
    finally:
        procs.stop(timeout=30)
        hosts.down()
    codes = {c.name: c.proc.returncode for c in procs.children}
    assert all(c == 0 for c in codes.values()), codes


def test_a_conversation_across_hosts_over_ucx_equals_the_reference(cluster, tiny_dirs):
    hosts, procs, url, sched = cluster
    reference = LLM(str(tiny_dirs["llama"]), block_size=BS)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    tx0 = {h: hosts[h].tx_bytes() for h in ("p0", "d0")}
    for mode in ("pe", "de"):  # storage -> prefill node, and storage -> decode node -> ucx -> prefill node
        messages = [{"role": "user", "content": f"({mode}) plan a trip across three hosts and their links " * 4}]
        for turn in range(3):
            r = client.chat.completions.create(
                model="llama",
                messages=messages,
                max_tokens=8,
                temperature=0,
                extra_body={"dualpath": {"mode": mode, "usage": True}},
            )
            want = reference.generate(
                reference.tokenizer.apply_chat_template(messages), SamplingParams(temperature=0, max_tokens=8)
            )[0]
            assert r.choices[0].message.content == want.text, (mode, turn)
            if turn:
                assert r.usage.prompt_tokens_details.cached_tokens > 0, (mode, turn)
                assert r.usage.model_extra["dualpath"]["read_path"] == mode
            messages += [{"role": "assistant", "content": want.text}, {"role": "user", "content": f"next {turn}"}]

    stats = json.loads(
        subprocess.run(
            [sys.executable, "-m", "dualpath.cli", "status", "--scheduler", sched, "--json"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    )
    reads = stats["storage_read_bytes"]
    assert reads["p0"] > 0 and reads["d0"] > 0, reads  # each node's storage served its own read path
    # KV crossed the shaped links: the decode node sent its loads (DE path) to the prefill node, the prefill node
    # sent every prompt's KV to the decode node. Each link carried at least the bytes read on the other side.
    sent = {h: hosts[h].tx_bytes() - tx0[h] for h in ("p0", "d0")}
    print(f"storage reads {reads}, bytes sent over the shaped links {sent}")
    assert sent["d0"] >= reads["d0"] and sent["p0"] > 0, (sent, reads)
    for h in ("p0", "d0"):
        qdisc = hosts.qdisc(h)
        assert "tbf" in qdisc and int(re.search(r"Sent (\d+) bytes", qdisc).group(1)) >= sent[h], qdisc
    assert "transport ucx" in (procs.run_dir / "d0" / "decode-0.log").read_text()
