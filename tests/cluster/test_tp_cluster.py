"""Tensor-parallel engines in a cluster (issue 47): a 1P (TP 2) + 2D (TP 1) ``dualpath serve`` answers through its
OpenAI-compatible HTTP API what the one-process TP 1 reference answers, on each read path, with KV written by one
parallelism and read by the other; and a rank of a TP 2 engine killed mid-request takes that engine out (exit code
1, its log naming the rank) while every request completes with the reference's tokens (replies moved off the dead
decode engine, prefills retried elsewhere) and the other engines serve on."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import openai
import pytest
from cluster_calls import generate_during
from serve_process import ServeProcess, alive
from test_cluster import (
    BS,
    GREEDY,
    MOVING,
    assert_as_the_reference,
    conversation,
    replies_while,
    spec,
)

from dualpath import LLM, SamplingParams
from dualpath.client import ClusterClient
from dualpath.launcher import LocalCluster

RANKS_MODULE = "dualpath.engines.parallel.ranks"


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    return LLM(str(tiny_dirs["llama"]), block_size=BS)


def rank_pids(engine_pid: int) -> list[int]:
    """The other ranks of the engine process ``engine_pid``: its children running ``dualpath.engines.parallel.ranks``."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat, cmd = (d / "stat").read_text(), (d / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == engine_pid and RANKS_MODULE.encode() in cmd:
            found.append(int(d.name))
    return found


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"{what} not within {timeout:.0f} s")


# --- (a) through the HTTP server: TP 2 prefill, TP 1 decode, equal to TP 1 -------------------------------------
@pytest.fixture(scope="module")
def mixed_server(tiny_dirs, tmp_path_factory):
    """``dualpath serve`` of 1 prefill engine at TP 2 (two processes) and 2 decode engines at TP 1."""
    server = ServeProcess(
        "--model",
        str(tiny_dirs["llama"]),
        "--block-size",
        str(BS),
        "--prefill",
        "1",
        "--decode",
        "2",
        "--prefill-tensor-parallel-size",
        "2",
        "--decode-tensor-parallel-size",
        "1",
        "--buffer-bytes",
        str(8 << 20),
        "--cache-bytes",
        str(16 << 20),
        "--workspace-tokens",
        "2048",
        "--kv-store",
        str(tmp_path_factory.mktemp("kv")),
        "--max-model-len",
        "1024",
        "--torch-threads",
        "1",
    )
    yield server
    children = server.children()
    assert server.stop() == 0, server.log_tail()
    deadline = time.monotonic() + 10
    while [p for p in children if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in children if alive(p)], "serve left processes behind"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pe", "de", "split"])
def test_a_mixed_parallelism_server_answers_as_tp1_on_each_read_path(mixed_server, reference, mode):
    """Three chat turns, greedy, the read path forced (``dualpath.mode``): each turn's token ids are the TP 1
    reference's for the prompt the chat template renders, and each later turn loads the earlier turns' KV from
    storage by that path. The stored blocks are written by the TP 1 decode engines (every full block they hold)
    and read by the TP 2 prefill engine (PE path, and its share of a split) or handed to it out of a decode engine's
    buffer (DE path); the prompt KV a decode engine receives was computed by the TP 2 engine's ranks."""
    engines = [pid for pid in mixed_server.children() if rank_pids(pid)]
    assert len(engines) == 1 and len(rank_pids(engines[0])) == 1  # the prefill engine's rank 1 (TP 1: no ranks)
    chat_turns_as_the_reference(mixed_server, reference, mode, "llama")


