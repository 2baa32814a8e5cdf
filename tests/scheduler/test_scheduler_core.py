"""The scheduler's bookkeeping driven directly (no sockets): random workloads against simulated engines."""

import itertools
import random

import pytest
from hypothesis import given, settings, strategies as st

from dualpath.core.config import SchedulerConfig
from dualpath.core.errors import RequestError
from dualpath.core.geometry import choice_blocks
from dualpath.core.messages import EngineInfo, EngineLoad, Role, SubmitRequest, pack_tokens
from dualpath.core.sampling_params import SamplingParams
from dualpath.scheduler.balance import drain_rate, measured_alpha
from dualpath.scheduler.core import SchedulerCore
from dualpath.scheduler.http import render
from dualpath.scheduler.policies import make_policy

BS = 16


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def info(eid, role, node, group="", capacity=2000, alpha=0, beta=0):
    return EngineInfo(
        eid,
        role,
        node,
        f"{eid}:1",
        "shm",
        {},
        [],
        1,
        64,
        BS,
        2,
        "ab" * 16,
        capacity,
        max_model_len=4096,
        group_id=group,
        alpha_tokens=alpha,
        beta_tokens=beta,
    )


class SimEngine:
    """What an engine would report: held work ids (with their tokens and reserves) and finished ones."""

    def __init__(self, inf: EngineInfo):
        self.info, self.held, self.finished, self.failed = inf, {}, [], []
        self.read_intervals = []  # its storage read queue's drain intervals (ReadAccounting.drain_intervals)

    def load(self):
        used = sum(r for _, r in self.held.values())
        decode = self.info.role is Role.DECODE
        return EngineLoad(
            self.info.engine_id,
            len(self.held),
            sum(t for t, _ in self.held.values()),
            0,
            self.info.capacity_tokens - used,
            request_ids=list(self.held),
            finished=self.finished,
            started=list(self.held) if decode else [],
            failed=self.failed,
            read_intervals=self.read_intervals,
        )


def make_core(policy, clock, groups=False):
    core = SchedulerCore(
        SchedulerConfig(kv_store="/nonexistent", policy=policy, heartbeat_timeout_s=1e9), make_policy(policy), clock
    )
    engines = {}
    for i in range(2):
        inf = info(f"p{i}", Role.PREFILL, f"n{i}", "pg" if groups else "", beta=3000)
        engines[inf.engine_id] = SimEngine(inf)
    for i in range(3):
        inf = info(f"d{i}", Role.DECODE, f"n{i + 2}", "dg" if groups else "", capacity=1500)
        engines[inf.engine_id] = SimEngine(inf)
    for e in engines.values():
        assert core.register(e.info).ok
    return core, engines


def pull(core, engines, group):
    members = [e for e in engines.values() if (e.info.group_id or e.info.engine_id) == group]
    reply = core.pull(group, [e.load() for e in members])
    for e in members:
        e.finished, e.failed = [], []
    for w in reply.preempted:  # handed back: reported at the engine's next pull
        for e in members:
            if e.held.pop(w, None) is not None:
                e.failed.append([w, "preempted"])
    for eid, work in reply.assignments.items():
        for a in work:
            n = len(a.tokens) // 4
            engines[eid].held[a.request_id] = (n, 0)
            de = engines[a.decode.engine_id]
            p = SamplingParams.from_dict(a.sampling)  # the decode engine holds it from prefill on, every choice
            de.held[a.request_id] = (n, choice_blocks(BS, n, n + p.max_new_tokens, p.n) * BS)
    return reply


def finish_one(engines, x: int) -> None:
    """A decode engine (picked by ``x``) finishes one of its requests (picked by ``x``)."""
    decoders = [e for e in engines.values() if e.info.role is Role.DECODE and e.held]
    if decoders:
        e = decoders[x % len(decoders)]
        w = sorted(e.held)[x % len(e.held)]
        e.held.pop(w)
        e.finished.append(w)
        for p in engines.values():  # the prefill engine handed it over long ago
            if p.info.role is Role.PREFILL:
                p.held.pop(w, None)


