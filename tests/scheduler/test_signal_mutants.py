"""The load signals the scheduler balances by, at the edges the cluster-level tests leave open (found by
``bench/mutation.py``): the sliding windows of read bytes and busy time, max/avg, a node's measured read rate."""

from dualpath.core.config import SchedulerConfig
from dualpath.core.geometry import HASH_BYTES
from dualpath.core.messages import EngineInfo, EngineLoad, Role, SubmitRequest, pack_tokens
from dualpath.core.sampling_params import SamplingParams
from dualpath.scheduler.balance import WindowedSums, drain_rate, max_over_avg, measured_alpha
from dualpath.scheduler.core import SchedulerCore
from dualpath.scheduler.policies import make_policy
from dualpath.scheduler.policy import EngineState, NodeState


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_window_sums_each_keys_increments_of_its_last_seconds():
    clock = Clock()
    w = WindowedSums(10.0, clock)
    w.add("a", 5.0)
    clock.t = 4.0
    w.add("a", 3.0)
    w.add("b", 0.0)  # counted in the average, with nothing
    assert w.sum("a") == 8.0 and w.sums() == {"a": 8.0, "b": 0.0}
    clock.t = 10.0  # the first increment is exactly window_s old: still in
    assert w.sum("a") == 8.0
    clock.t = 10.5
    assert w.sums() == {"a": 3.0, "b": 0.0}
    clock.t = 14.5
    assert w.sum("a") == 0.0 and w.sum("nobody") == 0.0


def test_tracked_and_forgotten_keys():
    w = WindowedSums(10.0, Clock())
    w.track("idle")
    w.add("busy", 2.0)
    assert w.sums() == {"idle": 0.0, "busy": 2.0}
    w.forget("busy")
    assert w.sums() == {"idle": 0.0}
    assert w.sums({"busy"}) == {"busy": 2.0}  # its increments still count when asked for by name
    w.forget("never-added")


def test_max_over_avg_and_a_nodes_measured_read_rate():
    assert max_over_avg([]) == 1.0 and max_over_avg([0.0, 0.0]) == 1.0
    assert max_over_avg([1.0, 3.0]) == 1.5 and max_over_avg(iter([2.0, 2.0, 2.0])) == 1.0
    assert max_over_avg([0.25, 0.75]) == 1.5  # an average under 1
    assert drain_rate([[0, 2, 10], [0.5, 1.5, 5]]) == (15, 2)  # a read inside another adds no time
    assert measured_alpha([[0, 1, 100]]) == 300  # exactly the minimum drain time: a rate
    assert measured_alpha([[0, 1, 0]]) == 0  # waited a second and read nothing: no rate
    assert measured_alpha([[0, 1, 1]]) == 3  # a single token is a rate
    assert measured_alpha([[0, 0.75, 50], [1, 1.25, 50]], min_drain_s=1.0) == 300


# --- the scheduler core's view of its engines -------------------------------------------------------------------
BS = 16


def _info(eid, role, node, capacity=1000, alpha=0, beta=0, group=""):
    return EngineInfo(
        eid, role, node, f"{eid}:1", "shm", {}, [], 1, 64, BS, 2, "ab" * 16, capacity, max_model_len=4096,
        group_id=group, alpha_tokens=alpha, beta_tokens=beta,
    )  # fmt: skip


def _core(*infos):
    clock = Clock()
    core = SchedulerCore(
        SchedulerConfig(kv_store="/nonexistent", heartbeat_timeout_s=1e9), make_policy("dualpath"), clock
    )
    for i in infos:
        assert core.register(i).ok
    return core, clock