def chat_turns_as_the_reference(server, reference, mode: str, model: str) -> None:
    """Three greedy chat turns and a streamed completion, twice, through ``server``'s HTTP API with the read path
    forced: the reference's tokens and text, the later turns' KV loaded by that path."""
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [
        {
            "role": "user",
            "content": f"Tell me, in the {mode} way, about the weather over the hills, "
            "and the rivers, and the sea. " * 2,
        }
    ]
    paths = []
    for turn in range(3):
        r = c.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=10,
            temperature=0,
            extra_body={"dualpath": {"mode": mode, "usage": True}, "return_token_ids": True},
        ).model_dump()
        ids = reference.tokenizer.apply_chat_template(messages)
        want = reference.generate(ids, SamplingParams(temperature=0, max_tokens=10))[0]
        assert r["prompt_token_ids"] == ids, (mode, turn)
        assert r["choices"][0]["token_ids"] == want.token_ids, (mode, turn)
        assert r["choices"][0]["message"]["content"] == want.text, (mode, turn)
        cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert r["usage"]["dualpath"]["cached_tokens"] == cached
        if turn:
            assert cached >= BS, (mode, turn, r["usage"])  # the earlier turns' KV, loaded from storage
            paths.append(r["usage"]["dualpath"]["read_path"])
        messages += [
            {"role": "assistant", "content": want.text},
            {"role": "user", "content": f"And then, part {turn}, what of the {mode} hills?"},
        ]
    assert set(paths) == {mode}, paths  # (each later turn's hit spans 2+ blocks: a split has both sides read)
    # a streamed completion of the same conversation's text: its pieces join into the reference's text
    prompt = f"The quick brown fox ({mode}) jumps over the lazy dog " * 3
    want = reference.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0]
    for attempt in range(2):  # the second time its blocks come from storage
        text = "".join(
            ch.choices[0].text
            for ch in c.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"dualpath": {"mode": mode}},
            )
            if ch.choices
        )
        assert text == want.text, (mode, attempt)


# --- (b) a rank killed mid-request ------------------------------------------------------------------------------
@contextmanager
def mixed_role_cluster(model, tmp_path, role: str, **kw) -> Iterator[LocalCluster]:
    """A cluster whose ``{role}-0`` runs at TP 2 and ``{role}-1`` at TP 1 (added after the start: a role's engines
    are of one size in a ``ClusterSpec``), and one engine of the other role at TP 1."""
    other = "decode" if role == "prefill" else "prefill"
    s = spec(model, tmp_path / "kv", **{f"num_{role}": 1, f"num_{other}": 1, f"{role}_tensor_parallel_size": 2, **kw})
    with LocalCluster(s, run_dir=str(tmp_path / "run")) as c:
        c.spec = replace(c.spec, **{f"{role}_tensor_parallel_size": 1})
        assert c.add_engine(role) == f"{role}-1"
        yield c


def kill_rank_1(c: LocalCluster, name: str) -> int:
    """SIGKILL rank 1 of engine ``name`` (the one process its engine process started); its pid."""
    (pid,) = rank_pids(c.child(name).proc.pid)
    os.kill(pid, signal.SIGKILL)
    return pid


def assert_left_naming_the_rank(
    c: LocalCluster, name: str, client: ClusterClient, role: str, rank_pid: int, caplog
) -> None:
    """The engine process exits 1 (its supervisor would start it again, whole), its log names the dead rank, the
    launcher reports the exit, and the scheduler counts one engine of ``role`` alive."""
    proc = c.child(name).proc
    assert proc.wait(30) == 1, c.child(name).tail()
    text = c.child(name).log_path.read_text()
    assert f"lost a rank: rank 1 (pid {rank_pid}, cpu) exited by signal SIGKILL" in text, text[-3000:]
    wait_for(
        lambda: any(f"{name} exited with 1" in r.getMessage() for r in caplog.records),
        10,
        "the launcher's report of the exit",
    )
    wait_for(lambda: client.stats()["engines_alive_by_role"][role] == 1, 30, f"{name} counted gone")
    assert not rank_pids(proc.pid)


@pytest.mark.slow
def test_a_decode_rank_killed_mid_reply_moves_its_replies_and_the_engine_leaves(tiny_dirs, tmp_path, reference, caplog):
    """Four long replies streaming (greedy; seeded with two choices; with penalties) when rank 1 of the TP 2 decode
    engine is killed: its replies move to the TP 1 decode engine from the tokens delivered and every choice is the
    reference's; the TP 2 engine exits 1, naming the rank, without waiting out a heartbeat (30 s here); later
    requests are served by the others."""
    caplog.set_level(logging.INFO, logger="dualpath.launcher")
    with mixed_role_cluster(tiny_dirs["llama"], tmp_path, "decode", heartbeat_timeout_s=30.0) as c:
        moved: list[str] = []
        client = ClusterClient(c.scheduler_address, timeout=60, on_migration=moved.append)
        try:
            streaming = threading.Semaphore(0)
            cases = [(conversation(800 + i, 1)[0], p) for i, p in enumerate(MOVING)]
            killed = []
            outcomes, took = replies_while(client, cases, streaming, lambda: killed.append(kill_rank_1(c, "decode-0")))
            assert moved, "no reply was on the TP 2 decode engine"
            assert took < 30, took
            assert_as_the_reference(reference, outcomes)
            assert_left_naming_the_rank(c, "decode-0", client, "decode", killed[0], caplog)
            for i in range(2):  # later requests: the surviving engines serve them
                prompt = conversation(810 + i, 1)[0]
                assert client.generate(prompt, GREEDY).token_ids == reference.generate(prompt, GREEDY)[0].token_ids
        finally:
            client.close()