def check(core, engines):
    seen = itertools.chain(core.global_queue, core.prefill_queue, *core.private.values())
    ids = list(seen)
    assert len(ids) == len(set(ids)), "a request is queued twice"
    for rid, r in core.requests.items():
        assert (rid in ids) != (r.pe is not None), "queued and assigned at once (or neither)"
    for g, q in core.private.items():  # the weight _group_totals reads: the queue's prompt tokens
        assert q.weight == sum(core.requests[rid].spec.num_tokens for rid in q), g
    for e in engines.values():
        if e.info.role is Role.DECODE:
            reserved = sum(
                choice_blocks(BS, r.spec.num_tokens, r.spec.num_tokens + r.params.max_new_tokens, r.params.n) * BS
                for r in core.requests.values()
                if r.de == e.info.engine_id
            )
            assert reserved <= e.info.capacity_tokens, f"{e.info.engine_id} over-committed"


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["submit", "pull", "finish"]), st.integers(0, 10**6)), max_size=60),
    st.sampled_from(["dualpath", "least-loaded", "round-robin", "random"]),
    st.booleans(),
)
def test_every_request_is_assigned_once_and_queues_drain(ops, policy, groups):
    clock = Clock()
    core, engines = make_core(policy, clock, groups)
    group_ids = sorted({e.info.group_id or e.info.engine_id for e in engines.values()})
    submitted = 0
    for op, x in ops:
        clock.t += 0.01
        if op == "submit":
            n, choices = 20 + x % 400, 1 + x % 3  # parallel sampling: the prompt held once, n choices' budgets
            core.submit(
                SubmitRequest(f"r{submitted}", pack_tokens(range(n)), SamplingParams(max_tokens=8, n=choices).to_dict())
            )
            submitted += 1
        elif op == "pull":
            g = group_ids[x % len(group_ids)]
            if core.idle_for(g):  # then a pull without new reports changes nothing
                before = (
                    list(core.global_queue),
                    list(core.prefill_queue),
                    {k: list(q) for k, q in core.private.items()},
                )
                reply = core.pull(g, [])
                assert not reply.assignments and not reply.cancelled
                assert before == (
                    list(core.global_queue),
                    list(core.prefill_queue),
                    {k: list(q) for k, q in core.private.items()},
                )
            pull(core, engines, g)
        else:
            finish_one(engines, x)
        check(core, engines)
    # drain: engines keep pulling and finishing until nothing is left
    for _ in range(400):
        if not core.requests:
            break
        clock.t += 0.01
        for g in group_ids:
            pull(core, engines, g)
        for e in engines.values():
            if e.held:
                w = sorted(e.held)[0]
                e.held.pop(w)
                if e.info.role is Role.DECODE:
                    e.finished.append(w)
        check(core, engines)
    for g in group_ids:
        pull(core, engines, g)
    assert not core.requests and not core.global_queue and not core.prefill_queue
    assert all(not q for q in core.private.values())
    assert all(not rec.outstanding for rec in core.engines.values()), "leaked accounting"
    assert core.counters["finished"] == submitted


OP_NAMES = ["submit", "pull d0", "pull d1", "pull p0", "finish"]
OPS = st.sampled_from(OP_NAMES)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(OPS, st.integers(0, 10**6)), min_size=40, max_size=80))
def test_preemption_under_random_workloads_overcommits_nothing_and_every_reply_ends_once(ops):
    """Priority scheduling with preemption against simulated engines that hand back what they are told to; the
    submitter continues each preempted reply as a request of its own (``dualpath.client``). Invariants: no engine
    over-committed, victims are less urgent than a request waiting for their group, every original request ends
    exactly once (itself or its last continuation), and the accounting drains."""
    random_preemption_run(ops)


def test_a_seeded_random_workload_preempts():
    """(So the invariants above are known to be checked on preemptions: hypothesis's examples may have none.)"""
    rng = random.Random(1)
    ops = [(rng.choice(OP_NAMES), rng.randrange(10**6)) for _ in range(80)]
    assert random_preemption_run(ops) >= 1


def random_preemption_run(ops) -> int:
    """The workload of ``ops`` (see the test above); how many replies were handed back."""
    clock = Clock()
    core = SchedulerCore(
        SchedulerConfig(kv_store="/nonexistent", heartbeat_timeout_s=1e9, scheduling_policy="priority"),
        make_policy("dualpath"),
        clock,
    )
    engines = {
        e.info.engine_id: e
        for e in (
            SimEngine(info("p0", Role.PREFILL, "n0", beta=3000)),
            SimEngine(info("d0", Role.DECODE, "n1", capacity=800)),
            SimEngine(info("d1", Role.DECODE, "n2", capacity=800)),
        )
    }
    for e in engines.values():
        assert core.register(e.info).ok
    ended, handed_back, originals = {}, [0], []

    def submit(rid, n, priority, resumed=0):
        params = SamplingParams(max_tokens=40, priority=priority, num_resumed_tokens=resumed)
        core.submit(
            SubmitRequest(rid, pack_tokens(range(n + resumed)), params.to_dict()),
            lambda ev, rid=rid, n=n, p=priority, k=resumed: on_event(rid, n, p, k, ev),
        )

    def on_event(rid, n, priority, resumed, ev):
        if ev.kind == "failed" and ev.preempted:  # the client goes on from a few more tokens
            handed_back[0] += 1
            submit(f"{rid}+", n, priority, min(resumed + 3, 39))
        elif ev.kind in ("finished", "failed"):
            origin = rid.split("+")[0]
            assert origin not in ended, f"{origin} ended twice"
            ended[origin] = ev.kind

    def step(op, x):
        clock.t += 0.01
        if op == "submit":
            originals.append(f"r{len(originals)}")
            r = random.Random(x)  # (spread: hypothesis favours small numbers)
            submit(originals[-1], r.randrange(100, 600), r.choice([-1, 0, 1]))
        elif op.startswith("pull"):
            waiting = {rid: core.requests[rid].rank for q in (core.global_queue, *core.private.values()) for rid in q}
            reply = pull(core, engines, op.split()[1])
            for w in reply.preempted:
                victim = core.requests[core.by_work[w]]
                assert waiting and victim.rank > min(waiting.values()), "a reply preempted for nothing more urgent"
        else:
            finish_one(engines, x)
        check(core, engines)

    for op, x in ops:
        step(op, x)
    for i in range(600):  # drain
        if not core.requests:
            break
        for g in ("d0", "d1", "p0"):
            step(f"pull {g}", i)
        step("finish", i)
        engines["p0"].held.clear()
    for g in ("d0", "d1", "p0"):
        pull(core, engines, g)
    assert not core.requests and not core.preempting and not core.preempt_for
    assert sorted(ended) == sorted(originals) and set(ended.values()) <= {"finished"}
    assert core.stats()["preempted"] == handed_back[0] and core.counters["failed"] == 0
    assert all(not rec.outstanding and not rec.decoding for rec in core.engines.values()), "leaked accounting"
    return handed_back[0]


