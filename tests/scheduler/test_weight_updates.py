"""New weights for a running model (an RL trainer's next policy): in place in one process, through the scheduler's
pause / drain / load / resume, and across a real cluster, where no block computed by the old weights may hit."""

import asyncio
import hashlib
import json
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from dualpath import LLM, SamplingParams
from dualpath.checkpoints.tiny import build_tiny_checkpoint
from dualpath.client import ClusterClient
from dualpath.core.errors import CheckpointError
from dualpath.core.geometry import block_hashes
from dualpath.launcher import ClusterSpec, LocalCluster
from dualpath.core.messages import Role, SubmitRequest, WeightUpdate, WeightUpdateReply, pack_keys, pack_tokens
from dualpath.serving.openai_api import Frontend, FrontendConfig
from dualpath.engines.models import open_checkpoint
from dualpath.scheduler.core import SchedulerCore, request_of
from dualpath.scheduler.http import render
from dualpath.scheduler.weights import update_weights
from test_scheduler_core import BS, Clock, info, make_core, pull

GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPT = [(i * 11) % 250 + 3 for i in range(50)]
ADMIN = {"Authorization": "Bearer admin"}  # the admin key of the HTTP tests' frontends (their admin routes are on)


@pytest.fixture(scope="module")
def second(tiny_dirs, tmp_path_factory):
    """Checkpoints with the tiny ones' configs and other values (seed 2)."""
    root = tmp_path_factory.mktemp("seed2")
    return {a: build_tiny_checkpoint(root / a, a, seed=2) for a in ("llama", "deepseek_v3")}


def one_file(path):
    files = sorted(path.glob("*.safetensors"))
    assert len(files) == 1
    return files[0]


# --- in one process ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_reloaded_weights_equal_a_fresh_load_and_keep_their_storage(tiny_dirs, second, arch):
    llm, fresh = LLM(str(tiny_dirs[arch]), block_size=BS), LLM(str(second[arch]), block_size=BS)
    before = llm.logits(PROMPT)
    storage = [p.data_ptr() for p in llm.model.parameters()]  # what captured CUDA graphs point at
    digest = llm.update_weights(str(second[arch]))
    assert torch.equal(llm.logits(PROMPT), fresh.logits(PROMPT))
    assert not torch.allclose(before, fresh.logits(PROMPT))
    assert [p.data_ptr() for p in llm.model.parameters()] == storage
    assert len(digest) == 64 and digest != llm.update_weights(str(tiny_dirs[arch]))
    assert torch.equal(llm.logits(PROMPT), before)


def test_the_digest_follows_every_byte(tiny_dirs, tmp_path):
    """Equal for the same bytes in another directory; different when one value deep inside a tensor changes
    (the start-up digest samples a few ranges of each file and cannot promise that)."""
    llm = LLM(str(tiny_dirs["llama"]), block_size=BS)
    copy = shutil.copytree(tiny_dirs["llama"], tmp_path / "copy")
    first = llm.update_weights(str(tiny_dirs["llama"]))
    assert llm.update_weights(str(copy)) == first
    tensors = load_file(one_file(copy))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][3, 5] += 1.0
    save_file(tensors, one_file(copy), metadata={"format": "pt"})
    assert llm.update_weights(str(copy)) != first


