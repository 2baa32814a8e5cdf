"""The scheduling algorithms pinned on small hand-built states, and invariants checked on random ones."""

from hypothesis import given, settings, strategies as st

from dualpath.core.messages import Mode, ReadPath
from dualpath.scheduler.baselines import LeastLoadedPolicy, RandomPolicy, RoundRobinPolicy
from dualpath.scheduler.paper import DualPathPolicy, classify
from dualpath.scheduler.policy import (
    EngineState,
    NodeState,
    PathChoice,
    QueuedRequest,
    blocks_to_load,
    split_path,
)
from dualpath.scheduler.policies import make_policy

BS = 64


def req(rid, n=1000, hit=640, reserve=None, node="dn", mode=Mode.DUALPATH):
    return QueuedRequest(rid, n, hit, reserve if reserve is not None else n + 100, node, mode)


def pe(eid, tok, node=None, beta=800):
    return EngineState(eid, node or f"n-{eid}", "g", tok=tok, beta=beta)


def test_algorithm1_prefers_c2_over_less_loaded_c3_and_skips_c1():
    engines = [pe("p0", 100), pe("p1", 50), pe("p2", 900)]
    nodes = {
        "n-p0": NodeState(10, 100),
        "n-p1": NodeState(500, 100),
        "n-p2": NodeState(0, 100),
        "dn": NodeState(0, 100),
    }
    pe_nodes = {e.engine_id: e.node_id for e in engines}
    c1, c2, c3 = classify(engines, nodes, pe_nodes)
    assert (
        [e.engine_id for e in c1] == ["p2"]
        and [e.engine_id for e in c2] == ["p0"]
        and [e.engine_id for e in c3] == ["p1"]
    )
    out = DualPathPolicy().assign_prefill([req("a", n=400, hit=0)], engines, {"p0", "p1", "p2"}, nodes, pe_nodes, BS)
    assert [(d.request_id, d.engine_id) for d in out] == [("a", "p0")]


def test_algorithm1_reclassifies_after_each_assignment_and_stops_when_all_overloaded():
    engines = [pe("p0", 100), pe("p1", 50)]
    nodes = {"n-p0": NodeState(0, 1000), "n-p1": NodeState(5000, 1000), "dn": NodeState(0, 1000)}
    pe_nodes = {e.engine_id: e.node_id for e in engines}
    queue = [req("a", n=800, hit=0), req("b", n=100, hit=0), req("c", n=900, hit=0), req("d", n=10, hit=0)]
    out = DualPathPolicy().assign_prefill(queue, engines, {"p0", "p1"}, nodes, pe_nodes, BS)
    # a -> p0 (C2); p0 now 900 > β: C1. b -> p1 (C3, the only one left); p1 = 150. c -> p1 (1050 > β after).
    # d: both overloaded -> the fetch stops.
    assert [(d.request_id, d.engine_id) for d in out] == [("a", "p0"), ("b", "p1"), ("c", "p1")]


def test_algorithm1_only_assigns_pulling_engines():
    engines = [pe("p0", 0), pe("p1", 0)]
    nodes = {"n-p0": NodeState(0, 10), "n-p1": NodeState(0, 10), "dn": NodeState()}
    pe_nodes = {e.engine_id: e.node_id for e in engines}
    out = DualPathPolicy().assign_prefill([req("a", hit=0), req("b", hit=0)], engines, {"p1"}, nodes, pe_nodes, BS)
    assert {d.engine_id for d in out} == {"p1"}


def de(eid, tok=0, seq=0, free=10_000):
    return EngineState(eid, f"n-{eid}", "dg", seq=seq, tok=tok, free_tokens=free)


