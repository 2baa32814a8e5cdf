"""The runtime in real processes: a scheduler, one prefill and two decode engines (tiny random model, CPU),
KV through real files and the shm transport. Outputs must equal the single-process ``LLM`` reference."""

import json
import os
import signal
import threading
from dataclasses import replace

import time

import pytest

from dualpath import LLM, SamplingParams
from dualpath.client import ClusterClient
from dualpath.core.sessions import SessionHint
from dualpath.core.errors import DualPathError, RequestError
from dualpath.core.geometry import block_hashes, model_fingerprint
from dualpath.launcher import ClusterSpec, LocalCluster
from cluster_calls import generate_during
from dualpath.engines.models import open_checkpoint
from dualpath.scheduler.http import render
from dualpath.traffic.memory import SEGMENT_PREFIX, SHM_DIR
from dualpath.traffic.storage.fs import list_stored_keys

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=12)
MODES = ["pe", "de", "dualpath", "basic"]


def spec(model, kv, **kw):
    base = dict(
        model=str(model),
        num_prefill=1,
        num_decode=2,
        block_size=BS,
        kv_store=str(kv),
        buffer_bytes=8 << 20,
        cache_bytes=16 << 20,
        workspace_tokens=2048,
        cost_model="0.001,0.0001,0",
        heartbeat_timeout_s=5.0,
    )
    return ClusterSpec(**{**base, **kw})


@pytest.fixture(scope="module")
def cluster(tiny_dirs, tmp_path_factory):
    kv = tmp_path_factory.mktemp("kv")
    with LocalCluster(spec(tiny_dirs["llama"], kv), run_dir=str(tmp_path_factory.mktemp("run"))) as c:
        client = ClusterClient(c.scheduler_address, timeout=120)
        yield c, client, kv
        client.close()


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    return LLM(str(tiny_dirs["llama"]), block_size=BS)


def conversation(seed: int, turns: int):
    """Turn i's prompt = everything before + the reply + a new user message (tokens)."""
    first = [(seed * 37 + i * 11) % 250 + 3 for i in range(40 + seed % 7)]
    appends = [[(seed * 13 + t * 7 + i) % 250 + 3 for i in range(9 + t)] for t in range(turns)]
    return first, appends


REFERENCE_LOCK = threading.Lock()  # the single-process reference is not thread-safe


def run_conversation(client, reference, seed, turns, mode):
    prompt, appends = conversation(seed, turns)
    results = []
    for t in range(turns):
        got = client.generate(prompt, GREEDY, mode=mode)
        with REFERENCE_LOCK:
            want = reference.generate(prompt, GREEDY)[0].token_ids
        results.append((prompt, got, want))
        prompt = prompt + got.token_ids + appends[t]
    return results


def moved(now: dict, before: dict, what: str) -> int:
    """Bytes the engines' traffic managers moved as ``what`` between two stats."""
    total = lambda stats: sum(t.get(what, 0) for t in stats["traffic_bytes"].values())  # noqa: E731
    return total(now) - total(before)


def prefetched(now: dict, before: dict) -> bool:
    """A prefetch was ordered since ``before`` and every block ordered is read (or skipped)."""
    return now["ordered"] > before["ordered"] and now["loaded"] + now["skipped"] >= now["ordered"]


def test_a_sessions_kv_is_prefetched_while_its_tool_runs_and_its_next_turn_reads_it(cluster, reference):
    """An agent session's turn ends in a tool wait; its KV is read into an engine's buffer; the next turn goes there,
    copies the prefetched blocks instead of reading storage, and replies exactly what the reference does."""
    c, client, _ = cluster
    prompt, appends = conversation(seed=11, turns=3)
    session = SessionHint("agent-prefetch-test")
    for t in range(3):
        before = client.stats()
        got = client.generate_choices(prompt, GREEDY, session=session, tool_wait=t < 2)[0]
        with REFERENCE_LOCK:
            assert got.token_ids == reference.generate(prompt, GREEDY)[0].token_ids, t
        if t:
            assert got.prefetched and got.num_cached_tokens >= (len(prompt) - 1 - len(appends[t - 1])) // BS * BS
            # the turn's loads (not the next prefetch's reads, which may have begun): all from the prefetched copies
            assert moved(client.stats(), before, "storage_read:kv") == 0
            assert moved(client.stats(), before, "prefetch_hit:kv") == got.storage_bytes > 0
        prompt = prompt + got.token_ids + appends[t]
        deadline = time.monotonic() + 20  # the tool runs until the session's blocks are in a buffer
        while t < 2 and not prefetched(client.stats()["prefetch"], before["prefetch"]):
            assert time.monotonic() < deadline, client.stats()["prefetch"]
            time.sleep(0.05)
    stats = client.stats()
    assert stats["session_turns_prefetched"] >= 2 and stats["prefetch"]["used"] > 0