def test_a_checkpoint_of_another_model_is_refused_before_anything_changes(tiny_dirs, second, tmp_path):
    llm = LLM(str(tiny_dirs["llama"]), block_size=BS)
    before = llm.logits(PROMPT)
    other = build_tiny_checkpoint(tmp_path / "wide", "llama", seed=2, hidden_size=32)
    with pytest.raises(CheckpointError, match="config differs in hidden_size"):
        llm.update_weights(str(other))
    short = shutil.copytree(second["llama"], tmp_path / "short")
    tensors = load_file(one_file(short))
    del tensors["model.layers.1.self_attn.o_proj.weight"]  # the last layer's: every earlier tensor would copy first
    save_file(tensors, one_file(short), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing tensor model.layers.1.self_attn.o_proj.weight"):
        llm.update_weights(str(short))
    with pytest.raises(CheckpointError, match="no config.json"):
        llm.update_weights(str(tmp_path / "nowhere"))
    assert torch.equal(llm.logits(PROMPT), before)


# --- the scheduler's bookkeeping --------------------------------------------------------------------------------
def submit(core, rid, n=100, **kw):
    events = core.submit(SubmitRequest(rid, pack_tokens(range(n)), SamplingParams(max_tokens=8).to_dict(), **kw))
    return events


def assigned(core, rid):
    r = core.requests.get(rid)
    return r is not None and (r.pe is not None or r.de is not None)


def pull_all(core, engines, times=2):
    for _ in range(times):
        for g in ["p0", "p1", "d0", "d1", "d2"]:
            pull(core, engines, g)


def work_ids(rid: str, ids) -> list[str]:
    """The work ids among ``ids`` of request ``rid``'s attempts (``rid.attempt.nonce``)."""
    return [w for w in ids if request_of(w) == rid]


def finish(engines, rid):
    for e in engines.values():
        w = next(iter(work_ids(rid, e.held)), None)
        if w is not None:
            del e.held[w]
            if e.info.role is Role.DECODE:
                e.finished = [w]


def test_a_paused_scheduler_queues_new_requests_and_lets_assigned_ones_finish():
    core, engines = make_core("dualpath", Clock())
    submit(core, "r0")
    pull_all(core, engines)
    assert core.requests["r0"].pe and core.requests["r0"].de
    submit(core, "r1")
    pull(core, engines, "p0")  # routed to a decode group's queue, not yet to an engine
    assert core.requests["r1"].group is not None and not assigned(core, "r1")
    assert core.pause() == 0
    submit(core, "r2")  # accepted while paused: it waits
    pull_all(core, engines, times=3)
    assert not assigned(core, "r1") and not assigned(core, "r2") and not core.drained()
    finish(engines, "r0")
    pull_all(core, engines)
    assert "r0" not in core.requests and core.drained() and not assigned(core, "r1")
    core.resume()
    pull_all(core, engines)
    assert assigned(core, "r1") and assigned(core, "r2")


def test_abort_requeues_requests_not_generating_and_ends_those_generating():
    core, engines = make_core("dualpath", Clock())
    streaming, waiting = submit(core, "gen"), submit(core, "wait")
    pull_all(core, engines)
    assert core.requests["gen"].streaming  # its decode engine reported it started
    core.requests["wait"].streaming = False  # (as if its prefill still ran)
    de = core.requests["wait"].de
    assert core.pause(abort=True) == 1
    last = list(streaming.queue)[-1]
    assert last.kind == "failed" and "weights are being updated" in last.error and last.aborted
    assert "gen" not in core.requests
    r = core.requests["wait"]
    assert r.attempt == 1 and r.pe is None and "wait" in core.global_queue
    assert work_ids("wait", core.cancelled_for[de]) and not core.drained()  # until the engines are told
    pull_all(core, engines, times=1)
    assert core.drained() and not assigned(core, "wait")
    assert "failed" not in [e.kind for e in waiting.queue]  # it runs again once the update is done


def test_a_held_scheduler_outlasts_a_weight_update_and_goes_on_when_released():
    core, engines = make_core("dualpath", Clock())
    submit(core, "r0")
    pull_all(core, engines)
    assert core.hold() == 0 and core.stats()["held"]
    submit(core, "r1")
    pull_all(core, engines, times=3)
    assert assigned(core, "r0") and not assigned(core, "r1")  # what was on engines goes on
    finish(engines, "r0")
    pull_all(core, engines)
    assert core.drained()
    core.pause()
    core.resume(b"\x07" * 16, "step-2", loaded=list(engines), path="/ckpt/step-2")  # an update meanwhile
    pull_all(core, engines, times=3)
    assert not assigned(core, "r1") and core.stats()["weights_path"] == "/ckpt/step-2"
    assert 'dualpath_scheduler_generation_paused{why="pause"} 1' in render(core.stats())
    core.release()
    pull_all(core, engines)
    assert assigned(core, "r1") and not core.stats()["held"]
    assert 'dualpath_scheduler_generation_paused{why="pause"} 0' in render(core.stats())


def test_abort_matches_labels_or_ends_every_request():
    core, engines = make_core("dualpath", Clock())
    a, b = submit(core, "r0", label="rollout-1"), submit(core, "r1", label="rollout-2")
    submit(core, "r2", label="rollout-2")
    pull_all(core, engines)
    assert core.abort("nobody") == 0 and core.abort("rollout-1") == 1
    assert list(a.queue)[-1].aborted and set(core.requests) == {"r1", "r2"}
    assert core.abort(None) == 2 and not core.requests and list(b.queue)[-1].aborted


def test_a_hold_lets_requests_sent_before_it_run_even_those_still_queued():
    core, engines = make_core("dualpath", Clock())
    submit(core, "early")  # queued: no engine has pulled it yet
    core.hold()
    submit(core, "late")
    assert not core.hold_drained()
    pull_all(core, engines)
    assert assigned(core, "early") and not assigned(core, "late")
    finish(engines, "early")
    pull_all(core, engines)
    assert "early" not in core.requests and core.hold_drained() and not assigned(core, "late")
    core.hold()  # again: the first one's line stands
    core.release()
    pull_all(core, engines)
    assert assigned(core, "late")


def test_a_hold_with_abort_ends_every_request_in_flight_queued_or_on_engines():
    core, engines = make_core("dualpath", Clock())
    on_engines, queued = submit(core, "gen"), submit(core, "wait")
    pull_all(core, engines)
    pe, de = core.requests["gen"].pe, core.requests["gen"].de
    core.requests["wait"].pe = core.requests["wait"].de = None  # (as if not yet routed)
    assert core.hold(abort=True) == 2 and not core.requests
    for events in (on_engines, queued):
        last = list(events.queue)[-1]
        assert last.kind == "failed" and last.aborted and "paused" in last.error
    assert work_ids("gen", core.cancelled_for[pe]) and work_ids("gen", core.cancelled_for[de])
    pull_all(core, engines, times=1)
    assert core.drained()
    submit(core, "later")  # accepted while held: it waits for the release
    pull_all(core, engines)
    assert not assigned(core, "later")
    core.release()
    pull_all(core, engines)
    assert assigned(core, "later")


def test_a_flush_empties_the_index_and_removes_the_stored_blocks_only_when_idle():
    core, engines = make_core("dualpath", Clock())
    core.index.add(block_hashes(list(range(100)), core.fingerprint, BS))
    removed = []
    submit(core, "r0")
    assert "1 request(s) in flight" in core.flush(lambda *a: removed.append(a))
    assert not removed and len(core.index) == 6
    core.cancel("r0")
    assert core.flush(lambda *a: removed.append(a)) == ""
    assert removed == [(Path("/nonexistent"), core.fingerprint)] and len(core.index) == 0
    assert core.stats()["cache_flushes"] == 1
    assert submit(core, "r1").get().num_hit_tokens == 0
    core.cancel("r1")
    core.index.add(block_hashes(list(range(100)), core.fingerprint, BS))

    def refused(root, fp):
        raise PermissionError(13, "Permission denied", str(root))

    assert "could not be removed: [Errno 13] Permission denied" in core.flush(refused)
    assert len(core.index) == 6  # what is still stored still hits


def test_new_weights_rehash_queued_requests_and_drop_engines_that_did_not_load():
    core, engines = make_core("dualpath", Clock())
    old, new = core.fingerprint, b"\x07" * 16
    core.index.add(block_hashes(list(range(100)), old, BS))
    submit(core, "r0")
    assert core.requests["r0"].hit_blocks == 6
    core.pause()
    core.resume(new, "step-2", loaded=["p0", "p1", "d0", "d1"])
    r = core.requests["r0"]
    assert r.hashes == pack_keys(block_hashes(list(range(100)), new, BS)) and r.hit_blocks == 0
    assert core.counters["hit_tokens"] == 0
    assert not core.engines["d2"].alive and core.engines["d0"].info.fingerprint == new.hex()
    stats = core.stats()
    assert stats["weights_version"] == "step-2" and stats["fingerprint"] == new.hex() and not stats["paused"]
    assert not core.register(engines["d2"].info).ok  # it still serves the old weights
    assert core.register(replace(info("d2", Role.DECODE, "n4", capacity=1500), fingerprint=new.hex())).ok


def test_the_scheduler_hashes_every_prompt_itself_and_tells_a_stale_submitter():
    """A submitter's hashes are not taken as given unless it is vouched for (one could claim another tenant's
    stored KV for its own tokens, issue 54): they are computed from the tokens, salt and adapter, whatever
    fingerprint is named; ``trust_hashes`` (an in-process caller with synthetic prompts, the simulator) takes them as
    sent, never checked (a ``member``'s are: the next test)."""
    core, _ = make_core("dualpath", Clock())
    core.config = replace(core.config, verify_block_hashes=1.0)  # (trust_hashes is not a member's: never checked)
    fp, tokens = core.fingerprint, list(range(40))
    right = pack_keys(block_hashes(tokens, fp, BS))
    wrong = pack_keys(block_hashes(tokens, b"\x01" * 16, BS))
    events = submit(core, "stale", 40, block_hashes=wrong, fingerprint="01" * 16)
    assert core.requests["stale"].hashes == right
    assert events.get().fingerprint == fp.hex()
    events = submit(core, "current", 40, block_hashes=wrong, fingerprint=fp.hex())
    assert core.requests["current"].hashes == right and events.get().fingerprint == ""
    submit(core, "unnamed", 40, block_hashes=wrong)
    assert core.requests["unnamed"].hashes == right
    core.submit(
        SubmitRequest("vouched", pack_tokens(range(40)), SamplingParams(max_tokens=8).to_dict(), block_hashes=wrong),
        trust_hashes=True,
    )
    assert core.requests["vouched"].hashes == wrong


def vouched(core, rid, tokens, hashes, fingerprint):
    spec = SubmitRequest(
        rid, pack_tokens(tokens), SamplingParams(max_tokens=8).to_dict(), block_hashes=hashes, fingerprint=fingerprint
    )
    core.submit(spec, member=True)
    return core.requests[rid].hashes


def test_a_members_hashes_are_used_a_sampled_share_checked_and_a_mismatch_ends_the_trust():
    """On an authenticated plane the scheduler uses a member's hashes (hashing 2,400 prompts a second would take
    more than a core) and recomputes a ``verify_block_hashes`` share of them. A mismatch (a member's bug) gets the
    request the right hashes, is counted, and has every later prompt hashed here; a stale fingerprint's hashes are
    never used."""
    core, _ = make_core("dualpath", Clock())
    fp, tokens = core.fingerprint, list(range(40))
    right = pack_keys(block_hashes(tokens, fp, BS))
    wrong = pack_keys(block_hashes(tokens, b"\x01" * 16, BS))
    core.config = replace(core.config, verify_block_hashes=0.0)
    assert vouched(core, "a", tokens, wrong, fp.hex()) == wrong and core.counters["hashes_verified"] == 0
    assert vouched(core, "stale", tokens, wrong, "01" * 16) == right
    core.config = replace(core.config, verify_block_hashes=1.0)
    assert vouched(core, "b", tokens, right, fp.hex()) == right
    assert core.counters["hashes_verified"] == 1 and core.counters["hash_mismatches"] == 0
    assert vouched(core, "c", tokens, wrong, fp.hex()) == right and core.counters["hash_mismatches"] == 1
    core.config = replace(core.config, verify_block_hashes=0.0)
    assert vouched(core, "d", tokens, wrong, fp.hex()) == right  # trusted no more
    assert core.counters["hashes_verified"] == 3 and core.counters["hash_mismatches"] == 2
    core, _ = make_core("dualpath", Clock())  # a share is a share: 1/2 checks about half
    core.config = replace(core.config, verify_block_hashes=0.5)
    for i in range(200):
        vouched(core, f"r{i}", tokens, right, fp.hex())
    assert 60 <= core.counters["hashes_verified"] <= 140


def test_the_service_vouches_for_members_of_an_authenticated_plane_only():
    """The gRPC service counts a submitter a ``member`` only when the plane checks every caller's token (otherwise
    anyone who reaches the port is a submitter) and the submitter names the fingerprint its hashes chain from."""
    from dualpath.scheduler.service import SchedulerService

    core, _ = make_core("dualpath", Clock())
    named = SubmitRequest("x", b"", {}, fingerprint=core.fingerprint.hex())
    assert SchedulerService(core, members_authenticated=True)._vouched(named)
    assert not SchedulerService(core, members_authenticated=True)._vouched(replace(named, fingerprint=""))
    assert not SchedulerService(core)._vouched(named)


def test_another_tenants_hashes_sent_with_other_tokens_hit_nothing():
    """The attack of issue 54: tenant A's prompt is stored under its salt; a submitter sends arbitrary tokens with
    A's block hashes. Hashing its own tokens and salt, the scheduler finds no hit, so A's KV is never served."""
    core, _ = make_core("dualpath", Clock())
    secret = list(range(3, 3 + 64))
    theirs = block_hashes(secret, core.fingerprint, BS, salt="tenant-a")
    core.index.add(theirs)
    submit(core, "a", 64, block_hashes=pack_keys(theirs))  # (range(64): not the secret's tokens either)
    probe = SubmitRequest(
        "probe",
        pack_tokens([7] * 64),
        SamplingParams(max_tokens=8).to_dict(),
        block_hashes=pack_keys(theirs),
        fingerprint=core.fingerprint.hex(),
    )
    assert core.submit(probe).get().num_hit_tokens == 0
    owner = SubmitRequest("owner", pack_tokens(secret), SamplingParams(max_tokens=8, cache_salt="tenant-a").to_dict())
    assert core.submit(owner).get().num_hit_tokens == 48  # the last block is always computed


# --- the update's steps (engines as a test double) -------------------------------------------------------------
class FakeEngines:
    """Stands in for the engines' UpdateWeights RPC: records calls, answers by address."""

    def __init__(self, fail_check=(), fail_load=(), fp="ee" * 16):
        self.calls, self.fail_check, self.fail_load, self.fp = [], set(fail_check), set(fail_load), fp

    def __call__(self, address, req, deadline):
        self.calls.append((address, req.check_only))
        eid = address.split(":")[0]
        if req.check_only:
            return WeightUpdateReply(eid not in self.fail_check, "" if eid not in self.fail_check else "no such file")
        if eid in self.fail_load:
            return WeightUpdateReply(False, "disk error halfway")
        return WeightUpdateReply(True, fingerprint=self.fp, version=req.version, engines=1)


def run_update(core, fake, **kw):
    return asyncio.run(update_weights(core, WeightUpdate("/ckpt", "v9", **kw), load_on=fake))


def test_an_update_no_engine_can_take_loads_nothing_and_resumes():
    core, engines = make_core("dualpath", Clock())
    fp, fake = core.fingerprint, FakeEngines(fail_check={"d1"})
    reply = run_update(core, fake)
    assert not reply.ok and reply.error == "d1: no such file" and not reply.fingerprint
    assert all(check for _, check in fake.calls) and len(fake.calls) == 5  # checked everywhere, loaded nowhere
    assert core.fingerprint == fp and not core.paused and all(e.alive for e in core.engines.values())


def test_engines_that_fail_to_load_leave_the_cluster():
    core, engines = make_core("dualpath", Clock())
    reply = run_update(core, FakeEngines(fail_load={"d2", "p1"}))
    assert not reply.ok and reply.fingerprint == "ee" * 16 and reply.engines == 3
    assert reply.error == "d2, p1: disk error halfway"
    assert core.fingerprint.hex() == "ee" * 16 and not core.paused and core.weights_version == "v9"
    assert sorted(eid for eid, e in core.engines.items() if e.alive) == ["d0", "d1", "p0"]


def test_an_adapter_loads_on_every_engine_and_engines_joining_later_are_told():
    """``/v1/load_lora_adapter`` at the scheduler: every live engine at once, nothing paused; remembered only when every
    engine loaded the same bytes, and then listed in every later registration's reply."""
    from dualpath.core.messages import AdapterLoad, AdapterLoadReply
    from dualpath.scheduler.weights import load_adapter

    core, engines = make_core("dualpath", Clock())
    calls = []

    def fake(bad=(), other=()):
        def load_on(address, req, deadline):
            eid = address.split(":")[0]
            calls.append(eid)
            if eid in bad:
                return AdapterLoadReply(False, "no such directory")
            return AdapterLoadReply(True, digest=("b" if eid in other else "a") * 64, engines=1)

        return load_on

    reply = asyncio.run(load_adapter(core, AdapterLoad("/lora/x"), load_on=fake(bad={"d1"})))
    assert not reply.ok and reply.error == "d1: no such directory" and reply.engines == 4 and not core.adapters
    assert sorted(calls) == ["d0", "d1", "d2", "p0", "p1"] and not core.paused
    reply = asyncio.run(load_adapter(core, AdapterLoad("/lora/x"), load_on=fake(other={"p0"})))
    assert not reply.ok and "different bytes" in reply.error and not core.adapters
    reply = asyncio.run(load_adapter(core, AdapterLoad("/lora/x"), load_on=fake()))
    assert reply.ok and reply.digest == "a" * 64 and reply.engines == 5 and core.adapters == ["/lora/x"]
    assert core.stats()["lora_adapters"] == ["/lora/x"]  # dualpath status shows them
    assert core.register(info("d9", Role.DECODE, "n9")).adapters == ["/lora/x"]
    fresh, _ = make_core("dualpath", Clock())  # a restarted scheduler: its engines tell it what they loaded
    fresh.register(replace(info("d8", Role.DECODE, "n8"), adapters=["/lora/y"]))
    assert fresh.register(info("d7", Role.DECODE, "n7")).adapters == ["/lora/y"]


def test_a_restarted_scheduler_learns_the_weights_version_from_its_engines():
    """Engines say at registration which update they last loaded (its checkpoint and version); a scheduler that
    restarted after the update reports them, where it would have said the engines' starting weights."""
    core, engines = make_core("dualpath", Clock())
    run_update(core, FakeEngines())
    restarted = SchedulerCore(core.config, core.policy, Clock())
    for e in core.engines.values():  # the infos as the engines now give them (the update replaced the scheduler's)
        assert e.info.weights_version == "v9" and restarted.register(e.info).ok
    stats = restarted.stats()
    assert (stats["weights_version"], stats["weights_path"], stats["fingerprint"]) == ("v9", "/ckpt", "ee" * 16)
    untouched = SchedulerCore(core.config, core.policy, Clock())
    assert untouched.register(engines["d0"].info).ok and untouched.stats()["weights_version"] == ""


def test_an_update_waits_for_requests_in_flight_until_its_timeout():
    core, engines = make_core("dualpath", Clock())
    submit(core, "r0")
    pull_all(core, engines)
    fake = FakeEngines()
    t = time.monotonic()
    reply = run_update(core, fake, timeout_s=0.3)
    assert time.monotonic() - t >= 0.3 and not reply.ok and "still ran after 0.3 s" in reply.error
    assert fake.calls == [] and not core.paused and assigned(core, "r0")

    async def finish_soon():
        task = asyncio.create_task(update_weights(core, WeightUpdate("/ckpt"), load_on=fake))
        await asyncio.sleep(0.2)
        assert not task.done() and core.paused
        finish(engines, "r0")
        pull_all(core, engines)
        return await asyncio.wait_for(task, 10)

    assert asyncio.run(finish_soon()).ok and len(fake.calls) == 10


# --- a real cluster -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tiny_dirs, tmp_path_factory):
    kv = tmp_path_factory.mktemp("kv")
    spec = ClusterSpec(
        model=str(tiny_dirs["llama"]),
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
    with LocalCluster(spec, run_dir=str(tmp_path_factory.mktemp("run"))) as c:
        client = ClusterClient(c.scheduler_address, timeout=120)
        yield c, client, kv
        client.close()


def test_a_cluster_serves_new_weights_and_no_block_of_the_old_hits(cluster, tiny_dirs, second, tmp_path):
    c, client, kv = cluster
    old, new = LLM(str(tiny_dirs["llama"]), block_size=BS), LLM(str(second["llama"]), block_size=BS)
    first = client.generate(PROMPT, GREEDY)
    assert first.token_ids == old.generate(PROMPT, GREEDY)[0].token_ids
    turn2 = PROMPT + first.token_ids + [5, 6]
    old_dirs = {p.name for p in kv.iterdir()}
    assert client.generate(turn2, GREEDY).num_cached_tokens == 48  # the old weights' blocks are there to hit

    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    handle = client.start(PROMPT, long)  # in flight when the update begins: it finishes on the old weights
    events = handle.events()
    tokens = [next(events).token_id]
    updated = {}
    updater = threading.Thread(
        target=lambda: updated.setdefault("reply", client.update_weights(str(second["llama"]), "step-1"))
    )
    updater.start()
    tokens += [ev.token_id for ev in events if ev.token_id >= 0]
    updater.join(60)
    assert tokens == old.generate(PROMPT, long)[0].token_ids
    reply = updated["reply"]
    assert reply.ok and reply.engines == 3 and reply.version == "step-1", reply

    got = client.generate(turn2, GREEDY)
    assert got.token_ids == new.generate(turn2, GREEDY)[0].token_ids and got.num_cached_tokens == 0
    turn3 = turn2 + got.token_ids + [7]
    again = client.generate(turn3, GREEDY)
    assert again.token_ids == new.generate(turn3, GREEDY)[0].token_ids and again.num_cached_tokens == 64
    deadline = time.monotonic() + 10
    while old_dirs & {p.name for p in kv.iterdir()} and time.monotonic() < deadline:
        time.sleep(0.1)  # the old weights' blocks are removed in the background
    assert not old_dirs & {p.name for p in kv.iterdir()}
    assert client.stats()["weights_version"] == "step-1"

    wide = build_tiny_checkpoint(tmp_path / "wide", "llama", seed=3, hidden_size=32)
    refused = client.update_weights(str(wide), "step-2")
    assert not refused.ok and not refused.fingerprint
    assert refused.error.startswith("decode-0, decode-1, prefill-0: ") and "hidden_size" in refused.error
    assert client.generate(turn3, GREEDY).token_ids == again.token_ids  # still the new weights, all engines
    assert client.stats()["engines_alive"] == 3 and client.stats()["weights_version"] == "step-1"

    c.restart_scheduler()  # it learns what the engines serve from their registrations
    deadline = time.monotonic() + 30
    while client.stats()["engines_alive"] < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    stats = client.stats()
    assert (stats["weights_version"], stats["weights_path"]) == ("step-1", str(second["llama"])), stats
    assert client.generate(turn3, GREEDY).token_ids == again.token_ids


def test_the_http_endpoint_updates_weights_and_reports_the_version(cluster, tiny_dirs, second):
    c, client, _ = cluster
    front = Frontend(
        FrontendConfig(
            "llama",
            str(tiny_dirs["llama"]),
            c.scheduler_address,
            max_model_len=512,
            api_key="k",
            enable_admin_api=True,
            admin_api_key="admin",
            allowed_model_dirs=(str(tiny_dirs["llama"].parent), str(second["llama"].parent)),
        )
    )
    auth, admin = {"Authorization": "Bearer k"}, {"Authorization": "Bearer admin"}
    with TestClient(front.app) as http:
        assert http.post("/update_weights_from_disk", json={"model_path": str(second["llama"])}).status_code == 401
        assert (
            http.post("/update_weights_from_disk", json={"model_path": str(second["llama"])}, headers=auth).status_code
            == 403
        )  # an inference key is no admin key
        bad = http.post("/update_weights_from_disk", json={"model_path": "x", "load_format": "dummy"}, headers=admin)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "load_format"
        elsewhere = http.post("/update_weights_from_disk", json={"model_path": "/no/such/dir"}, headers=admin)
        assert elsewhere.status_code == 400 and "--allowed-model-dirs" in elsewhere.json()["error"]["message"]
        missing = http.post(
            "/update_weights_from_disk", json={"model_path": str(second["llama"].parent / "none")}, headers=admin
        )
        assert missing.status_code == 400 and not missing.json()["success"]
        assert "no config.json" in missing.json()["message"]
        ok = http.post(
            "/update_weights_from_disk",
            json={"model_path": str(tiny_dirs["llama"]), "weight_version": "base-again"},
            headers=admin,
        )
        assert ok.status_code == 200, ok.json()
        assert ok.json()["success"] and ok.json()["engines"] == 3 and ok.json()["weight_version"] == "base-again"
        version = http.get("/get_weight_version", headers=auth).json()
        assert version == {"weight_version": "base-again", "fingerprint": ok.json()["fingerprint"]}
        reference = LLM(str(tiny_dirs["llama"]), block_size=BS)
        answer = http.post(
            "/v1/completions",
            json={"model": "llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
            headers=auth,
        ).json()
        assert answer["choices"][0]["text"] == reference.generate(PROMPT, GREEDY)[0].text
        # an RL rollout's turn through SGLang's /generate: token ids and logprobs of the weights just loaded
        out = http.post(
            "/generate",
            json={
                "input_ids": PROMPT,
                "return_logprob": True,
                "top_logprobs_num": 2,
                "sampling_params": {"max_new_tokens": 8, "temperature": 0},
            },
            headers=auth,
        ).json()
        want = reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, logprobs=2))[0]
        assert out["output_ids"] == want.token_ids
        for (lp, tid, _), top, ref in zip(
            out["meta_info"]["output_token_logprobs"], out["meta_info"]["output_top_logprobs"], want.logprobs
        ):
            assert tid == ref.token_id and abs(lp - ref.logprob) < 1e-4
            assert [t for _, t, _ in top] == [t for t, _ in ref.top]
        scored = http.post(
            "/generate",
            json={
                "input_ids": PROMPT,
                "return_logprob": True,
                "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 1},
            },
            headers=auth,
        ).json()
        ref = reference.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
        got = scored["meta_info"]["input_token_logprobs"]
        assert got[0] == [None, PROMPT[0], None] and [t for _, t, _ in got] == PROMPT
        assert all(abs(g[0] - r.logprob) < 1e-4 for g, r in zip(got[1:], ref[1:]))
    front.client.close()


def sse(lines) -> list[dict]:
    return [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]


def test_abort_request_ends_rollouts_where_they_are_with_what_they_generated(cluster, tiny_dirs):
    """SGLang's ``/abort_request`` (RL trainers end their partial rollouts with it): by rid, a streamed reply ends
    at once with finish reason abort and its tokens so far, the reference's first ones; ``abort_all`` ends every
    request, not streamed ones and OpenAI endpoints' too; nothing is left running. A weight update's
    ``abort_all_requests`` ends a generating reply the same way."""
    c, client, _ = cluster
    front = Frontend(
        FrontendConfig(
            "llama",
            str(tiny_dirs["llama"]),
            c.scheduler_address,
            max_model_len=512,
            enable_admin_api=True,
            admin_api_key="admin",
        )
    )
    n = 512 - len(PROMPT)
    want = (
        LLM(str(tiny_dirs["llama"]), block_size=BS)
        .generate(PROMPT, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
        .token_ids
    )
    long = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    with TestClient(front.app, headers=ADMIN) as http:
        assert http.post("/abort_request", json={}).status_code == 400
        assert http.post("/abort_request", json={"rid": "nobody"}).status_code == 404
        with http.stream(
            "POST", "/generate", json={"input_ids": PROMPT, "rid": "r-1", "stream": True, "sampling_params": long}
        ) as r:
            lines = r.iter_lines()
            first = sse([next(x for x in lines if x.startswith("data: "))])
            assert http.post("/abort_request", json={"rid": "r-1"}).json() == {"aborted": 1}
            events = first + sse(lines)
        last = events[-1]
        assert last["meta_info"]["finish_reason"]["type"] == "abort" and last["meta_info"]["id"] == "r-1"
        assert 0 < len(last["output_ids"]) < n and last["output_ids"] == want[: len(last["output_ids"])]

        got = {}
        batch = threading.Thread(
            target=lambda: got.setdefault(
                "generate", http.post("/generate", json={"input_ids": [PROMPT, PROMPT], "sampling_params": long})
            )
        )
        completion = threading.Thread(
            target=lambda: got.setdefault(
                "completion",
                http.post(
                    "/v1/completions",
                    json={"model": "llama", "prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True},
                ),
            )
        )
        batch.start()
        completion.start()
        deadline = time.monotonic() + 30
        while client.stats()["in_flight"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # some tokens
        assert http.post("/abort_request", json={"abort_all": True}).json() == {"aborted": 3}
        batch.join(30)
        completion.join(30)
        outs = got["generate"].json()
        assert got["generate"].status_code == 200 and len(outs) == 2
        for o in outs:
            assert (
                o["meta_info"]["finish_reason"]["type"] == "abort" and o["output_ids"] == want[: len(o["output_ids"])]
            )
        choice = got["completion"].json()["choices"][0]
        assert choice["finish_reason"] == "abort" and len(choice["text"]) < n
        assert front.in_flight == 0
        deadline = time.monotonic() + 10
        while client.stats()["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.stats()["in_flight"] == 0  # the scheduler and engines dropped them
        assert "dualpath_requests_aborted_total 4" in http.get("/metrics").text

        # a weight update's abort_all_requests (SGLang's) ends a generating reply the same way, not as an error
        update = threading.Thread(
            target=lambda: got.setdefault(
                "update",
                http.post(
                    "/update_weights_from_disk",
                    json={"model_path": str(tiny_dirs["llama"]), "abort_all_requests": True},
                ),
            )
        )
        with http.stream("POST", "/generate", json={"input_ids": PROMPT, "stream": True, "sampling_params": long}) as r:
            lines = r.iter_lines()
            first = sse([next(x for x in lines if x.startswith("data: "))])  # it generates: it is not requeued
            update.start()  # (the scheduler knew before the first token left: the decode engine reported it)
            out = (first + sse(lines))[-1]
        update.join(30)
        assert got["update"].status_code == 200 and got["update"].json()["num_aborted_requests"] == 1
        assert out["meta_info"]["finish_reason"]["type"] == "abort", out
        assert 0 < len(out["output_ids"]) < n and out["output_ids"] == want[: len(out["output_ids"])]
        after = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {**long, "max_new_tokens": 8}})
        assert after.json()["output_ids"] == want[:8]
    front.client.close()


def test_abort_request_ends_requests_sent_through_another_frontend(cluster, tiny_dirs):
    """Frontends behind a load balancer: a trainer's /abort_request reaches one of them, and the scheduler ends the
    requests it names whichever frontend they came through (an OpenAI request by its X-Request-Id), each with the
    tokens it had."""
    c, client, _ = cluster
    cfg = FrontendConfig(
        "llama",
        str(tiny_dirs["llama"]),
        c.scheduler_address,
        max_model_len=512,
        enable_admin_api=True,
        admin_api_key="admin",
    )
    one, two = Frontend(cfg), Frontend(cfg)
    n = 512 - len(PROMPT)
    want = (
        LLM(str(tiny_dirs["llama"]), block_size=BS)
        .generate(PROMPT, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
        .token_ids
    )
    body = {
        "model": "llama",
        "prompt": PROMPT,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    got = {}
    with TestClient(one.app) as a, TestClient(two.app) as b:
        for name, rid in (("by rid", "rollout-7"), ("every", "rollout-8")):
            since = time.perf_counter()
            t = threading.Thread(
                target=lambda: got.setdefault(name, a.post("/v1/completions", json=body, headers={"X-Request-Id": rid}))
            )
            t.start()
            deadline = time.monotonic() + 30
            while one.last_token_at < since and time.monotonic() < deadline:
                time.sleep(0.01)
            ask, who = ({"rid": "rollout-7"}, {}) if name == "by rid" else ({"abort_all": True}, ADMIN)
            assert b.post("/abort_request", json=ask, headers=who).json() == {"aborted": 1}
            t.join(30)
            choice = got[name].json()["choices"][0]
            assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < n
            assert choice["token_ids"] == want[: len(choice["token_ids"])]
        assert "dualpath_requests_aborted_total 2" in b.get("/metrics").text and one.in_flight == 0
    one.client.close()
    two.client.close()


def test_pause_ends_or_waits_for_requests_and_holds_new_ones_until_resume(cluster, tiny_dirs):
    """vLLM's /pause, /resume and /is_paused, SGLang's /pause_generation and /continue_generation: abort ends a
    streamed reply with its tokens so far; a request sent while paused waits, through a weight update, and runs
    after the resume; mode wait returns once the request sent before it finished whole."""
    c, client, _ = cluster
    front = Frontend(
        FrontendConfig(
            "llama",
            str(tiny_dirs["llama"]),
            c.scheduler_address,
            max_model_len=512,
            health_generate_timeout_s=5,
            enable_admin_api=True,
            bind_host="127.0.0.1",
        )
    )
    n = 512 - len(PROMPT)
    reference = LLM(str(tiny_dirs["llama"]), block_size=BS)
    want = reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].token_ids
    long = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    got = {}
    with TestClient(front.app, base_url="http://127.0.0.1") as http:  # no admin key: loopback only
        assert http.post("/pause?mode=keep").status_code == 400
        assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 400
        assert http.get("/is_paused").json() == {"is_paused": False}
        with http.stream("POST", "/generate", json={"input_ids": PROMPT, "stream": True, "sampling_params": long}) as r:
            lines = r.iter_lines()
            first = sse([next(x for x in lines if x.startswith("data: "))])
            paused = http.post("/pause")
            out = (first + sse(lines))[-1]
        assert paused.json() == {"status": "paused", "num_aborted_requests": 1}
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(out["output_ids"]) < n and out["output_ids"] == want[: len(out["output_ids"])]
        assert http.get("/is_paused").json() == {"is_paused": True}
        probe = http.get("/health_generate")
        assert probe.status_code == 503 and "/pause" in probe.json()["error"]

        waiting = threading.Thread(
            target=lambda: got.setdefault(
                "held",
                http.post(
                    "/v1/completions", json={"model": "llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
                ),
            )
        )
        waiting.start()
        update = http.post("/update_weights_from_disk", json={"model_path": str(tiny_dirs["llama"])})
        assert update.status_code == 200 and http.get("/is_paused").json() == {"is_paused": True}
        waiting.join(1.0)
        assert waiting.is_alive() and client.stats()["in_flight"] == 1  # queued, not lost
        assert http.post("/resume").json() == {"status": "resumed"}
        waiting.join(60)
        assert got["held"].json()["choices"][0]["text"] == reference.generate(PROMPT, GREEDY)[0].text

        some = {**long, "max_new_tokens": 24}
        stream = threading.Thread(
            target=lambda: got.setdefault(
                "whole", http.post("/generate", json={"input_ids": PROMPT, "sampling_params": some})
            )
        )
        stream.start()
        deadline = time.monotonic() + 30
        while not client.stats()["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.005)  # the scheduler has it (queued or generating: either way it runs before the pause)
        assert http.post("/pause?mode=wait&timeout=60").json()["num_aborted_requests"] == 0
        assert client.stats()["in_flight"] == 0  # it ended before the pause returned
        stream.join(30)
        assert got["whole"].json()["output_ids"] == want[:24]  # whole
        assert http.post("/continue_generation").json() == {"status": "resumed"}
        assert http.post("/pause_generation").json()["status"] == "paused"  # no body: mode abort
        assert http.post("/resume").json() == {"status": "resumed"}
        assert http.get("/health_generate").status_code == 200
    front.client.close()


def test_flush_cache_makes_the_next_request_compute_its_prompt_whole(cluster, tiny_dirs):
    """SGLang's /flush_cache and vLLM's /reset_prefix_cache: refused while a request runs; then the prompt's blocks
    are gone from the store and the index (the next request loads nothing, answers the same) and are stored again."""
    c, client, kv = cluster
    front = Frontend(
        FrontendConfig(
            "llama",
            str(tiny_dirs["llama"]),
            c.scheduler_address,
            max_model_len=512,
            enable_admin_api=True,
            admin_api_key="admin",
        )
    )
    prompt = [(i * 7) % 250 + 3 for i in range(70)]
    body = {"model": "llama", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    with TestClient(front.app, headers=ADMIN) as http:

        def turn():
            out = http.post("/v1/completions", json=body).json()
            return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]

        text, _ = turn()
        assert turn() == (text, 64)
        assert http.post("/pause").status_code == 200  # a request that waits keeps the flush off
        queued = threading.Thread(target=turn)
        queued.start()
        deadline = time.monotonic() + 10
        while not client.stats()["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.02)
        busy = http.post("/flush_cache")
        assert busy.status_code == 400 and "1 request(s) in flight" in busy.json()["error"]["message"]
        http.post("/resume")
        queued.join(30)
        while client.stats()["in_flight"] and time.monotonic() < deadline + 30:
            time.sleep(0.02)  # its engines' last report may still be on its way
        flushed = http.post("/flush_cache")
        assert flushed.status_code == 200 and flushed.json()["success"], flushed.json()
        assert not (kv / client.stats()["fingerprint"]).exists() and client.stats()["index_blocks"] == 0
        deadline = time.monotonic() + 4  # the engines see their directory gone (fs.DIR_CHECK_S) and count again
        while any(e["storage_used_bytes"] for e in client.stats()["engines"].values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [e["storage_used_bytes"] for e in client.stats()["engines"].values()] == [0] * len(c.engine_addresses)
        assert turn() == (text, 0)  # computed whole, the same answer
        assert turn() == (text, 64)  # stored again
        assert http.post("/reset_prefix_cache").json()["success"] and turn() == (text, 0)
        assert client.stats()["cache_flushes"] == 2
    front.client.close()


def test_the_command_line_pauses_resumes_aborts_and_flushes_a_cluster(cluster, capsys):
    """``dualpath pause|resume|abort|flush-cache --scheduler``: the same through the scheduler, for jobs without a
    frontend (``dualpath rollout``)."""
    from dualpath.cli import main

    c, client, _ = cluster
    sched = ["--scheduler", c.scheduler_address]
    assert main(["pause", *sched, "--timeout", "30"]) == 0 and client.stats()["held"]
    assert main(["flush-cache", *sched]) == 0  # idle, so the store can go
    assert main(["resume", *sched]) == 0 and not client.stats()["held"]
    assert main(["abort", "--all", *sched]) == 0
    assert main(["abort", "--rid", "nobody", *sched]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["paused; 0 requests aborted", "cache flushed", "resumed", "0 requests aborted", "0 requests aborted"]
    assert main(["pause", "--scheduler", "127.0.0.1:1"]) == 1  # no scheduler there: an error, not a hang
    assert "error:" in capsys.readouterr().err


def test_storage_removes_blocks_of_replaced_weights(tmp_path, tiny_dirs):
    from dualpath.core.config import StorageConfig
    from dualpath.core.geometry import KVGeometry
    from dualpath.traffic.storage import make_storage

    ckpt = open_checkpoint(tiny_dirs["llama"])
    g = KVGeometry.for_model(ckpt.config, "float32", BS)
    store = make_storage(StorageConfig(root=str(tmp_path)), g, b"\x02" * 16)
    keys = [hashlib.blake2b(bytes([i]), digest_size=16).digest() for i in range(3)]
    assert store.write(keys, [torch.zeros(g.full_block_bytes, dtype=torch.uint8)] * 3).result() == [None] * 3
    store.destroy()
    assert not (tmp_path / ("02" * 16)).exists()


@pytest.mark.slow  # a cluster of its own; test_cluster serves through engines quantizing at load by default
def test_a_cluster_quantizing_at_load_serves_hits_and_updates_in_fp8(tiny_dirs, second, tmp_path):
    """``--quantization fp8`` across real engine processes: replies equal the offline model quantized the same way,
    the prefill and decode engines agree on the fingerprint (a later turn hits the first's blocks), and a plain
    update is quantized as it loads."""
    spec = ClusterSpec(
        model=str(tiny_dirs["llama"]),
        num_prefill=1,
        num_decode=1,
        block_size=BS,
        quantization="fp8",
        kv_store=str(tmp_path / "kv"),
        buffer_bytes=8 << 20,
        cache_bytes=16 << 20,
        workspace_tokens=2048,
        cost_model="0.001,0.0001,0",
    )
    old = LLM(str(tiny_dirs["llama"]), block_size=BS, quantization="fp8")
    new = LLM(str(second["llama"]), block_size=BS, quantization="fp8")
    with LocalCluster(spec, run_dir=str(tmp_path / "run")) as c:
        client = ClusterClient(c.scheduler_address, timeout=120)
        first = client.generate(PROMPT, GREEDY)
        assert first.token_ids == old.generate(PROMPT, GREEDY)[0].token_ids
        plain = LLM(str(tiny_dirs["llama"]), block_size=BS).generate(PROMPT, GREEDY)[0].token_ids
        assert first.token_ids != plain  # FP8 moves this reply: the comparison above could fail
        turn2 = PROMPT + first.token_ids + [5, 6]
        got = client.generate(turn2, GREEDY)
        assert got.num_cached_tokens == 48 and got.token_ids == old.generate(turn2, GREEDY)[0].token_ids
        assert client.update_weights(str(second["llama"]), "step-1").ok
        assert client.generate(turn2, GREEDY).token_ids == new.generate(turn2, GREEDY)[0].token_ids
        client.close()