def test_a_prefill_engines_measured_beta_decays_older_reports_and_needs_64_tokens():
    core, clock = _core(_info("p0", Role.PREFILL, "n0", beta=7), _info("d0", Role.DECODE, "n1"))
    p0 = core.engines["p0"]
    assert p0.measured_beta() == 0
    core.report(EngineLoad("p0", 0, 0, 0, 0, prefill_busy_s=1.0, prefill_tokens=63))
    assert p0.measured_beta() == 0  # under 64 tokens: too few to go by
    core.report(EngineLoad("p0", 0, 0, 0, 0, prefill_busy_s=1.0, prefill_tokens=1000))
    assert p0.prefilled == (0.8 * 63 + 1000, 0.8 * 1.0 + 1.0)
    assert p0.measured_beta() == int(5 * (0.8 * 63 + 1000) / 1.8)
    assert core.prefill_busy_s["p0"] == 2.0 and core.busy_window.sum("p0") == 2.0
    core.report(EngineLoad("d0", 0, 0, 0, 0, prefill_busy_s=5.0, prefill_tokens=5000))  # a decode engine's: no
    assert core.engines["d0"].prefilled == (0.0, 0.0) and "d0" not in core.prefill_busy_s
    state = core._state(p0)
    assert (state.beta, state.measured_beta) == (7, p0.measured_beta())


def _load(eid, **kw):
    return EngineLoad(eid, kw.pop("seq", 0), kw.pop("tok", 0), kw.pop("read_q", 0), kw.pop("free", 0), **kw)


def test_a_nodes_state_sums_its_alive_engines_and_their_reads():
    core, clock = _core(
        _info("p0", Role.PREFILL, "n0", alpha=300),
        _info("d0", Role.DECODE, "n0", alpha=500),
        _info("p1", Role.PREFILL, "n0"),  # no report yet
        _info("d1", Role.DECODE, "n1"),
    )
    core.report(_load("p0", read_q=30, storage_read_bytes=100))
    core.report(_load("d0", read_q=12, storage_read_bytes=50))
    core.report(_load("d1", read_q=7))
    core.report(_load("p0", read_q=30, storage_read_bytes=20))
    n0 = core.node_state("n0")
    assert (n0.read_q, n0.alpha, n0.recent_read) == (42, 500, 170.0)
    assert core.storage_read_bytes == {"n0": 170, "n1": 0}
    assert core.node_state("n1").read_q == 7 and core.node_state("nowhere") == NodeState()
    core.lost("d0", "gone")
    assert (core.node_state("n0").read_q, core.node_state("n0").alpha) == (30, 300)
    nodes = core._node_states()
    assert nodes.get("n1").read_q == 7 and nodes.setdefault("n0").read_q == 30 and set(nodes) == {"n0", "n1"}


def test_a_nodes_live_alpha_is_measured_at_most_every_half_second():
    core, clock = _core(_info("p0", Role.PREFILL, "n0", alpha=300), _info("d0", Role.DECODE, "n1"))
    core.engines["p0"].read_intervals = [[0.0, 1.0, 100.0]]  # 100 tokens in a second: 300 in 3 s
    assert core.live_alpha("n0") == 300 and core.live_alpha("nowhere") == 0
    core.engines["p0"].read_intervals = [[0.0, 1.0, 200.0]]
    clock.t = 0.3
    assert core.live_alpha("n0") == 300  # measured at 0.0: kept
    clock.t = 0.5
    assert core.live_alpha("n0") == 300
    clock.t = 0.51
    assert core.live_alpha("n0") == 600 and core.node_state("n0").alpha == 600
    core.engines["p0"].read_intervals = []
    clock.t = 0.8
    assert core.live_alpha("n0") == 600  # measured at 0.51: kept
    clock.t = 1.2
    assert core.live_alpha("n0") == 0 and core.node_state("n0").alpha == 300  # not measured: the engines' own