@pytest.mark.parametrize("mode", MODES)
def test_five_turns_hit_storage_and_match_the_reference(cluster, reference, mode):
    c, client, _ = cluster
    before = client.stats()
    results = run_conversation(client, reference, seed=MODES.index(mode), turns=5, mode=mode)
    for turn, (prompt, got, want) in enumerate(results):
        assert got.token_ids == want, f"{mode} turn {turn}"
        # dualpath: either path, the policy's choice (where its bytes were read is checked below)
        assert got.path in ({"pe", "de"} if mode == "dualpath" else {"pe" if mode == "basic" else mode}), turn
        if turn >= 1:
            # every full block of the previous prompt and reply is stored, so the hit covers them
            assert (
                got.num_cached_tokens
                >= (len(results[turn - 1][0]) + len(results[turn - 1][1].token_ids) - 1) // BS * BS
            )
            assert got.storage_bytes > 0
    # each turn's bytes were read on its path's side (the prefill engine's node, or a decode engine's), and the
    # scheduler counted each turn's path as the turn reports it
    paths = [got.path for _, got, _ in results]
    read = {side: sum(got.storage_bytes for _, got, _ in results if got.path == side) for side in ("pe", "de")}
    role = {"pe": "prefill", "de": "decode"}
    deadline = time.monotonic() + 10  # the engines report their reads at their next pull
    while True:
        after = client.stats()
        grew = {
            side: sum(
                v - before["storage_read_bytes"].get(n, 0)
                for n, v in after["storage_read_bytes"].items()
                if n.startswith(role[side])
            )
            for side in ("pe", "de")
        }
        if grew == read or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert grew == read
    assert {p: after[f"path_{p}"] - before[f"path_{p}"] for p in role} == {p: paths.count(p) for p in role}


def test_concurrent_conversations_on_both_paths(cluster, reference):
    c, client, _ = cluster
    out, errors = {}, []

    def talk(seed, mode):
        try:
            out[seed] = run_conversation(client, reference, seed, turns=3, mode=mode)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=talk, args=(10 + i, ["pe", "de"][i % 2])) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    for seed, results in out.items():
        for prompt, got, want in results:
            assert got.token_ids == want, seed
    paths = {got.path for results in out.values() for _, got, _ in results[1:]}
    assert paths == {"pe", "de"}


@pytest.mark.parametrize(
    "arch",
    [
        pytest.param("qwen3_moe", marks=pytest.mark.slow),  # (~6 s; llama's cluster runs by default)
        pytest.param("deepseek_v32", marks=pytest.mark.slow),
        pytest.param("deepseek_v3-fp8", marks=pytest.mark.slow),  # (fp8 KV: test_an_fp8_kv_cluster_..., by default)
    ],
)
def test_other_architectures_match_the_reference_on_both_read_paths(tiny_dirs, tmp_path, arch):
    """Qwen3-MoE (per-head q/k norms, softmax-routed experts, a dense layer between), DeepSeek-V3.2 (sparse
    attention over 16 of the 40-80 tokens each query sees, its indexer keys stored in the KV rows) and DeepSeek-V3
    with its weights quantized to FP8 as the engines load them (``--quantization fp8``; equal to a stored FP8
    checkpoint's, test_fp8_weights) through engine processes: stored KV read by the prefill engine and through the
    decode engine gives the single-process tokens."""
    model, quantization = tiny_dirs[arch.removesuffix("-fp8")], "fp8" if arch.endswith("-fp8") else None
    reference = LLM(str(model), block_size=BS, quantization=quantization)
    with LocalCluster(
        spec(model, tmp_path / "kv", num_decode=1, quantization=quantization), run_dir=str(tmp_path / "run")
    ) as c:
        client = ClusterClient(c.scheduler_address, timeout=120)
        try:
            for mode in ("pe", "de"):
                results = run_conversation(client, reference, seed=40 + len(mode), turns=3, mode=mode)
                assert [got.token_ids for _, got, _ in results] == [want for _, _, want in results], mode
                assert all(got.num_cached_tokens > 0 and got.path == mode for _, got, _ in results[1:]), mode
        finally:
            client.close()


@pytest.mark.parametrize("mode", ["pe", "de"])
def test_a_schema_the_engines_cannot_enforce_fails_its_request_clearly(cluster, reference, mode):
    """A client that skips the frontend's checks: the prefill engine refuses the grammar, the request fails with the
    reason, and the engines go on serving (a schema they can enforce included)."""
    c, client, _ = cluster
    prompt, _ = conversation(500, 1)
    bad = SamplingParams(temperature=0, max_tokens=8, json_schema=json.dumps({"type": "array", "uniqueItems": True}))
    with pytest.raises(DualPathError, match="uniqueItems"):
        client.generate(prompt, bad, mode=mode)
    good = SamplingParams(
        temperature=0,
        max_tokens=60,
        json_schema=json.dumps(
            {
                "type": "object",
                "properties": {"n": {"type": "integer"}},
                "required": ["n"],
                "additionalProperties": False,
            }
        ),
    )
    got = client.generate(prompt, good, mode=mode)
    with REFERENCE_LOCK:
        assert got.token_ids == reference.generate(prompt, good)[0].token_ids
        assert client.generate(prompt, GREEDY, mode=mode).token_ids == reference.generate(prompt, GREEDY)[0].token_ids


