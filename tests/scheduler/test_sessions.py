"""Agent sessions in the scheduler, without processes: a turn that ended in a tool call gets its KV prefetched to
the engine its next turn will use, that turn goes there while the balance rules allow and reads where the prefetch
is; tenants never share a session; hints outside their bounds are refused naming the field."""

import pytest

from dualpath.core.config import SchedulerConfig
from dualpath.core.errors import RequestError
from dualpath.core.geometry import block_hashes
from dualpath.core.messages import (
    EngineInfo,
    EngineLoad,
    Mode,
    ReadPath,
    Role,
    SubmitRequest,
    TurnEnd,
    pack_keys,
    pack_tokens,
)
from dualpath.core.sampling_params import SamplingParams
from dualpath.core.sessions import SessionHint, parse_session, session_key
from dualpath.scheduler.core import SchedulerCore
from dualpath.scheduler.paper import DualPathPolicy
from dualpath.scheduler.policies import make_policy
from dualpath.scheduler.policy import Affinity, EngineState, NodeState, QueuedRequest, prefetched_side
from dualpath.traffic.storage.pins import pinned_keys

BS = 16
FP = "ab" * 16


class Clock:
    t = 100.0

    def __call__(self):
        return self.t


def info(eid, role, node):  # each node reads 3,000 tokens in 3 s
    return EngineInfo(
        eid, role, node, f"{eid}:1", "shm", {}, [], 1, 64, BS, 2, FP, 4000, max_model_len=4096, alpha_tokens=3000
    )


class Cluster:
    """Two prefill and two decode engines on four nodes, reporting what a real engine would."""

    def __init__(self, kv_store="/nonexistent", **config):
        self.clock = Clock()
        cfg = SchedulerConfig(kv_store=kv_store, heartbeat_timeout_s=1e9, **config)
        self.core = SchedulerCore(cfg, make_policy("dualpath"), self.clock)
        self.held: dict[str, dict[str, int]] = {}
        self.finished: dict[str, list[str]] = {}
        self.stored: dict[str, bytes] = {}
        for eid, role, node in (("p0", Role.PREFILL, "n0"), ("p1", Role.PREFILL, "n1")) + (
            ("d0", Role.DECODE, "n2"),
            ("d1", Role.DECODE, "n3"),
        ):
            assert self.core.register(info(eid, role, node)).ok
            self.held[eid], self.finished[eid] = {}, []

    def load(self, eid):
        held = self.held[eid]
        load = EngineLoad(
            eid,
            len(held),
            sum(held.values()),
            0,
            4000 - sum(held.values()),
            request_ids=list(held),
            finished=self.finished[eid],
            started=list(held) if eid.startswith("d") else [],
            stored_keys=self.stored.pop(eid, b""),
        )
        self.finished[eid] = []
        return load

    def pull(self, eid):
        reply = self.core.pull(eid, [self.load(eid)])
        for a in reply.assignments.get(eid, []):
            self.held[eid][a.request_id] = len(a.tokens) // 4
            self.held[a.decode.engine_id][a.request_id] = len(a.tokens) // 4
        return reply

    def cycle(self):
        return {eid: self.pull(eid) for eid in ("d0", "d1", "p0", "p1")}

    def finish_all(self):
        """Every decode engine finishes what it holds; the prompt's blocks are stored (as a decode engine does)."""
        for eid in ("d0", "d1", "p0", "p1"):
            for w in list(self.held[eid]):
                if eid.startswith("d"):
                    self.finished[eid].append(w)
                del self.held[eid][w]
        self.cycle()

    def store(self, tokens, salt=""):
        keys = block_hashes(tokens, bytes.fromhex(FP), BS, salt=salt)
        self.stored["d0"] = self.stored.get("d0", b"") + pack_keys(keys)


def submit(core, rid, tokens, session=None, salt=""):
    params = SamplingParams(max_tokens=8, cache_salt=salt)
    events = core.submit(SubmitRequest(rid, pack_tokens(tokens), params.to_dict(), session=session))
    return events


def assigned(events):
    while True:
        ev = events.get_nowait()
        if ev.kind == "assigned":
            return ev


def run_turn(c, rid, tokens, session, salt=""):
    events = submit(c.core, rid, tokens, session, salt)
    c.cycle()
    ev = assigned(events)
    return ev, c.core.requests[rid]