def test_an_engines_state_is_its_report_plus_the_work_handed_to_it_since():
    core, clock = _core(_info("p0", Role.PREFILL, "n0", beta=900), _info("d0", Role.DECODE, "n1", capacity=1000))
    d0 = core.engines["d0"]
    d0.outstanding.add("w1", 40, 100)
    d0.outstanding.add("w2", 10, 30)
    d0.outstanding.add("w1", 50, 120)  # handed out again: replaces
    assert (len(d0.outstanding), d0.outstanding.tokens, d0.outstanding.reserve) == (2, 60, 150)
    assert core._state(d0) == EngineState("d0", "n1", "d0", seq=2, tok=60, free_tokens=850)
    core.report(_load("d0", seq=3, tok=400, free=700, request_ids=["w2", "w9"]))  # it now counts w2 itself
    assert core._state(d0) == EngineState("d0", "n1", "d0", seq=4, tok=450, free_tokens=580)
    d0.outstanding.discard("w1")
    d0.outstanding.discard("w1")
    assert (d0.outstanding.tokens, d0.outstanding.reserve, bool(d0.outstanding)) == (0, 0, False)
    p0 = core.engines["p0"]
    p0.prefilled = (640.0, 2.0)
    assert core._state(p0) == EngineState("p0", "n0", "p0", free_tokens=1000, beta=900, measured_beta=1600)
    p0.prefilled = (64.0, 1.0)  # exactly the least it goes by
    assert p0.measured_beta() == 320


def test_decode_groups_total_their_engines_work_and_queue_for_50_ms():
    core, clock = _core(
        _info("p0", Role.PREFILL, "n0"),
        _info("d0", Role.DECODE, "n1", group="g1"),
        _info("d1", Role.DECODE, "n2", group="g1"),
        _info("d2", Role.DECODE, "n3", group="g2"),
    )
    core.report(_load("d0", tok=100))
    core.engines["d1"].outstanding.add("w", 20, 0)
    core.private["g1"].append("r1", 7)
    assert core._group_totals() == {"g1": 127, "g2": 0}
    core.report(_load("d2", tok=5))
    clock.t = 0.05
    assert core._group_totals() == {"g1": 127, "g2": 0}  # 50 ms old: kept
    clock.t = 0.06
    assert core._group_totals() == {"g1": 127, "g2": 5}
    core.report(_load("d2", tok=9))
    clock.t = 0.09
    assert core._group_totals() == {"g1": 127, "g2": 5}  # 30 ms old: kept


def test_blocks_reported_stored_are_indexed_once_each_from_alive_engines_only():
    core, clock = _core(_info("p0", Role.PREFILL, "n0"), _info("d0", Role.DECODE, "n1"), _info("d1", Role.DECODE, "n2"))
    a, b, c = (bytes([i]) * HASH_BYTES for i in (1, 2, 3))
    core.lost("d1", "gone")
    core.pull("d0", [_load("d0", stored_keys=a), _load("p0", stored_keys=b), _load("d1", stored_keys=c)])
    assert core.index.hit_blocks(a) == 1 and core.index.hit_blocks(b) == 1 and core.index.hit_blocks(c) == 0
    core.pull(
        "d0", [_load("d0", stored_keys=c, evicted_keys=a), _load("p0", evicted_keys=b), _load("d1", evicted_keys=c)]
    )
    assert core.index.hit_blocks(c) == 1 and core.index.hit_blocks(a) == 0 and core.index.hit_blocks(b) == 0
    core.report(_load("d0", evicted_keys=c))
    assert [core.counters[k] for k in ("blocks_stored", "blocks_evicted")] == [3, 3]
    assert all(type(core.counters[k]) is int for k in ("blocks_stored", "blocks_evicted"))


def test_failures_counted_from_reports_add_up():
    core, clock = _core(_info("p0", Role.PREFILL, "n0"), _info("d0", Role.DECODE, "n1"))
    core.report(_load("p0", kv_load_failures=2, kv_corrupt_removed=1, rpc_refused=1))
    core.report(_load("p0", kv_load_failures=3, kv_corrupt_removed=1, rpc_refused=2))
    assert [core.counters[k] for k in ("kv_load_failures", "kv_corrupt_removed", "rpc_refused")] == [5, 2, 3]


def _placed(core, rid="r1", events=None):
    """Submit ``rid`` (unless queued again, retried) and pull it onto d0 and p0; its work id."""
    events = [] if events is None else events
    if rid not in core.requests:
        spec = SubmitRequest(rid, pack_tokens(range(3, 43)), SamplingParams(max_tokens=4).to_dict())
        core.submit(spec, notify=events.append)
    core.pull("d0", [_load("d0", free=1000)])
    (a,) = core.pull("p0", [_load("p0")]).assignments["p0"]
    return a.request_id