def test_every_full_block_is_stored_and_only_full_ones(cluster, reference, tiny_dirs):
    c, client, kv = cluster
    ckpt = open_checkpoint(tiny_dirs["llama"])
    fp = model_fingerprint(ckpt.config, "float32", BS, ckpt.weights_digest)
    before = set(list_stored_keys(kv / fp.hex()))
    results = run_conversation(client, reference, seed=99, turns=3, mode="dualpath")
    stored = set(list_stored_keys(kv / fp.hex()))
    expected = set()
    for prompt, got, _ in results:
        with_kv = prompt + got.token_ids[:-1]  # the last generated token has no KV yet
        hashes = block_hashes(with_kv, fp, BS)
        assert set(hashes) <= stored
        expected |= set(hashes)
    assert stored - before == expected - before  # nothing else: no partial blocks
    # what is stored is reported: each engine's last load report, the scheduler's /metrics per node
    on_disk = sum(p.stat().st_size for p in (kv / fp.hex()).rglob("*.kv"))
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # a prefill engine recounts the directory every 5 s
        engines = client.stats()["engines"].values()
        if all(e["storage_used_bytes"] == on_disk for e in engines):
            break
        time.sleep(0.2)
    assert [e["storage_used_bytes"] for e in engines] == [on_disk] * len(engines)
    lines = render(client.stats()).splitlines()
    used = [float(ln.split()[-1]) for ln in lines if ln.startswith("dualpath_storage_used_bytes{")]
    assert used and set(used) == {on_disk}
    usage = [float(ln.split()[-1]) for ln in lines if ln.startswith("dualpath_engine_kv_cache_usage{")]
    assert len(usage) == len(engines) and all(0 <= u <= 1 for u in usage)


def test_salted_conversations_hit_only_their_own_salts_blocks(cluster, reference, tiny_dirs):
    """vLLM's cache_salt: a tenant's turns hit what its own earlier turns stored (prompt and reply blocks, chained
    from the salted root by the decode engine), never another salt's or the unsalted store; replies are alike."""
    c, client, kv = cluster
    ckpt = open_checkpoint(tiny_dirs["llama"])
    fp = model_fingerprint(ckpt.config, "float32", BS, ckpt.weights_digest)
    prompt, appends = conversation(301, 1)
    want = reference.generate(prompt, GREEDY)[0].token_ids
    first = client.generate(prompt, replace(GREEDY, cache_salt="tenant-a"))
    assert first.token_ids == want and first.num_cached_tokens == 0
    for salt, hit in (("tenant-b", False), ("", False), ("tenant-a", True)):
        got = client.generate(prompt, replace(GREEDY, cache_salt=salt), mode="dualpath")
        assert got.token_ids == want, salt
        assert got.num_cached_tokens == (len(prompt) - 1) // BS * BS * hit, salt
    stored = set(list_stored_keys(kv / fp.hex()))
    for salt in ("tenant-a", "tenant-b", ""):
        assert set(block_hashes(prompt, fp, BS, salt=salt)) <= stored
    turn2 = prompt + first.token_ids + appends[0]
    with_kv = prompt + first.token_ids[:-1]  # the reply's full blocks are stored under tenant-a's chain too
    assert set(block_hashes(with_kv, fp, BS, salt="tenant-a")) <= stored
    got = client.generate(turn2, replace(GREEDY, cache_salt="tenant-a"))
    assert got.token_ids == reference.generate(turn2, GREEDY)[0].token_ids
    assert got.num_cached_tokens == len(with_kv) // BS * BS
    short = prompt[: BS - 5]  # no full block: the reply's first one starts the chain, from the salted root
    got = client.generate(short, replace(GREEDY, cache_salt="tenant-c"))
    first_block = block_hashes(short + got.token_ids, fp, BS, salt="tenant-c")[:1]
    assert set(first_block) <= set(list_stored_keys(kv / fp.hex()))


def test_a_priority_is_refused_by_a_first_come_first_served_scheduler(cluster):
    _, client, _ = cluster
    with pytest.raises(RequestError, match="--scheduling-policy priority"):
        client.generate(conversation(302, 1)[0], replace(GREEDY, priority=-1))


@pytest.mark.slow  # (the default run stays under 10 minutes)
def test_a_priority_scheduler_hands_the_most_urgent_request_to_a_full_cluster_first(tiny_dirs, tmp_path, reference):
    """One decode engine with room for one reply at a time (336 tokens; each reserves 208): requests sent while
    generation is held run one after another when it resumes, the most urgent (lowest priority) first and equal
    priorities in arrival order; each reply is the reference's."""
    s = spec(tiny_dirs["llama"], tmp_path / "kv", num_decode=1, cache_bytes=256 << 10, scheduling_policy="priority")
    with LocalCluster(s, run_dir=str(tmp_path / "run")) as c:
        client = ClusterClient(c.scheduler_address, timeout=120)
        client.hold(True)
        sent = [("late-1", 5), ("late-2", 5), ("urgent", -3), ("normal", 0)]
        handles, finished = {}, []
        for i, (rid, priority) in enumerate(sent):
            prompt = conversation(310 + i, 1)[0] * 2
            params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, priority=priority)
            handles[rid] = (prompt, params, client.start(prompt, params, rid))

        def consume(rid):
            tokens = [ev.token_id for ev in handles[rid][2].events() if ev.token_id >= 0]
            finished.append((time.monotonic(), rid, tokens))

        threads = [threading.Thread(target=consume, args=(rid,)) for rid in handles]
        for th in threads:
            th.start()
        time.sleep(0.5)  # all four are queued behind the hold
        client.hold(False)
        for th in threads:
            th.join(timeout=120)
        assert [rid for _, rid, _ in sorted(finished)] == ["urgent", "normal", "late-1", "late-2"]
        for _, rid, tokens in finished:
            prompt, params, _ = handles[rid]
            assert tokens == reference.generate(prompt, replace(params, priority=0))[0].token_ids, rid
        client.close()