@pytest.mark.slow
def test_a_prefill_rank_killed_mid_prefill_has_its_requests_retried_and_the_engine_leaves(
    tiny_dirs, tmp_path, reference, caplog
):
    """Second turns whose stored prefixes load slowly (50 KB/s) on the PE path, spread over a TP 2 and a TP 1
    prefill engine, when rank 1 of the TP 2 one is killed: the requests it held are retried on the other and every
    reply is the reference's; the TP 2 engine exits 1 naming the rank; later requests are served."""
    caplog.set_level(logging.INFO, logger="dualpath.launcher")
    with mixed_role_cluster(
        tiny_dirs["llama"],
        tmp_path,
        "prefill",
        heartbeat_timeout_s=30.0,
        storage_read_bps=50_000.0,
        policy="least-loaded",
        load_every_hit=True,
    ) as c:
        client = ClusterClient(c.scheduler_address, timeout=120)
        try:
            prompts = []
            for i in range(6):
                prompt, appends = conversation(820 + i, 1)
                first = client.generate(prompt, GREEDY, mode="pe")
                prompts.append(prompt + first.token_ids + appends[0])
            killed = []
            start = time.monotonic()
            results = generate_during(
                client,
                prompts,
                GREEDY,
                lambda: killed.append(kill_rank_1(c, "prefill-0")),
                after_s=0.5,
                mode="pe",
                join_s=90,
            )
            assert time.monotonic() - start < 90
            for prompt, got in zip(prompts, results):
                assert got.token_ids == reference.generate(prompt, GREEDY)[0].token_ids
            assert client.stats()["retried"] >= 1
            assert_left_naming_the_rank(c, "prefill-0", client, "prefill", killed[0], caplog)
            for i in range(2):
                prompt = conversation(830 + i, 1)[0]
                got = client.generate(prompt, GREEDY, mode="pe")
                assert got.token_ids == reference.generate(prompt, GREEDY)[0].token_ids
        finally:
            client.close()


# --- (c) MoE models through the HTTP server: expert parallelism, data-parallel attention ---------------------------
MOE_SERVERS = {  # DeepSeek-V3 (MLA heads split, experts whole per rank) at TP 2 both roles; Qwen3-MoE in DP groups
    "ep": ("deepseek_v3", "--prefill", "1", "--decode", "1", "-tp", "2", "--enable-expert-parallel"),
    "dp": ("qwen3_moe", "--prefill", "2", "--decode", "2", "--data-parallel-size", "2"),
}


@pytest.fixture(scope="module", params=sorted(MOE_SERVERS))
def moe_server(request, tiny_dirs, tmp_path_factory):
    arch, *flags = MOE_SERVERS[request.param]
    server = ServeProcess(
        "--model",
        str(tiny_dirs[arch]),
        "--block-size",
        str(BS),
        *flags,
        "--buffer-bytes",
        str(8 << 20),
        "--cache-bytes",
        str(16 << 20),
        "--workspace-tokens",
        "2048",
        "--kv-store",
        str(tmp_path_factory.mktemp("kv")),
        "--max-model-len",
        "1024",
        "--torch-threads",
        "1",
    )
    yield arch, server, LLM(str(tiny_dirs[arch]), block_size=BS)
    assert server.stop() == 0, server.log_tail()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pe", "de", "split"])
def test_moe_servers_answer_as_one_process_on_each_read_path(moe_server, mode):
    """An EP prefill engine and an EP decode engine (or groups of data-parallel engines) serve chat turns equal to
    the one-process reference on each read path, the later turns' KV loaded from storage."""
    arch, server, reference = moe_server
    chat_turns_as_the_reference(server, reference, mode, arch)