def test_a_dead_decode_group_returns_its_private_queue_and_requests_are_retried():
    clock = Clock()
    core, engines = make_core("dualpath", clock)
    for i in range(6):
        core.submit(SubmitRequest(f"r{i}", pack_tokens(range(100)), SamplingParams(max_tokens=8).to_dict()))
    pull(core, engines, "d0")
    pull(core, engines, "p0")
    assert any(r.de == "d0" for r in core.requests.values())
    # d0 stops reporting (before it ever started generating); the others keep reporting
    core.config = SchedulerConfig(kv_store="/nonexistent", heartbeat_timeout_s=1.0)
    clock.t += 0.5
    for g in ["p0", "p1", "d1", "d2"]:
        pull(core, engines, g)
    clock.t += 0.8
    core.expire()
    assert not core.engines["d0"].alive
    assert all(r.de != "d0" for r in core.requests.values())
    assert "d0" not in core.private and core.counters["retried"] >= 1
    for _ in range(20):
        for g in ["p0", "p1", "d1", "d2"]:
            pull(core, engines, g)
    assert all(r.pe is not None for r in core.requests.values())


def test_choices_that_no_decode_engine_could_hold_are_refused_at_submission():
    """Parallel sampling multiplies the generation budget: a request larger than every decode engine's KV memory
    would wait at the head of its queue forever, so it is refused with the reason."""
    core, _ = make_core("dualpath", Clock())
    prompt = pack_tokens(range(100))  # 6 full blocks + 4 tokens: 112 tokens of blocks for one choice
    core.submit(SubmitRequest("fits", prompt, SamplingParams(max_tokens=200, n=6).to_dict()))  # 96 + 6 x 208
    with pytest.raises(RequestError, match="more KV memory than a decode engine has"):
        core.submit(SubmitRequest("too-big", prompt, SamplingParams(max_tokens=240, n=6).to_dict()))
    assert list(core.requests) == ["fits"]
    assert choice_blocks(BS, 100, 300, 6) * BS == 96 + 6 * 208


def test_the_room_a_request_is_checked_against_follows_the_decode_engines_alive():
    """The largest decode engine's memory bounds a request (submit keeps it until the roster changes): a larger
    engine joining admits what was refused, and once it is gone again the smaller engines' bound is back."""
    core, _ = make_core("dualpath", Clock())
    prompt, big = pack_tokens(range(100)), SamplingParams(max_tokens=240, n=6).to_dict()  # 96 + 6 x 256 > 1500
    with pytest.raises(RequestError, match="more KV memory"):
        core.submit(SubmitRequest("r0", prompt, big))
    assert core.register(info("d9", Role.DECODE, "n9", capacity=1700)).ok
    core.submit(SubmitRequest("r1", prompt, big))
    core.lost("d9", "a test")
    with pytest.raises(RequestError, match="more KV memory"):
        core.submit(SubmitRequest("r2", prompt, big))
    assert list(core.requests) == ["r1"]