def test_a_tool_wait_orders_a_prefetch_and_the_next_turn_reads_it_where_it_went():
    c = Cluster()
    prompt = list(range(1, 6 * BS + 1))
    ev1, r1 = run_turn(c, "t1", prompt, SessionHint("agent-1"))
    assert not ev1.prefetched
    reply = list(range(500, 500 + BS))
    c.store(prompt + reply)  # the decode engine stored the prompt and the reply's blocks
    c.finish_all()
    c.core.end_turn(TurnEnd("t1", pack_tokens(reply), tool_wait=True))
    orders = {eid: r.prefetch[eid] for eid, r in c.cycle().items() if r.prefetch}
    # nothing is known of the gap yet (no hint, no earlier gaps): the prefetch goes out at once, to the last turn's
    # decode engine (two prefill groups: which one the next turn gets is not known, its decode engine may be kept)
    assert list(orders) == [r1.de]
    ((eid, [order]),) = orders.items()
    assert len(order.keys) == 7 * 16 and order.hold_s >= 30  # the 7 blocks of prompt + reply
    c.clock.t += 20
    ev2, r2 = run_turn(c, "t2", prompt + reply + list(range(900, 900 + BS)), SessionHint("agent-1"))
    assert ev2.prefetched and r2.de == r1.de
    assert (r2.pe if r2.path == "pe" else r2.de) == eid
    stats = c.core.stats()
    assert stats["prefetch_orders"] == 1 and stats["session_turns_prefetched"] == 1
    assert c.core.sessions.of_request("t2").gaps.count == 1  # the 20 s gap, measured


def one_turn(c: Cluster, hint: SessionHint, tool_wait: bool | None) -> None:
    """A session's first turn runs, its prompt's blocks are stored, and (unless ``tool_wait`` is None) its submitter
    ends it."""
    prompt = list(range(1, 4 * BS + 1))
    run_turn(c, "t1", prompt, hint)
    c.store(prompt)
    c.finish_all()
    if tool_wait is not None:
        c.core.end_turn(TurnEnd("t1", b"", tool_wait=tool_wait))


def test_without_a_tool_wait_or_hint_nothing_is_prefetched():
    c = Cluster()
    one_turn(c, SessionHint("a"), tool_wait=False)
    assert not any(r.prefetch for r in c.cycle().values())


def test_a_hinted_gap_delays_the_prefetch_to_just_before_the_turn():
    c = Cluster()
    one_turn(c, SessionHint("a", next_turn_in_s=60), tool_wait=None)  # the hint alone makes the session wait
    assert not any(r.prefetch for r in c.cycle().values())
    # 64 tokens at 1,000 tokens/s: the prefetch goes out 1.5 x 0.064 s before the hinted 60 s (no gaps seen yet,
    # so the hint is the whole estimate: its q20 is the hint)
    c.clock.t += 59.8
    assert not any(r.prefetch for r in c.cycle().values())
    c.clock.t += 0.11
    assert any(r.prefetch for r in c.cycle().values())


def test_the_prefetch_is_off_when_the_scheduler_says_so():
    c = Cluster(session_prefetch=False)
    one_turn(c, SessionHint("a"), tool_wait=True)
    assert not any(r.prefetch for r in c.cycle().values())


def test_one_tenants_session_id_is_not_anothers():
    assert session_key("s", "tenant-a") != session_key("s", "tenant-b")
    c = Cluster()
    prompt = list(range(1, 4 * BS + 1))
    run_turn(c, "t1", prompt, SessionHint("shared-id"), salt="tenant-a")
    c.finish_all()
    _, r = run_turn(c, "t2", prompt, SessionHint("shared-id"), salt="tenant-b")
    assert r.affinity is None  # a new session: nothing of tenant a's turn reaches it
    assert len(c.core.sessions.sessions) == 2