def test_decode_phase2_prefers_fewest_seq_under_z_else_least_tok():
    # R = all three requests (they fit); Z = 1.05 * (3 * 1000 + 0 + 3000 + 3000) / 3 = 3150
    engines = [de("d0", tok=0, seq=5), de("d1", tok=3000, seq=1), de("d2", tok=3000, seq=2)]
    queue = [req("a", n=1000, reserve=1100), req("b", n=1000, reserve=1100), req("c", n=1000, reserve=1100)]
    out = DualPathPolicy().assign_decode(queue, engines, {"d0", "d1", "d2"})
    # a: only d0 stays under Z (d1, d2 would reach 4000) -> d0. b: d0 at 1000 -> 2000 <= Z -> d0 (seq 6 but only
    # candidate). c: d0 would reach 3000 <= 3150 -> d0.
    assert out == [("a", "d0"), ("b", "d0"), ("c", "d0")]
    # Z = 1.05 * (10 + 2000) / 2 = 1055: both stay under with 1010 -> the fewest seq wins, not the least tok
    engines = [de("d0", tok=990, seq=3), de("d1", tok=1000, seq=1)]
    out = DualPathPolicy().assign_decode([req("a", n=10, reserve=60)], engines, {"d0", "d1"})
    assert out == [("a", "d1")]


def test_decode_respects_free_memory_and_stops_when_nothing_fits():
    engines = [de("d0", free=1500), de("d1", free=500)]
    queue = [req("a", n=1000, reserve=1200), req("b", n=1000, reserve=1200), req("c", n=10, reserve=20)]
    out = DualPathPolicy().assign_decode(queue, engines, {"d0", "d1"})
    assert out == [("a", "d0")]  # b fits nowhere: the pull stops (FIFO), c waits behind it


def test_phase1_routes_to_the_least_loaded_group():
    assert DualPathPolicy().route_decode_group(req("a"), {"g1": 500, "g0": 100, "g2": 100}) == "g0"


def test_read_path_is_the_shorter_queue_and_split_divides_the_hit():
    p = DualPathPolicy()
    r = req("a", n=2000, hit=1280)
    assert p.choose_path(r, NodeState(10), NodeState(20), Mode.DUALPATH, BS).path is ReadPath.PE
    assert p.choose_path(r, NodeState(30), NodeState(20), Mode.DUALPATH, BS).path is ReadPath.DE
    assert p.choose_path(r, NodeState(0), NodeState(0), Mode.DE, BS).path is ReadPath.DE
    # equal queues: half the 20 hit blocks on each side
    assert split_path(r, 0, 0, BS) == PathChoice(ReadPath.DE, 10)
    # the PE side already has 640 tokens queued: it takes 320 fewer tokens (5 blocks fewer)
    assert split_path(r, 640, 0, BS) == PathChoice(ReadPath.DE, 5)
    assert split_path(r, 0, 5000, BS) == PathChoice(ReadPath.PE)
    assert split_path(r, 5000, 0, BS) == PathChoice(ReadPath.DE)


def test_round_robin_and_random_baselines():
    rr = RoundRobinPolicy()
    engines = [de("d0"), de("d1"), de("d2")]
    picks = [rr.assign_decode([req(f"r{i}", reserve=10)], engines, {"d0", "d1", "d2"})[0][1] for i in range(4)]
    assert picks == ["d0", "d1", "d2", "d0"]
    assert [rr.route_decode_group(req("x"), {"a": 0, "b": 0}) for _ in range(3)] == ["a", "b", "a"]
    rnd = RandomPolicy(seed=1)
    out = rnd.assign_decode([req(f"r{i}", reserve=10) for i in range(30)], engines, {"d0", "d1", "d2"})
    assert {e for _, e in out} == {"d0", "d1", "d2"}


# --- invariants on random states ------------------------------------------------------------------------------
states = st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 5000), st.integers(0, 3000)), min_size=1, max_size=6)
queues = st.lists(st.tuples(st.integers(1, 2000), st.integers(0, 100)), max_size=25)