def test_decode_engines_are_charged_every_choice_in_whole_blocks():
    """3 choices of 8 tokens after a 100-token prompt hold 96 + 3 x 16 tokens of blocks (not 100 + 8): charging
    less would put more requests on an engine than its memory holds."""
    clock = Clock()
    core, engines = make_core("dualpath", clock)
    for i in range(40):
        core.submit(SubmitRequest(f"r{i}", pack_tokens(range(100)), SamplingParams(max_tokens=8, n=3).to_dict()))
    for _ in range(6):
        clock.t += 0.01
        for g in sorted({e.info.group_id or e.info.engine_id for e in engines.values()}):
            pull(core, engines, g)
        check(core, engines)
    assert sum(r.de is not None for r in core.requests.values()) == 3 * (1500 // 144)


def test_idle_for_says_when_a_pull_could_take_work():
    clock = Clock()
    core, engines = make_core("dualpath", clock, groups=True)
    assert core.idle_for("pg") and core.idle_for("dg")
    core.submit(SubmitRequest("r0", pack_tokens(range(100)), SamplingParams(max_tokens=8).to_dict()))
    assert not core.idle_for("pg") and not core.idle_for("dg")  # the global queue: any pull routes it
    pull(core, engines, "pg")  # routed to the decode group's private queue; nothing for prefill yet
    assert core.idle_for("pg") and not core.idle_for("dg")
    pull(core, engines, "dg")  # a decode engine takes it: it waits for a prefill engine
    assert not core.idle_for("pg") and core.idle_for("dg")
    assert pull(core, engines, "pg").assignments
    assert core.idle_for("pg") and core.idle_for("dg")


def test_a_full_prefill_group_is_not_placed_for_again_until_one_of_its_engines_changes():
    """Algorithm 1 gives a group whose engines all have tok > beta nothing; the core remembers that, and skips the
    group's placement (and ``idle_for`` says so) until a report or its outstanding work changes."""
    core = SchedulerCore(
        SchedulerConfig(kv_store="/nonexistent", heartbeat_timeout_s=1e9), make_policy("dualpath"), Clock()
    )
    engines = {i.engine_id: SimEngine(i) for i in (info(f"p{k}", Role.PREFILL, "n0", "pg", beta=100) for k in (0, 1))}
    engines["d0"] = SimEngine(info("d0", Role.DECODE, "n1", "dg", capacity=100_000))
    for e in engines.values():
        assert core.register(e.info).ok
    for k in range(4):
        core.submit(SubmitRequest(f"r{k}", pack_tokens(range(200)), SamplingParams(max_tokens=8).to_dict()))
    pull(core, engines, "dg")
    assert len(pull(core, engines, "pg").assignments) == 2  # one each: 200 tokens > beta, both in C1 now
    assert not pull(core, engines, "pg").assignments and core.idle_for("pg")
    calls = []
    real = core.policy.assign_prefill
    core.policy.assign_prefill = lambda *a: calls.append(1) or real(*a)
    assert not pull(core, engines, "pg").assignments and not calls  # the same reports: not placed for
    engines["p0"].held.clear()  # p0's prefill is done: its next report frees it
    assert pull(core, engines, "pg").assignments.keys() == {"p0"} and calls
    assert not pull(core, engines, "pg").assignments and core.idle_for("pg")  # full again
    core.engines["p1"].outstanding.add("w", 0, 0)  # work its reports do not count yet: a change too
    assert not core.idle_for("pg")


def test_an_engine_declared_gone_is_told_to_rejoin_and_serves_again():
    clock = Clock()
    core, engines = make_core("dualpath", clock)
    core.config = SchedulerConfig(kv_store="/nonexistent", heartbeat_timeout_s=1.0)
    core.submit(SubmitRequest("r0", pack_tokens(range(100)), SamplingParams(max_tokens=8).to_dict()))
    clock.t += 0.5
    for g in ["p1", "d0", "d1", "d2"]:  # p0 is silent (a long pause: a stopped process, a swap storm)
        assert pull(core, engines, g).rejoin == []
    clock.t += 0.8
    core.expire()
    assert not core.engines["p0"].alive
    reply = pull(core, engines, "p0")  # it wakes up and pulls as if nothing happened
    assert reply.rejoin == ["p0"] and reply.assignments == {}
    assert core.register(engines["p0"].info).ok
    assert core.engines["p0"].alive and pull(core, engines, "p0").rejoin == []


def test_a_decode_engine_lost_mid_reply_fails_it_as_lost_and_its_prefill_engine_no_longer_matters():
    """Once a request generates, its prefill engine is done with it: that engine dying leaves the request alone
    (it was retried from the start, cutting off the reply being read). Its decode engine dying fails it marked
    ``engine_lost``, so its submitter may move the reply on (``dualpath.client``)."""
    clock = Clock()
    core, engines = make_core("dualpath", clock)
    events = []
    core.submit(SubmitRequest("r0", pack_tokens(range(100)), SamplingParams(max_tokens=8).to_dict()), events.append)
    groups = ["d0", "d1", "d2", "p0", "p1"]
    for _ in range(3):  # routed, prefilled, then reported started by its decode engine
        for g in groups:
            pull(core, engines, g)
    r = core.requests["r0"]
    assert r.streaming and r.pe and r.de
    core.config = SchedulerConfig(kv_store="/nonexistent", heartbeat_timeout_s=1.0)
    for gone in (r.pe, r.de):
        groups.remove(gone)
        clock.t += 0.5
        for g in groups:
            pull(core, engines, g)
        clock.t += 0.8
        core.expire()
        assert not core.engines[gone].alive
        if gone == r.pe:
            assert core.requests["r0"] is r and r.attempt == 0 and core.counters["retried"] == 0
    assert "r0" not in core.requests and core.counters["retried"] == 0
    assert events[-1].kind == "failed" and events[-1].engine_lost and r.de in events[-1].error


def test_an_engine_that_says_it_is_leaving_is_gone_once_its_last_report_is_taken():
    """A stopping engine's last report (``leaving``) is absorbed first (the blocks it stored are indexed, so the
    replies it hands back find them), then the engine is gone and its generating requests fail marked
    ``engine_lost``, at once rather than after its heartbeats lapse."""
    from dataclasses import replace

    from dualpath.core.messages import pack_keys

    core, engines = make_core("dualpath", Clock())
    events = []
    core.submit(SubmitRequest("r0", pack_tokens(range(100)), SamplingParams(max_tokens=8).to_dict()), events.append)
    for _ in range(3):
        for g in ["d0", "d1", "d2", "p0", "p1"]:
            pull(core, engines, g)
    de = core.requests["r0"].de
    keys = chain_keys(2)
    core.report(replace(engines[de].load(), stored_keys=pack_keys(keys), leaving=True))
    assert not core.engines[de].alive and core.index.hit_blocks(b"".join(keys)) == 2
    assert events[-1].kind == "failed" and events[-1].engine_lost and "stopping" in events[-1].error


def test_a_resumed_reply_is_charged_and_checked_by_what_it_still_generates():
    """A reply moved on after 100 of its 150 tokens holds KV for its 1,400-token list and 50 more (it fits a
    decode engine of 1,500; charged the whole 150 again it would not), and needs some prompt before them."""
    core, _ = make_core("dualpath", Clock())
    resumed = SamplingParams(max_tokens=150, num_resumed_tokens=100)
    core.submit(SubmitRequest("moved", pack_tokens(range(1400)), resumed.to_dict()))
    assert core.queued(core.requests["moved"]).reserve_tokens == choice_blocks(BS, 1400, 1450, 1) * BS == 1456
    with pytest.raises(RequestError, match="more KV memory"):
        core.submit(SubmitRequest("whole", pack_tokens(range(1400)), SamplingParams(max_tokens=150).to_dict()))
    with pytest.raises(RequestError, match="leave no prompt"):
        core.submit(SubmitRequest("none", pack_tokens(range(100)), resumed.to_dict()))


def test_a_restarted_scheduler_has_unknown_engines_register_keeping_their_work():
    """A scheduler that never registered an engine (it restarted) tells it so apart from one it declared gone:
    ``unknown`` engines register again keeping their work, ``rejoin`` ones drop it first; until engines are back
    a submission is refused as unavailable (retry later), not as invalid."""
    from dualpath.core.errors import UnavailableError

    clock = Clock()
    core, engines = make_core("dualpath", clock)
    fresh = SchedulerCore(
        SchedulerConfig(kv_store="/nonexistent", heartbeat_timeout_s=1e9), make_policy("dualpath"), clock
    )
    with pytest.raises(UnavailableError, match="no prefill engine has registered yet; no decode engine"):
        fresh.submit(SubmitRequest("r0", pack_tokens(range(100)), SamplingParams(max_tokens=8).to_dict()))
    reply = fresh.pull("d0", [engines["d0"].load()], "d0")
    assert reply.unknown == ["d0"] and reply.rejoin == []
    core.config = SchedulerConfig(kv_store="/nonexistent", heartbeat_timeout_s=1.0)
    clock.t += 2.0
    core.expire()  # every engine silent: declared gone
    reply = core.pull("d0", [engines["d0"].load()], "d0")
    assert reply.rejoin == ["d0"] and reply.unknown == []


def test_work_ids_are_not_guessable_from_request_ids():
    """An engine streams a work id's tokens to whoever names it: the id is a capability, so it must carry what only
    the scheduler chose (request ids are the clients'), and a retry gets a new attempt number, the same secret."""
    clock = Clock()
    core, engines = make_core("dualpath", clock)
    for rid in ("a", "b"):
        core.submit(SubmitRequest(rid, pack_tokens(range(100)), SamplingParams(max_tokens=8).to_dict()))
    a, b = core.requests["a"].work_id, core.requests["b"].work_id
    assert a.startswith("a.0.") and b.startswith("b.0.") and len(a) == len("a.0.") + 16
    assert a[4:] != b[4:]
    core._retry("a", "a test")
    assert core.requests["a"].work_id == f"a.1.{a[4:]}" and core.by_work[core.requests["a"].work_id] == "a"


def test_the_block_index_rebuilds_in_the_background(tmp_path):
    """The first registration starts listing storage (minutes on a large store) and replies at once; the
    engine's heartbeat is not held up, and prompts find blocks as the listing adds them."""
    import threading

    clock = Clock()
    core = SchedulerCore(
        SchedulerConfig(kv_store=str(tmp_path), heartbeat_timeout_s=2.0), make_policy("dualpath"), clock
    )
    keys = chain_keys(3)
    release = threading.Event()

    def slow_rebuild(root, fingerprint):
        assert release.wait(10)
        core.index.add(keys)

    core.index.rebuild = slow_rebuild
    assert core.register(info("p0", Role.PREFILL, "n0")).ok  # while the listing waits
    clock.t += 1.5
    core.expire()
    assert core.engines["p0"].alive and core.index.hit_blocks(b"".join(keys)) == 0
    release.set()
    core.index_rebuild.join(10)
    assert core.index.hit_blocks(b"".join(keys)) == 3


def chain_keys(n: int) -> list[bytes]:
    return [bytes([i]) * 16 for i in range(1, n + 1)]


def test_blocks_stored_and_evicted_are_counted_from_the_engines_reports():
    from dataclasses import replace

    from dualpath.core.messages import pack_keys

    core, engines = make_core("dualpath", Clock())
    keys = chain_keys(5)
    core.report(replace(engines["d0"].load(), stored_keys=pack_keys(keys)))
    core.report(replace(engines["d0"].load(), evicted_keys=pack_keys(keys[3:])))
    assert core.stats()["blocks_stored"] == 5 and core.stats()["blocks_evicted"] == 2
    lines = render(core.stats()).splitlines()
    assert "dualpath_scheduler_blocks_stored_total 5.0" in lines and "dualpath_scheduler_index_blocks 3.0" in lines
    assert "dualpath_scheduler_blocks_evicted_total 2.0" in lines


def test_drain_rate_counts_the_time_a_nodes_engines_read_at_once_once():
    assert drain_rate([]) == (0.0, 0.0)
    assert drain_rate([[0, 1, 100], [0, 1, 100]]) == (200, 1)  # two engines sharing the disk for the same second
    assert drain_rate([[3, 4, 30], [0, 1, 100], [0.5, 2, 50], [3.2, 3.5, 5]]) == (185, 3)
    assert measured_alpha([[0, 2, 100], [5, 6, 0]]) == 100  # 100 tokens in 3 s of reading: idle time is not counted
    assert measured_alpha([[0, 0.5, 100]]) == 0  # half a second of reads: latency, not a rate (the probe stands)
    assert measured_alpha([[0, 2, 100]], min_drain_s=3) == 0


def test_a_node_whose_reads_drain_slowly_has_stored_prefixes_recomputed_though_its_probe_said_fast():
    """The engines' start-up probe says 100K tokens in 3 s; then their reads drain at 10 tokens/s (a shared store
    under contention). The scheduler takes the measured rate (it recomputes a 128-token stored prefix rather than
    wait ~13 s for it) and goes back to the probe's once the slow reads leave the 10 s window."""
    from dataclasses import replace

    from dualpath.core.messages import pack_keys

    clock = Clock()
    core = SchedulerCore(
        SchedulerConfig(kv_store="/nonexistent", heartbeat_timeout_s=1e9),
        make_policy("dualpath", recompute_slow_hits=True),
        clock,
    )
    engines = {
        e.info.engine_id: e
        for e in (
            SimEngine(info("p0", Role.PREFILL, "n0", alpha=300_000, beta=5_000)),
            SimEngine(info("d0", Role.DECODE, "n1", alpha=300_000)),
        )
    }
    for e in engines.values():
        assert core.register(e.info).ok
    core.report(replace(engines["p0"].load(), prefill_busy_s=1.0, prefill_tokens=1_000))  # prefills 1K tokens/s
    keys = pack_keys(chain_keys(8))
    core.report(replace(engines["d0"].load(), stored_keys=keys))

    def turn(rid, intervals):
        for e in engines.values():
            e.read_intervals = intervals
        clock.t += 1.0  # past the measure's 0.5 s cache
        core.submit(
            SubmitRequest(
                rid, pack_tokens(range(8 * BS + 4)), SamplingParams(max_tokens=4).to_dict(), block_hashes=keys
            ),
            trust_hashes=True,
        )  # synthetic keys, as the simulator's
        for g in ["d0", "p0"]:
            reply = pull(core, engines, g)
        (a,) = reply.assignments["p0"]
        return len(a.hit_keys) // 16

    assert turn("r0", []) == 8 and core.stats()["node_alpha_tokens"] == {"n0": 300_000, "n1": 300_000}
    slow = [[clock.t - 4, clock.t - 2, 20.0]]  # 20 tokens in 2 s: alpha 30
    assert turn("r1", slow) == 0 and core.counters["recomputed_hit_tokens"] == 8 * BS
    stats = core.stats()
    assert stats["node_alpha_tokens"] == {"n0": 30, "n1": 30} and stats["node_alpha_measured"] == {
        "n0": True,
        "n1": True,
    }
    text = render(stats)
    assert 'dualpath_node_storage_read_tokens_per_second{node="n0"} 10' in text
    assert 'dualpath_node_storage_read_rate_measured{node="n1"} 1' in text
    assert turn("r2", []) == 8  # the engines' windows emptied: the probe's rate again


def test_a_salted_prompt_hits_only_the_blocks_stored_under_its_salt():
    """The scheduler hashes an unhashed prompt from its salt's root (``SamplingParams.cache_salt``), so blocks a
    decode engine stored for one salt are hits for that salt alone."""
    from dataclasses import replace

    from dualpath.core.geometry import block_hashes
    from dualpath.core.messages import pack_keys

    core, engines = make_core("dualpath", Clock())
    prompt = list(range(4 * BS + 3))
    stored = block_hashes(prompt, core.fingerprint, BS, salt="tenant-a")
    core.report(replace(engines["d0"].load(), stored_keys=pack_keys(stored)))
    for rid, salt, hit in (("a", "tenant-a", 4), ("b", "tenant-b", 0), ("plain", "", 0)):
        core.submit(SubmitRequest(rid, pack_tokens(prompt), SamplingParams(max_tokens=4, cache_salt=salt).to_dict()))
        assert core.requests[rid].hit_blocks == hit, salt
    with pytest.raises(RequestError, match="cache_salt"):
        SamplingParams(cache_salt="s" * 1025)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["append", "appendleft", "remove", "popleft"]),
            st.integers(0, 7),
            st.integers(-2, 2),
            st.integers(0, 50),
        ),
        max_size=60,
    )
)
def test_a_ranked_fifo_orders_by_rank_then_arrival_and_keeps_its_weight(ops):
    """``Fifo`` against a sorted list: lower ranks first; append keeps an id's place; appendleft puts it first of
    its rank."""
    from dualpath.scheduler.core import Fifo

    q, model, clock = Fifo(), {}, itertools.count()  # model: id -> (rank, order key, weight)
    for op, i, rank, weight in ops:
        rid = f"r{i}"
        if op == "append":
            old = model.get(rid)
            model[rid] = (old[0], old[1], weight) if old else (rank, next(clock), weight)
            q.append(rid, weight, rank)
        elif op == "appendleft":
            old = model.get(rid)
            r = old[0] if old else rank
            model[rid] = (r, -next(clock), weight)
            q.appendleft(rid, weight, rank)
        elif op == "remove" and rid in model:
            del model[rid]
            q.remove(rid)
        elif op == "popleft" and model:
            head = min(model, key=lambda k: model[k][:2])
            assert q.popleft() == head
            del model[head]
        assert list(q) == sorted(model, key=lambda k: model[k][:2])
        assert len(q) == len(model) and q.weight == sum(w for _, _, w in model.values())
        assert all(k in q for k in model) and bool(q) == bool(model)