def test_a_ttl_pins_the_sessions_stored_blocks_within_the_tenants_quota(tmp_path):
    c = Cluster(kv_store=str(tmp_path), session_pin_quota_tokens=6 * BS)
    prompt = list(range(1, 4 * BS + 1))
    for rid, sid in (("t1", "a"), ("t2", "b")):
        run_turn(c, rid, prompt + [ord(sid)] * BS, SessionHint(sid, ttl_s=600))
        c.store(prompt + [ord(sid)] * BS)
        c.finish_all()
        c.core.end_turn(TurnEnd(rid, b"", tool_wait=True))
    c.core._pins.submit(lambda: None).result(5)  # the pin files are written
    a, b = (c.core.sessions.of_request(r) for r in ("t1", "t2"))
    got = {p.stem: (p.stat().st_size - 16) // 16 for p in (tmp_path / FP / "pins").glob("*.pin")}
    assert got == {a.key: 5, b.key: 1}  # 5 blocks each; the quota of 6 leaves the second session one
    assert len(pinned_keys(tmp_path / FP)) == 5  # (the shared 4 leading blocks are one set)
    c.clock.t += 3601  # past the scheduler's idle bound: both forgotten, their pins removed
    c.core.expire()
    c.core._pins.submit(lambda: None).result(5)
    assert not list((tmp_path / FP / "pins").glob("*.pin"))


@pytest.mark.parametrize(
    "body,field",
    [
        ({"id": ""}, "dualpath.session.id"),
        ({"id": "x", "next_turn_in_s": -1}, "dualpath.session.next_turn_in_s"),
        ({"id": "x", "next_turn_in_s": float("nan")}, "dualpath.session.next_turn_in_s"),
        ({"id": "x", "ttl_s": 8 * 86400}, "dualpath.session.ttl_s"),
        ({"id": "x", "ttl": 5}, "dualpath.session"),
        ("x", "dualpath.session"),
    ],
)
def test_hints_out_of_bounds_are_refused_naming_the_field(body, field):
    with pytest.raises(RequestError) as e:
        parse_session(body)
    assert e.value.field == field


def test_the_header_and_the_body_must_agree():
    assert parse_session(None, "h").id == "h"
    assert parse_session({"next_turn_in_s": 3}, "h") == SessionHint("h", 3.0)
    with pytest.raises(RequestError):
        parse_session({"id": "b"}, "h")


def test_the_scheduler_refuses_a_bad_hint_sent_around_the_frontend():
    c = Cluster()
    with pytest.raises(RequestError) as e:
        submit(c.core, "t1", list(range(1, 40)), SessionHint("a", ttl_s=-5))
    assert e.value.field == "dualpath.session.ttl_s"


# --- the policy's preference, bounded by balance ----------------------------------------------------------------
def q(affinity, mode=Mode.DUALPATH, de="d0"):
    return QueuedRequest("r", 256, 192, 300, "n2", mode, de, affinity)


def test_a_turn_reads_where_its_prefetch_is_unless_its_mode_forbids_that_side():
    on_de = Affinity(de="d0", prefetch_engine="d0", prefetch_blocks=3)
    assert prefetched_side(q(on_de), "p0") is ReadPath.DE
    assert prefetched_side(q(on_de, Mode.PE), "p0") is None
    on_pe = Affinity(pe="p1", prefetch_engine="p1", prefetch_blocks=3)
    assert prefetched_side(q(on_pe), "p1") is ReadPath.PE
    assert prefetched_side(q(on_pe), "p0") is None
    assert prefetched_side(q(on_pe, Mode.DE), "p1") is None


def test_prefetched_tokens_are_not_charged_to_a_read_queue():
    pol = DualPathPolicy()
    nodes = {"n0": NodeState(), "n2": NodeState()}
    e = EngineState("p0", "n0", "p0")
    d = pol.place_prefill(q(Affinity(de="d0", prefetch_engine="d0", prefetch_blocks=2)), e, nodes, "n0", 64)
    assert d.path.path is ReadPath.DE
    assert nodes["n2"].read_q == 192 - 128 and nodes["n0"].read_q == 0  # only the block not prefetched


def test_the_last_decode_group_is_kept_only_within_the_slack():
    pol = DualPathPolicy()
    a = Affinity(de="d1", de_group="g1")
    assert pol.route_decode_group(q(a), {"g0": 1000, "g1": 1100}) == "g1"  # 1100 <= 1.05 x mean 1050
    assert pol.route_decode_group(q(a), {"g0": 1000, "g1": 1110}) == "g0"  # 1110 > 1.05 x 1055: balance wins
    pol.affinity = False
    assert pol.route_decode_group(q(a), {"g0": 1000, "g1": 1050}) == "g0"


def test_the_last_decode_engine_is_kept_only_under_z():
    pol = DualPathPolicy()
    r = QueuedRequest("r", 10, 0, 200, affinity=Affinity(de="d1"))

    def place(d1_tok):
        engines = [EngineState("d0", "n2", "g", 1, 300, 5000), EngineState("d1", "n3", "g", 3, d1_tok, 5000)]
        return pol.assign_decode([r], engines, {"d0", "d1"})

    # Z = 1.05 x (10 + 300 + 320) / 2 = 330.75: both stay under it; the turn keeps d1 though d0 has fewer requests
    assert place(320) == [("r", "d1")]
    # Z = 1.05 x (10 + 300 + 340) / 2 = 341.25: d1 would go over it, so the fewest-seq engine takes the turn
    assert place(340) == [("r", "d0")]