def _engines(**config):
    clock = Clock()
    cfg = SchedulerConfig(kv_store="/nonexistent", heartbeat_timeout_s=1e9, **config)
    core = SchedulerCore(cfg, make_policy("dualpath"), clock)
    for i in (_info("p0", Role.PREFILL, "n0"), _info("d0", Role.DECODE, "n1")):
        assert core.register(i).ok
    return core


def test_a_finished_request_ends_with_its_own_id():
    core, events = _engines(), []
    w = _placed(core, "r1", events)
    core.report(_load("d0", started=[w]))
    assert core.requests["r1"].streaming and core.engines["d0"].decoding == {"r1"}
    core.report(_load("d0", finished=[w]))
    assert (events[-1].kind, events[-1].request_id) == ("finished", "r1") and core.counters["finished"] == 1
    assert "r1" not in core.requests


def test_a_prefill_engines_failure_retries_and_a_generating_replys_fails_it():
    core, events = _engines(), []
    w = _placed(core, "r1", events)
    core.report(_load("p0", failed=[["nobody.0.x", "?"], [w, "prefill broke"]]))  # an unknown work id first
    assert core.counters["retried"] == 1 and core.requests["r1"].attempt == 1 and "r1" in core.global_queue
    w = _placed(core, "r1", events)
    core.report(_load("d0", failed=[[w, "before streaming"]]))  # a decode engine, nothing streamed yet: retried
    assert core.counters["retried"] == 2 and core.counters["failed"] == 0
    w = _placed(core, "r1", events)
    core.report(_load("d0", started=[w]))
    core.report(_load("d0", failed=[[w, "decode broke"]]))
    last = events[-1]
    assert (last.kind, last.request_id, last.error, last.engine_lost, last.preempted) == (
        "failed",
        "r1",
        "decode broke",
        False,
        False,
    )
    assert core.counters["failed"] == 1 and core.counters["preempted"] == 0


def test_a_prefill_failure_after_streaming_retries_and_the_last_attempt_fails_with_its_reason():
    core, events = _engines(max_attempts=1), []
    w = _placed(core, "r1", events)
    core.report(_load("p0", failed=[[w, "the store is gone"]]))
    assert events[-1].kind == "failed" and "the store is gone" in events[-1].error
    core = _engines()
    w = _placed(core, "r2", events)
    core.requests["r2"].streaming = True  # (generating, and its prefill engine reports it failed: retried)
    core.report(_load("p0", failed=[[w, "late"]]))
    assert core.counters["retried"] == 1 and core.counters["failed"] == 0


def test_a_reply_handed_back_as_told_ends_as_preempted():
    core, events = _engines(), []
    w = _placed(core, "r1", events)
    core.report(_load("d0", started=[w]))
    core.preempting.add("r1")
    core.report(_load("d0", failed=[[w, "handed back"]]))
    last = events[-1]
    assert (last.kind, last.request_id, last.error, last.engine_lost, last.preempted) == (
        "failed",
        "r1",
        "handed back",
        True,
        True,
    )
    assert core.counters["preempted"] == 1 and not core.preempting


def test_reports_carry_traffic_speculation_prefetches_and_a_last_report_says_why_the_engine_left():
    core = _engines()
    core.report(_load("d0", traffic={"de:low": 5}, speculative={"drafted": 3}, prefetch={"loaded": 2, "used": 1}))
    core.report(_load("d0"))  # nothing new: the last counts stand
    stats = core.stats()
    assert stats["traffic_bytes"] == {"d0": {"de:low": 5}} and stats["speculative"] == {"d0": {"drafted": 3}}
    assert (stats["prefetch"]["loaded"], stats["prefetch"]["used"]) == (2, 1)
    core.report(_load("d0", leaving=True))
    assert not core.engines["d0"].alive and "d0 is gone: it is stopping" in core.missing()[0]