def test_a_priority_scheduler_places_and_prefills_the_lowest_priority_first():
    core = SchedulerCore(
        SchedulerConfig(kv_store="/nonexistent", heartbeat_timeout_s=1e9, scheduling_policy="priority"),
        make_policy("dualpath"),
        Clock(),
    )
    engines = {
        e.info.engine_id: e
        for e in (
            SimEngine(info("p0", Role.PREFILL, "n0", beta=3000)),
            SimEngine(info("d0", Role.DECODE, "n1", capacity=400)),
        )
    }
    for e in engines.values():
        assert core.register(e.info).ok
    for rid, priority in (("a", 2), ("b", 0), ("c", -1), ("d", 0), ("e", 2)):
        core.submit(
            SubmitRequest(rid, pack_tokens(range(100)), SamplingParams(max_tokens=20, priority=priority).to_dict())
        )
    assert core.stats()["waiting_by_priority"] == {"-1": 1, "0": 2, "2": 2}
    assert 'dualpath_scheduler_waiting_by_priority{priority="-1"} 1.0' in render(core.stats()).splitlines()
    order = []
    for _ in range(6):  # room for three at a time on the decode engine; each round frees it
        pull(core, engines, "d0")
        order += [a.request_id.split(".")[0] for a in pull(core, engines, "p0").assignments.get("p0", [])]
        for e in engines.values():
            e.finished, e.held = list(e.held), {}
    assert order == ["c", "b", "d", "a", "e"] and core.stats()["waiting_by_priority"] == {}
    fcfs, _ = make_core("dualpath", Clock())
    with pytest.raises(RequestError, match="priority scheduling is not enabled"):
        fcfs.submit(SubmitRequest("x", pack_tokens(range(10)), SamplingParams(priority=1).to_dict()))