@settings(max_examples=150, deadline=None)
@given(states, queues, st.sampled_from([DualPathPolicy, LeastLoadedPolicy, RoundRobinPolicy, RandomPolicy]))
def test_no_decode_engine_gets_more_than_its_free_memory(engine_specs, queue_specs, cls):
    engines = [de(f"d{i}", tok=t, free=f) for i, (t, _, f) in enumerate(engine_specs)]
    free = {e.engine_id: e.free_tokens for e in engines}
    queue = [req(f"r{i}", n=n, reserve=n + g) for i, (n, g) in enumerate(queue_specs)]
    out = cls().assign_decode(queue, [EngineState(**e.__dict__) for e in engines], {e.engine_id for e in engines})
    assert [rid for rid, _ in out] == [r.request_id for r in queue[: len(out)]]  # a FIFO prefix
    used = {}
    for rid, eid in out:
        used[eid] = used.get(eid, 0) + next(r.reserve_tokens for r in queue if r.request_id == rid)
    assert all(used[e] <= free[e] for e in used)


@settings(max_examples=150, deadline=None)
@given(states, queues)
def test_algorithm1_never_gives_work_to_an_overloaded_engine(engine_specs, queue_specs):
    engines = [pe(f"p{i}", tok=t, beta=b + 1) for i, (t, b, _) in enumerate(engine_specs)]
    nodes = {e.node_id: NodeState(q, 1500) for e, (_, _, q) in zip(engines, engine_specs)}
    nodes["dn"] = NodeState(0, 1500)
    pe_nodes = {e.engine_id: e.node_id for e in engines}
    queue = [req(f"r{i}", n=n + 1, hit=0) for i, (n, _) in enumerate(queue_specs)]
    tok = {e.engine_id: e.tok for e in engines}
    beta = {e.engine_id: e.beta for e in engines}
    out = DualPathPolicy().assign_prefill(
        queue, [EngineState(**e.__dict__) for e in engines], set(pe_nodes), nodes, pe_nodes, BS
    )
    for d in out:
        assert tok[d.engine_id] <= beta[d.engine_id], "assigned to a C1 engine"
        tok[d.engine_id] += next(r.num_miss_tokens for r in queue if r.request_id == d.request_id)
    if len(out) < len(queue):  # the fetch stopped: every engine is overloaded
        assert all(tok[e] > beta[e] for e in tok)


# --- recomputing a stored prefix's slow tail ----------------------------------------------------------------------


def test_blocks_to_load_against_hand_computed_times():
    # 10 hit blocks (640 tokens), 64 new; the node reads 64 tokens/s (alpha = 3 s of it), the PE prefills 640/s.
    # Loading ends at 640/64 + 64/640 = 10.1 s, computing everything at 704/640 = 1.1 s: recompute it all.
    slow = dict(hit_blocks=10, block_size=64, miss_tokens=64, read_q=0, alpha=3 * 64, pe_tok=0, beta=5 * 640)
    assert blocks_to_load(**slow) == 0
    # fast storage (64,000 tokens/s): 0.11 s against 1.1 s: load
    assert blocks_to_load(**{**slow, "alpha": 3 * 64_000}) == 10
    # the PE is 100 s behind: 110.1 s against 101.1 s, under the 25% the estimates need: load
    assert blocks_to_load(**{**slow, "pe_tok": 64_000}) == 10
    # fast storage with a read queue of 100 s ahead: 100.1 s against 1.1 s: recompute
    assert blocks_to_load(**{**slow, "alpha": 3 * 64_000, "read_q": 6_400_000}) == 0
    # unknown rates: load everything (the paper's behaviour)
    assert blocks_to_load(**{**slow, "alpha": 0}) == blocks_to_load(**{**slow, "beta": 0}) == 10
    # reads at 640/s, prefill at 512/s: loading (1.0 s) beats computing (1.25 s)
    assert (
        blocks_to_load(hit_blocks=10, block_size=64, miss_tokens=0, read_q=0, alpha=3 * 640, pe_tok=0, beta=5 * 512)
        == 10
    )
    assert blocks_to_load(0, 64, 100, 0, 1, 0, 1) == 0  # no hit: nothing to decide


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 40),
    st.integers(0, 5000),
    st.integers(0, 20_000),
    st.integers(0, 30_000),
    st.integers(0, 30_000),
    st.integers(0, 20_000),
    st.integers(1, 50_000),
)
def test_blocks_to_load_is_all_or_nothing_and_recomputes_only_what_is_sooner(
    hit_blocks, miss, read_q, alpha, pe_tok, beta, more_queue
):
    k = blocks_to_load(hit_blocks, BS, miss, read_q, alpha, pe_tok, beta)
    assert k in (0, hit_blocks)
    if k == 0 and hit_blocks:
        load_all = (read_q + hit_blocks * BS) / (alpha / 3) + (pe_tok + miss) / (beta / 5)
        assert (pe_tok + miss + hit_blocks * BS) / (beta / 5) < load_all
        # a longer read queue never turns a recompute back into a load
        assert blocks_to_load(hit_blocks, BS, miss, read_q + more_queue, alpha, pe_tok, beta) == 0