@pytest.mark.slow  # (the default run stays under 10 minutes)
def test_an_urgent_request_preempts_a_reply_which_then_goes_on_unchanged(tiny_dirs, tmp_path, reference):
    """One decode engine with room for one reply at a time (336 tokens; the background reply reserves 256, the
    urgent one 96): an urgent request sent while a less urgent reply generates has that reply handed back (its
    blocks stored), runs first, and the reply goes on from where it was, token for token the reference's, without
    spending a move (the client allows none) and loading what it had generated."""
    s = spec(tiny_dirs["llama"], tmp_path / "kv", num_decode=1, cache_bytes=256 << 10, scheduling_policy="priority")
    with LocalCluster(s, run_dir=str(tmp_path / "run")) as c:
        client = ClusterClient(c.scheduler_address, timeout=120, migration_limit=0)
        bg_prompt, urgent_prompt = conversation(330, 1)[0], conversation(331, 1)[0]
        bg_params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, priority=5)
        urgent_params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, priority=-1)
        got, ended, results = [], {}, []

        def background():
            for ev in client.start(bg_prompt, bg_params, "bg").events():
                got.extend([ev.token_id] if ev.token_id >= 0 else [])
                results.extend([ev] if ev.finish_reason else [])
            ended["bg"] = time.monotonic()

        th = threading.Thread(target=background)
        th.start()
        deadline = time.monotonic() + 60
        while len(got) < 8 and time.monotonic() < deadline:
            time.sleep(0.005)
        urgent = client.generate(urgent_prompt, urgent_params)
        ended["urgent"] = time.monotonic()
        th.join(timeout=120)
        assert 8 <= len(got) and ended["urgent"] < ended["bg"], (len(got), ended)
        assert urgent.token_ids == reference.generate(urgent_prompt, replace(urgent_params, priority=0))[0].token_ids
        assert got == reference.generate(bg_prompt, replace(bg_params, priority=0))[0].token_ids
        assert results[-1].finish_reason == "length"
        stats = client.stats()
        assert stats["preempted"] == 1 and stats["failed"] == 0
        assert results[-1].num_cached_tokens >= len(bg_prompt) // BS * BS  # (its usage: loaded of the prompt)
        client.close()


def test_corrupt_or_missing_blocks_are_recomputed_and_counted(cluster, reference, tiny_dirs):
    c, client, kv = cluster
    ckpt = open_checkpoint(tiny_dirs["llama"])
    fp = model_fingerprint(ckpt.config, "float32", BS, ckpt.weights_digest)
    for mode, damage in (("pe", "corrupt"), ("de", "missing")):
        prompt, appends = conversation(200 + len(damage), 2)
        first = client.generate(prompt, GREEDY, mode=mode)
        prompt2 = prompt + first.token_ids + appends[0]
        hashes = block_hashes(prompt2, fp, BS)
        victim = kv / fp.hex() / hashes[1].hex()[:2] / f"{hashes[1].hex()}.kv"
        if damage == "corrupt":
            data = bytearray(victim.read_bytes())
            data[-10] ^= 0xFF
            victim.write_bytes(bytes(data))
        else:
            victim.unlink()
        failures = client.stats()["kv_load_failures"]
        got = client.generate(prompt2, GREEDY, mode=mode)
        assert got.token_ids == reference.generate(prompt2, GREEDY)[0].token_ids
        assert got.num_cached_tokens == BS  # only block 0 came from storage
        deadline = time.monotonic() + 5  # the prefill engine counts it in its next pull's report (20 ms)
        while client.stats()["kv_load_failures"] <= failures and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.stats()["kv_load_failures"] > failures