def test_a_request_that_fits_no_decode_engine_has_a_less_urgent_reply_handed_back_once():
    """Priority scheduling's preemption: an urgent request that fits nowhere has the decode engine hand back a
    less urgent generating reply (once: the order is not repeated while it is carried out); its handing back fails
    it ``engine_lost`` for its submitter to continue, and the urgent one takes the memory it freed. The continuation
    queues first of its priority. Under fcfs, or with preemption off, nothing is preempted."""
    from dataclasses import replace

    def setup(policy, preemption):
        core = SchedulerCore(
            SchedulerConfig(
                kv_store="/nonexistent",
                heartbeat_timeout_s=1e9,
                scheduling_policy=policy,
                priority_preemption=preemption,
            ),
            make_policy("dualpath"),
            Clock(),
        )
        engines = {
            e.info.engine_id: e
            for e in (
                SimEngine(info("p0", Role.PREFILL, "n0", beta=3000)),
                SimEngine(info("d0", Role.DECODE, "n1", capacity=400)),
            )
        }
        for e in engines.values():
            assert core.register(e.info).ok
        return core, engines

    def submit(core, rid, priority, resumed=0, events=None):
        params = SamplingParams(max_tokens=100 + resumed, priority=priority, num_resumed_tokens=resumed)
        core.submit(
            SubmitRequest(rid, pack_tokens(range(100 + resumed)), params.to_dict()),
            (events if events is not None else []).append,
        )

    for policy, preemption in (("priority", True), ("priority", False), ("fcfs", True)):
        core, engines = setup(policy, preemption)
        bg_events = []
        submit(core, "bg", 5 if policy == "priority" else 0, events=bg_events)
        for _ in range(3):  # placed, prefilled, reported started
            pull(core, engines, "d0"), pull(core, engines, "p0")
        assert core.requests["bg"].streaming
        submit(core, "urgent", -1 if policy == "priority" else 0)  # 208 tokens of 400, 208 held by bg
        replies = [core.pull("d0", [engines["d0"].load()]) for _ in range(3)]  # an engine slow to hand back
        if policy == "fcfs" or not preemption:
            assert not any(r.preempted for r in replies) and core.requests["urgent"].de is None
            continue
        bg = core.requests["bg"].work_id
        assert [r.preempted for r in replies] == [[bg], [], []]
        assert core.requests["urgent"].de is None  # the memory is not free yet
        engines["d0"].held.pop(bg)
        core.report(replace(engines["d0"].load(), failed=[[bg, "preempted on d0"]]))
        assert bg_events[-1].kind == "failed" and bg_events[-1].engine_lost and "bg" not in core.requests
        assert core.stats()["preempted"] == 1 and core.counters["failed"] == 0
        assert "dualpath_scheduler_preempted_total 1.0" in render(core.stats()).splitlines()
        pull(core, engines, "d0")
        assert core.requests["urgent"].de == "d0"
        submit(core, "other", 5)
        submit(core, "bg+0", 5, resumed=10)  # bg's continuation: it goes on before "other"
        assert list(core.global_queue) == ["bg+0", "other"]