def test_a_policy_that_recomputes_charges_the_reading_node_and_the_engine_for_what_it_does():
    def engine():
        return [EngineState("p0", "n-p0", "g", beta=5 * 640, measured_beta=5 * 640)]

    r = req("a", n=704, hit=640, mode=Mode.PE)
    nodes, engines = {"n-p0": NodeState(0, 3 * 64), "dn": NodeState(0, 3 * 64)}, engine()
    (d,) = make_policy("dualpath", recompute_slow_hits=True).assign_prefill(
        [r], engines, {"p0"}, nodes, {"p0": "n-p0"}, BS
    )
    assert d.path == PathChoice(ReadPath.PE, load_blocks=0)
    assert nodes["n-p0"].read_q == 0 and engines[0].tok == 704  # nothing read; the whole prompt computed
    nodes, engines = {"n-p0": NodeState(0, 3 * 64), "dn": NodeState(0, 3 * 64)}, engine()
    (d,) = make_policy("dualpath").assign_prefill([r], engines, {"p0"}, nodes, {"p0": "n-p0"}, BS)
    assert d.path == PathChoice(ReadPath.PE) and nodes["n-p0"].read_q == 640 and engines[0].tok == 64  # the paper's
    engines = [EngineState("p0", "n-p0", "g", beta=5 * 640)]  # no measured rate yet: load, whatever beta says
    (d,) = make_policy("dualpath", recompute_slow_hits=True).assign_prefill(
        [r], engines, {"p0"}, {"n-p0": NodeState(0, 3 * 64), "dn": NodeState(0, 3 * 64)}, {"p0": "n-p0"}, BS
    )
    assert d.path == PathChoice(ReadPath.PE)


def test_preemption_ends_the_fewest_least_urgent_latest_replies_on_one_engine():
    """vLLM's order: the least urgent reply first, the latest submitted among equals; only replies less urgent than
    the waiting one, on the engine where the fewest make room, and none when an engine already has room."""
    from dualpath.scheduler.policy import Running, preemption

    running = {
        "d0": [Running("a", 5, 0, 300), Running("b", 5, 1, 100), Running("c", 0, 2, 900)],
        "d1": [Running("x", 1, 3, 200), Running("y", 2, 4, 200), Running("u", -1, 5, 900)],
    }
    # d0: b (latest of rank 5) then a frees 400 of 500 needed: not enough; d1: y then x frees 400 + 100 free
    assert preemption(500, 0, {"d0": 50, "d1": 100}, running) == ("d1", ["y", "x"])
    assert preemption(150, 0, {"d0": 50, "d1": 0}, running) == ("d0", ["b"])  # d1's y would too: the first wins ties
    assert preemption(300, 0, {"d0": 50, "d1": 0}, running) == ("d0", ["b", "a"])
    assert preemption(300, 0, {"d0": 0, "d1": 150}, running) == ("d1", ["y"])  # one victim on d1 beats two on d0
    assert preemption(300, 5, {"d0": 0, "d1": 0}, running) == ("", [])  # nothing is less urgent than rank 5
    assert preemption(100, 0, {"d0": 100, "d1": 0}, running) == ("", [])  # d0 has room: nothing needs ending
    assert preemption(5000, -9, {"d0": 0, "d1": 0}, running) == ("", [])  # ending everything would not make room