def test_corrupt_blocks_are_stored_again_so_their_hit_comes_back(cluster, reference, tiny_dirs):
    """Damaged block files fail closed (the tokens are recomputed, the reply is the reference's) and are removed by
    the engine that found them, so the decode engine's write of the recomputed blocks stores them again: the next
    turn hits them as it did before the damage (a store that kept a damaged file would skip that write, and every
    later turn would recompute the blocks)."""
    _, client, kv = cluster
    ckpt = open_checkpoint(tiny_dirs["llama"])
    fp = model_fingerprint(ckpt.config, "float32", BS, ckpt.weights_digest)
    removed = client.stats()["kv_corrupt_removed"]
    for seed, mode, damage in ((212, "pe", "flip"), (213, "de", "truncate")):
        prompt = conversation(seed, 1)[0] + list(range(3, 23))  # 62, 63 tokens: 3 full blocks
        want = reference.generate(prompt, GREEDY)[0].token_ids
        client.generate(prompt, GREEDY, mode=mode)  # computes and stores the prompt's blocks
        before = client.generate(prompt, GREEDY, mode=mode)
        assert before.token_ids == want and before.num_cached_tokens >= 3 * BS, mode
        for h in block_hashes(prompt, fp, BS)[: before.num_cached_tokens // BS]:
            victim = kv / fp.hex() / h.hex()[:2] / f"{h.hex()}.kv"
            data = victim.read_bytes()
            if damage == "flip":
                victim.write_bytes(data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:])  # the last layer's bytes
            else:
                victim.write_bytes(data[: len(data) // 2])
        damaged = client.generate(prompt, GREEDY, mode=mode)
        assert damaged.token_ids == want and damaged.num_cached_tokens == 0, mode  # every block failed closed
        repaired = client.generate(prompt, GREEDY, mode=mode)
        assert repaired.token_ids == want, mode
        assert repaired.num_cached_tokens == before.num_cached_tokens, mode  # stored again by the damaged turn
    deadline = time.monotonic() + 5  # the removals are counted in the engines' next reports (scheduler /metrics)
    while client.stats()["kv_corrupt_removed"] < removed + 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.stats()["kv_corrupt_removed"] >= removed + 6  # 3 blocks damaged per path


LONG = dict(max_tokens=300, ignore_eos=True)  # still going when an engine is killed
# The sampled cases keep few candidates: a batch's rounding moves the logits in their last bits, and a draw that
# close to a step of the distribution takes the neighbouring token (``dualpath.engines.sampler.sample``): over the whole
# vocabulary, about one reply in four here when a decode engine's batch changes under it.
MOVING = [
    SamplingParams(temperature=0, **LONG),
    SamplingParams(temperature=1.0, seed=11, n=2, top_k=4, **LONG),
    SamplingParams(temperature=0.9, seed=4, frequency_penalty=0.6, top_k=8, **LONG),
    SamplingParams(temperature=0, repetition_penalty=1.2, **LONG),
]


def stream_choices(client, prompt, params, streaming: threading.Semaphore, outcomes: list) -> None:
    """One request's choices (tokens, finish reason) into ``outcomes``, or the error it raised; ``streaming`` is
    released once its fifth token arrived."""
    tokens, reasons = [[] for _ in range(params.n)], [""] * params.n
    try:
        for ev in client.stream(prompt, params):
            if ev.token_id >= 0:
                tokens[ev.index].append(ev.token_id)
                if sum(map(len, tokens)) == 5:
                    streaming.release()
            reasons[ev.index] = reasons[ev.index] or ev.finish_reason
        outcomes.append((prompt, params, list(zip(tokens, reasons))))
    except Exception as e:  # noqa: BLE001
        outcomes.append((prompt, params, e))


def replies_while(client, cases, streaming, stop_engine) -> tuple[list, float]:
    """Stream each (prompt, params) of ``cases`` at once; once each has tokens, ``stop_engine()``; the outcomes and
    how long after the stop they all ended."""
    outcomes = []
    threads = [
        threading.Thread(target=stream_choices, args=(client, prompt, params, streaming, outcomes))
        for prompt, params in cases
    ]
    for t in threads:
        t.start()
    for _ in threads:  # every request is generating
        assert streaming.acquire(timeout=60)
    stop_engine()
    stopped = time.monotonic()
    for t in threads:
        t.join(240)
    assert not any(t.is_alive() for t in threads), "a request hung"
    return outcomes, time.monotonic() - stopped


def assert_as_the_reference(reference, outcomes) -> None:
    for prompt, params, got in outcomes:
        assert not isinstance(got, Exception), got
        with REFERENCE_LOCK:
            want = [(o.token_ids, o.finish_reason) for o in reference.generate(prompt, params)]
        assert got == want, params


@pytest.mark.slow  # (the default run stays under 10 minutes)
def test_replies_move_off_a_killed_or_stopped_decode_engine_and_come_out_the_same(tiny_dirs, tmp_path, reference):
    """Four long replies (greedy; seeded with two choices; with penalties) streaming when a decode engine is
    killed: those on it move to the other one and go on from the tokens already delivered (request migration),
    and every choice equals the one-process reference's; the moved replies' context was loaded from what the dead
    engine had stored (the prompts were never sent before, so every hit is theirs). The scheduler counts the engine
    gone as soon as a broken stream is reported and its health check fails, long before its heartbeats lapse (30 s
    here). Then a rolling restart: a replacement decode engine joins and the other one is stopped (SIGTERM) under
    load: it stores what it has, says it is leaving and hands its replies back, which go on on the replacement,
    the same again; it exits cleanly. Last, with migrations off, a reply fails naming its engine when that engine
    is killed."""
    with LocalCluster(
        spec(tiny_dirs["llama"], tmp_path / "kv", heartbeat_timeout_s=30.0), run_dir=str(tmp_path / "run")
    ) as c:
        moved: list[str] = []
        client = ClusterClient(c.scheduler_address, timeout=60, on_migration=moved.append)
        streaming = threading.Semaphore(0)
        cases = [(conversation(300 + i, 1)[0], p) for i, p in enumerate(MOVING)]

        def kill_once_prompts_are_stored():  # (a loaded machine may not have reported its writes yet)
            blocks = sum(len(prompt) // BS for prompt, _ in cases)
            deadline = time.monotonic() + 20
            while client.stats()["index_blocks"] < blocks and time.monotonic() < deadline:
                time.sleep(0.02)
            c.kill("decode-0")

        outcomes, took = replies_while(client, cases, streaming, kill_once_prompts_are_stored)
        assert moved, "no reply was on the killed engine"
        assert client.stats()["engines_alive_by_role"]["decode"] == 1 and took < 25
        pid = c.child("decode-0").proc.pid  # what it could not unlink itself went with it
        assert not [n for n in os.listdir(SHM_DIR) if n.startswith(f"{SEGMENT_PREFIX}{pid}-")]
        assert_as_the_reference(reference, outcomes)
        assert client.stats()["hit_tokens"] > 0

        replacement = c.add_engine("decode")
        moved.clear()
        cases = [(conversation(320 + i, 1)[0], p) for i, p in enumerate(MOVING[:3])]
        outcomes, took = replies_while(client, cases, streaming, lambda: c.kill("decode-1", signal.SIGTERM))
        assert moved and took < 25 and c.child("decode-1").proc.returncode == 0
        assert client.stats()["engines_alive_by_role"]["decode"] == 1
        assert "handed back to their submitters" in (tmp_path / "run" / "decode-1.log").read_text()
        assert_as_the_reference(reference, outcomes)
        client.close()

        strict = ClusterClient(c.scheduler_address, timeout=60, migration_limit=0)
        outcomes, _ = replies_while(
            strict, [(conversation(400, 1)[0], MOVING[0])], streaming, lambda: c.kill(replacement)
        )
        assert "decode engine" in str(outcomes[0][2]), outcomes
        strict.close()


@pytest.mark.slow  # (the default run stays under 10 minutes)
def test_replies_outlive_a_scheduler_restart(tiny_dirs, tmp_path, reference):
    """The scheduler killed while replies stream, then started again on its port: the replies go on (tokens flow
    from the decode engines, never through the scheduler) and equal the reference; a request sent while it is down
    is submitted again once it answers, and served; the engines register again keeping their work; and the new
    scheduler's index, listed from storage, finds an earlier turn's blocks."""
    with LocalCluster(spec(tiny_dirs["llama"], tmp_path / "kv"), run_dir=str(tmp_path / "run")) as c:
        client = ClusterClient(c.scheduler_address, timeout=60, reconnect_s=60)
        prompt, appends = conversation(600, 2)
        first = client.generate(prompt, GREEDY)
        streaming, late = threading.Semaphore(0), []
        cases = [(conversation(610 + i, 1)[0], p) for i, p in enumerate(MOVING[:2])]

        def restart():
            c.child("scheduler").proc.kill()
            c.child("scheduler").proc.wait(10)
            sent = threading.Thread(
                target=stream_choices, args=(client, conversation(620, 1)[0], GREEDY, threading.Semaphore(0), late)
            )
            sent.start()  # while there is no scheduler
            time.sleep(1.0)
            c.restart_scheduler()
            sent.join(120)

        outcomes, _ = replies_while(client, cases, streaming, restart)
        assert_as_the_reference(reference, outcomes + late)
        assert client.stats()["engines_alive"] == 3
        logs = "".join((tmp_path / "run" / f"{n}.log").read_text() for n in ("prefill-0", "decode-0", "decode-1"))
        assert "keeping its work" in logs and "dropping" not in logs
        later = prompt + first.token_ids + appends[0]
        hits = client.stats()["hit_tokens"]
        got = client.generate(later, GREEDY)
        assert got.token_ids == reference.generate(later, GREEDY)[0].token_ids
        # found at submission (whether the scheduler then loads or recomputes them is the read rate's call)
        assert client.stats()["hit_tokens"] - hits >= BS
        client.close()


@pytest.mark.slow  # (the default run stays under 10 minutes)
def test_a_killed_prefill_engine_has_its_requests_retried(tiny_dirs, tmp_path, reference):
    # slow storage reads on the prefill nodes keep requests in flight there when one is killed
    # least-loaded over all prefill engines spreads the requests, so the killed one surely holds some
    s = spec(
        tiny_dirs["llama"],
        tmp_path / "kv",
        num_prefill=2,
        num_decode=1,
        heartbeat_timeout_s=2.0,
        storage_read_bps=50_000.0,
        policy="least-loaded",
        load_every_hit=True,
    )
    with LocalCluster(s, run_dir=str(tmp_path / "run")) as c:
        client = ClusterClient(c.scheduler_address, timeout=120)
        prompts = []
        for i in range(6):
            prompt, appends = conversation(500 + i, 1)
            first = client.generate(prompt, GREEDY, mode="pe")
            prompts.append(prompt + first.token_ids + appends[0])
        results = generate_during(client, prompts, GREEDY, lambda: c.kill("prefill-0"), after_s=0.5, mode="pe")
        for i, got in enumerate(results):
            assert got.token_ids == reference.generate(prompts[i], GREEDY)[0].token_ids
        stats = client.stats()
        assert stats["retried"] >= 1
        # the survivor read its stored prefixes and those handed on from the dead engine for seconds: the
        # scheduler's alpha for its node is now their drain rate, the cap's (its engines' reports, real reads)
        node = stats["engines"]["prefill-1"]["node"]
        config = open_checkpoint(tiny_dirs["llama"]).config
        cap_alpha = 3 * 50_000 / (config.num_layers * config.kv_elems_per_token * 4)
        assert stats["node_alpha_measured"][node], stats
        assert 0.7 * cap_alpha < stats["node_alpha_tokens"][node] < 1.3 * cap_alpha, (stats, cap_alpha)
        client.close()


@pytest.mark.slow  # (the default run stays under 10 minutes)
def test_a_slow_store_is_recomputed_past_not_waited_for(tiny_dirs, tmp_path, reference):
    """Reads capped at 2 KB/s: a turn's stored prefix would take ~20 s to load, its recompute milliseconds. The
    scheduler recomputes it (``recomputed_hit_tokens``; Dynamo #6101: a 40 s disk-tier load for a 0.9 s recompute)
    and the answer is the reference's."""
    s = spec(tiny_dirs["llama"], tmp_path / "kv", num_prefill=1, num_decode=1, storage_read_bps=2_000.0)
    with LocalCluster(s, run_dir=str(tmp_path / "run")) as c:
        client = ClusterClient(c.scheduler_address, timeout=120)
        firsts = [conversation(700 + i, 1) for i in range(3)]  # the scheduler learns the PE's prefill rate
        replies = [client.generate(prompt, GREEDY) for prompt, _ in firsts]
        prompt = firsts[0][0] + replies[0].token_ids + firsts[0][1][0]
        t = time.monotonic()
        got = client.generate(prompt, GREEDY)
        took = time.monotonic() - t
        assert got.token_ids == reference.generate(prompt, GREEDY)[0].token_ids
        stats = client.stats()
        config = open_checkpoint(tiny_dirs["llama"]).config
        load_s = stats["recomputed_hit_tokens"] * config.num_layers * config.kv_elems_per_token * 4 / 2_000.0
        assert stats["recomputed_hit_tokens"] >= 2 * BS and load_s > 10 and took < load_s / 4, (stats, took)
        (rate,) = [
            float(ln.split()[-1])
            for ln in render(stats).splitlines()
            if ln.startswith("dualpath_engine_prefill_tokens_per_second{")
        ]
        assert rate > 100  # the tiny model on CPU: thousands of tokens a second
        client.close()


@pytest.mark.slow  # (the default run stays under 10 minutes)
def test_chunked_prefill_and_split_reads_match_the_reference(tiny_dirs, tmp_path, reference):
    # 10 ms per new token against a 300 ms quota: prompts of ~100 tokens prefill in chunks of at most 30
    s = spec(tiny_dirs["llama"], tmp_path / "kv", num_decode=1, cost_model="0,0.01,0")
    with LocalCluster(s, run_dir=str(tmp_path / "run")) as c:
        client = ClusterClient(c.scheduler_address, timeout=120)
        for i, mode in enumerate(["pe", "de", "split"]):
            results = run_conversation(client, reference, seed=600 + i, turns=3, mode=mode)
            for prompt, got, want in results:
                assert got.token_ids == want, mode
            if mode == "split":
                assert "split" in {got.path for _, got, _ in results[1:]}
        client.close()


@pytest.mark.slow  # ~9 s, a cluster of its own; the fp8 cache's math and blocks are test_kv_fp8's
def test_an_fp8_kv_cluster_stores_quarter_blocks_and_matches_its_reference(tiny_dirs, tmp_path):
    """``--kv-cache-dtype fp8`` on every engine: e4m3 blocks in device memory, buffers, transfers and files (a
    quarter of float32's bytes, under their own fingerprint), and every turn, its prefix loaded by either path,
    equals the single-process reference on an fp8 cache."""
    from dualpath.traffic.storage.fs import header_bytes

    s = spec(tiny_dirs["llama"], tmp_path / "kv", num_decode=1, kv_cache_dtype="fp8", cost_model="0,0.01,0")
    fp8_reference = LLM(str(tiny_dirs["llama"]), block_size=BS, kv_cache_dtype="fp8")
    with LocalCluster(s, run_dir=str(tmp_path / "run")) as c:
        client = ClusterClient(c.scheduler_address, timeout=120)
        for i, mode in enumerate(["pe", "de", "split"]):
            results = run_conversation(client, fp8_reference, seed=700 + i, turns=3, mode=mode)
            for turn, (prompt, got, want) in enumerate(results):
                assert got.token_ids == want, (mode, turn)
                assert turn == 0 or got.num_cached_tokens >= BS
        client.close()
    ckpt = open_checkpoint(tiny_dirs["llama"])
    fp = model_fingerprint(ckpt.config, "float32", BS, ckpt.weights_digest, "float8_e4m3fn")
    files = list((tmp_path / "kv" / fp.hex()).rglob("*.kv"))
    geometry = fp8_reference.geometry
    assert files and geometry.token_bytes == ckpt.config.kv_elems_per_token
    assert {f.stat().st_size for f in files} == {header_bytes(geometry) + geometry.full_block_bytes}
    assert not (tmp_path / "kv" / model_fingerprint(ckpt.config, "float32", BS, ckpt.weights_digest).hex()).exists()


@pytest.mark.slow  # (the default run stays under 10 minutes)
def test_prompts_beyond_the_buffers_wait_for_room_and_choices_fork(tiny_dirs, tmp_path, reference):
    """Engines whose DRAM buffers hold 40 blocks, four concurrent 16-block prompts on each path: requests wait for
    buffer room (they used to fail after three refused attempts), and for one of the decode batch's 2 rows; a
    request's three choices fork on the decode engine and equal three seeded requests of the single-process
    reference."""
    g_bytes = 40 * 12288  # the tiny Llama's Full Block at block size 16 is 12,288 bytes
    s = spec(
        tiny_dirs["llama"],
        tmp_path / "kv",
        num_decode=1,
        buffer_bytes=g_bytes,
        extra_engine_args=("--max-num-seqs", "2"),
    )  # and a decode batch of 2 rows: the rest wait for one
    with LocalCluster(s, run_dir=str(tmp_path / "run")) as c:
        client = ClusterClient(c.scheduler_address, timeout=120)
        prompts = [[(7 * i + 3 * k) % 250 + 3 for k in range(250)] for i in range(8)]
        got, errors = {}, []

        def one(i):
            try:
                got[i] = client.generate(prompts[i], GREEDY, mode="pe" if i % 2 else "de").token_ids
            except Exception as e:  # noqa: BLE001 - collected for the assertion
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        want = reference.generate(prompts, GREEDY)
        assert [got[i] for i in range(8)] == [w.token_ids for w in want]
        sampled = SamplingParams(temperature=1.0, max_tokens=8, seed=3, n=3)
        choices = client.generate_choices(prompts[0][:37], sampled)
        want = [
            reference.generate(prompts[0][:37], SamplingParams(temperature=1.0, max_tokens=8, seed=3 + i))[0]
            for i in range(3)
        ]
        assert [r.token_ids for r in choices] == [w.token_ids for w in want] and [r.index for r in choices] == [0, 1, 2]
        stop = want[1].text[2:4]  # stop strings end a choice on the decode engine, the others run on
        stopping = SamplingParams(temperature=1.0, max_tokens=8, seed=3, n=3, stop=(stop,))
        want = [reference.generate(prompts[0][:37], replace(stopping, n=1, seed=3 + i))[0] for i in range(3)]
        choices = client.generate_choices(prompts[0][:37], stopping)
        assert [(r.token_ids, r.finish_reason) for r in choices] == [(w.token_ids, w.finish_reason) for w in want]
        assert want[1].finish_reason == "stop" and len(want[1].token_ids) < 8
        handle = client.start(prompts[1], SamplingParams(temperature=1.0, max_tokens=300, n=3, ignore_eos=True))
        events = handle.events()
        assert {next(events).index for _ in range(9)} == {0, 1, 2}
        handle.cancel()  # every choice's blocks (and the shared prompt's) come back
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            (de,) = [e for e in client.stats()["engines"].values() if e["role"] == "decode"]
            if de["requests"] == 0 and de["free_tokens"] == de["capacity_tokens"]:
                break
            time.sleep(0.2)
        assert de["requests"] == 0 and de["free_tokens"] == de["capacity_tokens"], de
        client.close()


@pytest.mark.slow  # ~40 s of engines in the Triton interpreter; the kernels' own tests run by default
def test_engines_on_the_triton_kernels_match_the_reference(tiny_dirs, tmp_path, reference):
    """Prefill attention over the workspace, decode over the paged cache and the KV scatter on admission all run
    as Triton kernels (the interpreter on CPU); chunked prefill makes prefill batches with cached parts."""
    pytest.importorskip("triton")
    s = spec(tiny_dirs["llama"], tmp_path / "kv", num_decode=1, cost_model="0,0.01,0", kernels="triton")
    with LocalCluster(s, run_dir=str(tmp_path / "run")) as c:
        client = ClusterClient(c.scheduler_address, timeout=120)
        for i, mode in enumerate(["pe", "de"]):
            for prompt, got, want in run_conversation(client, reference, seed=700 + i, turns=2, mode=mode):
                assert got.token_ids == want, mode
        client.close()


@pytest.mark.slow  # (the default run stays under 10 minutes)
def test_engine_groups_pull_through_their_leader_and_survive_it(tiny_dirs, tmp_path, reference):
    s = spec(
        tiny_dirs["llama"], tmp_path / "kv", num_prefill=2, num_decode=2, engines_per_node=2, heartbeat_timeout_s=2.0
    )
    with LocalCluster(s, run_dir=str(tmp_path / "run")) as c:
        client = ClusterClient(c.scheduler_address, timeout=120)
        import time

        time.sleep(0.5)  # members that registered first led alone until they learned of the others
        before = client.stats()["pulls_by_sender"]
        for mode in ("pe", "de"):
            for prompt, got, want in run_conversation(client, reference, seed=700, turns=2, mode=mode):
                assert got.token_ids == want
        after = client.stats()["pulls_by_sender"]
        pulled = {e for e in after if after[e] > before.get(e, 0)}
        assert pulled == {"prefill-0", "decode-0"}  # only the leaders pull
        c.kill("prefill-0")  # the prefill group's leader
        for prompt, got, want in run_conversation(client, reference, seed=701, turns=2, mode="pe"):
            assert got.token_ids == want
        assert client.stats()["pulls_by_sender"].get("prefill-1", 0) > 0  # the next member leads
        client.close()


@pytest.mark.slow  # (the default run stays under 10 minutes)
def test_engines_declared_gone_after_a_pause_rejoin_and_serve(tiny_dirs, tmp_path, reference):
    """A paused process (SIGSTOP; in production a swap storm or a long GC) misses its heartbeats and is declared
    gone; when it resumes it registers again instead of idling unseen. Both ways back: a group member, told by
    its leader, and the leader, told by the scheduler."""
    s = spec(
        tiny_dirs["llama"], tmp_path / "kv", num_prefill=2, num_decode=1, engines_per_node=2, heartbeat_timeout_s=2.0
    )
    with LocalCluster(s, run_dir=str(tmp_path / "run")) as c:
        client = ClusterClient(c.scheduler_address, timeout=120)
        for name, seed in (("prefill-1", 710), ("prefill-0", 720)):
            proc = c.child(name).proc
            proc.send_signal(signal.SIGSTOP)
            deadline = time.monotonic() + 30
            while client.stats()["engines_alive_by_role"].get("prefill") == 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            # (with the leader paused its member goes quiet too: its pushes wait out their timeout)
            assert client.stats()["engines_alive_by_role"]["prefill"] < 2, f"{name} was never declared gone"
            proc.send_signal(signal.SIGCONT)
            while client.stats()["engines_alive_by_role"]["prefill"] < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert client.stats()["engines_alive_by_role"]["prefill"] == 2, f"{name} did not rejoin"
            for prompt, got, want in run_conversation(client, reference, seed=seed, turns=2, mode="pe"):
                assert got.token_ids == want
        logs = {n: (tmp_path / "run" / f"{n}.log").read_text() for n in ("prefill-0", "prefill-1")}
        assert all("registering again" in text for text in logs.values())
        client.close()