def test_requests_wait_for_a_restarting_role_at_most_the_bound_and_then_fail_naming_it():
    """Both prefill engines go silent (killed, restarting). Requests already queued, and new ones, are accepted
    and wait; one waits at most ``engine_wait_timeout_s`` counted from when it began to wait, then fails as
    unavailable with the missing role and the last engine's departure named; a generating reply is left alone.
    Once a prefill engine registers again, what is left is served."""
    clock = Clock()
    core, engines = make_core("dualpath", clock)
    core.config = SchedulerConfig(kv_store="/nonexistent", heartbeat_timeout_s=1.0, engine_wait_timeout_s=10.0)
    events: dict[str, list] = {}
    submit = lambda rid: core.submit(
        SubmitRequest(
            rid,
            pack_tokens(range(100)),
            SamplingParams(max_tokens=8).to_dict(),  # noqa: E731
        ),
        events.setdefault(rid, []).append,
    )
    submit("gen")
    for _ in range(3):
        for g in ["d0", "d1", "d2", "p0", "p1"]:
            pull(core, engines, g)
    assert core.requests["gen"].streaming
    submit("old")
    clock.t += 1.5
    for g in ["d0", "d1", "d2"]:
        pull(core, engines, g)
    core.expire()  # p0 and p1 silent past the heartbeat: no prefill engine
    assert core.missing() == ["no prefill engine alive for 0 s (p1 is gone: no load report for 1.5 s)"]
    assert not core.ready() and "old" in core.requests
    clock.t += 6
    submit("new")  # accepted: its role is restarting, and the wait is bounded
    clock.t += 4.5
    for g in ["d0", "d1", "d2"]:
        pull(core, engines, g)
    core.expire()
    assert "old" not in core.requests and "new" in core.requests and "gen" in core.requests
    ev = events["old"][-1]
    assert ev.kind == "failed" and ev.error.startswith("unavailable: waited 10 s for an engine: no prefill engine")
    assert "no load report" in ev.error and not ev.engine_lost
    assert core.register(engines["p0"].info).ok and core.ready() and core.missing() == []
    engines["p0"].held.clear()
    for _ in range(3):
        for g in ["d0", "d1", "d2", "p0"]:
            pull(core, engines, g)
    core.expire()
    assert core.requests["new"].pe == "p0"


def test_without_a_bound_or_before_any_engine_a_missing_role_refuses_submissions():
    from dualpath.core.errors import UnavailableError

    clock = Clock()
    core = SchedulerCore(
        SchedulerConfig(kv_store="/nonexistent", engine_wait_timeout_s=0), make_policy("dualpath"), clock
    )
    spec = SubmitRequest("r", pack_tokens(range(100)), SamplingParams(max_tokens=8).to_dict())
    with pytest.raises(UnavailableError, match="no prefill engine has registered yet; no decode engine has"):
        core.submit(spec)
    assert core.register(info("d0", Role.DECODE, "n0")).ok
    assert core.register(info("p0", Role.PREFILL, "n1")).ok
    core.lost("p0", "its health check failed")
    with pytest.raises(UnavailableError, match=r"no prefill engine alive for 0 s \(p0 is gone: its health check"):
        core.submit(spec)
