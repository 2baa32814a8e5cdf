"""The scheduling algorithms pinned on small hand-built states, and invariants checked on random ones."""
from hypothesis import given, settings, strategies as st

from dualpath.messages import Mode, ReadPath
from scheduler.baselines import LeastLoadedPolicy, RandomPolicy, RoundRobinPolicy
from scheduler.paper import DualPathPolicy, classify
from scheduler.policy import EngineState, NodeState, PathChoice, QueuedRequest, blocks_to_load, make_policy, split_path

BS = 64


def req(rid, n=1000, hit=640, reserve=None, node="dn", mode=Mode.DUALPATH):
    return QueuedRequest(rid, n, hit, reserve if reserve is not None else n + 100, node, mode)


def pe(eid, tok, node=None, beta=800):
    return EngineState(eid, node or f"n-{eid}", "g", tok=tok, beta=beta)


def test_algorithm1_prefers_c2_over_less_loaded_c3_and_skips_c1():
    engines = [pe("p0", 100), pe("p1", 50), pe("p2", 900)]
    nodes = {"n-p0": NodeState(10, 100), "n-p1": NodeState(500, 100), "n-p2": NodeState(0, 100),
             "dn": NodeState(0, 100)}
    pe_nodes = {e.engine_id: e.node_id for e in engines}
    c1, c2, c3 = classify(engines, nodes, pe_nodes)
    assert [e.engine_id for e in c1] == ["p2"] and [e.engine_id for e in c2] == ["p0"] and \
        [e.engine_id for e in c3] == ["p1"]
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
states = st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 5000), st.integers(0, 3000)), min_size=1,
                  max_size=6)
queues = st.lists(st.tuples(st.integers(1, 2000), st.integers(0, 100)), max_size=25)


@settings(max_examples=150, deadline=None)
@given(states, queues, st.sampled_from([DualPathPolicy, LeastLoadedPolicy, RoundRobinPolicy, RandomPolicy]))
def test_no_decode_engine_gets_more_than_its_free_memory(engine_specs, queue_specs, cls):
    engines = [de(f"d{i}", tok=t, free=f) for i, (t, _, f) in enumerate(engine_specs)]
    free = {e.engine_id: e.free_tokens for e in engines}
    queue = [req(f"r{i}", n=n, reserve=n + g) for i, (n, g) in enumerate(queue_specs)]
    out = cls().assign_decode(queue, [EngineState(**e.__dict__) for e in engines], {e.engine_id for e in engines})
    assert [rid for rid, _ in out] == [r.request_id for r in queue[:len(out)]]  # a FIFO prefix
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
    out = DualPathPolicy().assign_prefill(queue, [EngineState(**e.__dict__) for e in engines],
                                          set(pe_nodes), nodes, pe_nodes, BS)
    for d in out:
        assert tok[d.engine_id] <= beta[d.engine_id], "assigned to a C1 engine"
        tok[d.engine_id] += next(r.num_miss_tokens for r in queue if r.request_id == d.request_id)
    if len(out) < len(queue):  # the fetch stopped: every engine is overloaded
        assert all(tok[e] > beta[e] for e in tok)


# --- recomputing a stored prefix's slow tail ----------------------------------------------------------------------

def test_blocks_to_load_against_hand_computed_times():
    # 10 hit blocks (640 tokens), 64 new; the node reads 64 tokens/s (alpha = 3 s of it), the PE prefills 640/s.
    # Loading k blocks ends at 64k/64 = k s, computing the rest at (704 - 64k)/640 s: they cross at k = 1 (1 s),
    # where loading all ten would take 10 s.
    slow = dict(hit_blocks=10, block_size=64, miss_tokens=64, read_q=0, alpha=3 * 64, pe_tok=0, beta=5 * 640)
    assert blocks_to_load(**slow) == 1
    # a read queue of 100 s ahead: loading anything waits for it; computing all 704 tokens takes 1.1 s
    assert blocks_to_load(**{**slow, "read_q": 6400}) == 0
    # fast storage (64,000 tokens/s): load everything
    assert blocks_to_load(**{**slow, "alpha": 3 * 64_000}) == 10
    # the PE is 100 s behind: loading (10 s) ends long before it could compute anything
    assert blocks_to_load(**{**slow, "pe_tok": 64_000}) == 10
    # unknown rates: load everything (the paper's behaviour)
    assert blocks_to_load(**{**slow, "alpha": 0}) == blocks_to_load(**{**slow, "beta": 0}) == 10
    # a gain under 10%: the node reads 640 tokens/s, the PE computes 640/s and has 544 tokens to do first. Loading
    # all 10 blocks ends at 1.0 s; 9 blocks at max(0.9, (544 + 64)/640 = 0.95) = 0.95 s; 8 at 1.05 s -> load all
    near = dict(hit_blocks=10, block_size=64, miss_tokens=0, read_q=0, alpha=3 * 640, pe_tok=544, beta=5 * 640)
    assert blocks_to_load(**near) == 10
    assert blocks_to_load(**{**near, "pe_tok": 0}) == 5  # an idle PE: 5 blocks each way, 0.5 s


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 40), st.integers(0, 5000), st.integers(0, 20_000), st.integers(0, 30_000),
       st.integers(0, 30_000), st.integers(0, 20_000))
def test_blocks_to_load_is_the_best_count(hit_blocks, miss, read_q, alpha, pe_tok, beta):
    """Against a scan of every count: the chosen one ends the prefill soonest (or is all of them when the best
    saves under 10%)."""
    k = blocks_to_load(hit_blocks, BS, miss, read_q, alpha, pe_tok, beta)
    assert 0 <= k <= hit_blocks
    if not alpha or not beta:
        assert k == hit_blocks
        return

    def ends(n):
        load = (read_q + n * BS) / (alpha / 3) if n else 0.0
        return max(load, (pe_tok + miss + (hit_blocks - n) * BS) / (beta / 5))
    best = min(ends(n) for n in range(hit_blocks + 1))
    if k < hit_blocks:
        assert ends(k) <= best + 1e-9 and ends(k) <= 0.9 * ends(hit_blocks) + 1e-9
    else:
        assert best > 0.9 * ends(hit_blocks) - 1e-9 or ends(hit_blocks) <= best + 1e-9


def test_a_policy_that_recomputes_charges_the_reading_node_and_the_engine_for_what_it_does():
    nodes = {"n-p0": NodeState(0, 3 * 64), "dn": NodeState(0, 3 * 64)}
    engines = [pe("p0", 0, beta=5 * 640)]
    r = req("a", n=704, hit=640, mode=Mode.PE)
    policy = make_policy("dualpath", recompute_slow_hits=True)
    (d,) = policy.assign_prefill([r], engines, {"p0"}, nodes, {"p0": "n-p0"}, BS)
    assert d.path == PathChoice(ReadPath.PE, load_blocks=1)
    assert nodes["n-p0"].read_q == 64 and engines[0].tok == 64 + 576  # one block read; the miss + 9 blocks computed
    nodes, engines = {"n-p0": NodeState(0, 3 * 64), "dn": NodeState(0, 3 * 64)}, [pe("p0", 0, beta=5 * 640)]
    (d,) = make_policy("dualpath").assign_prefill([r], engines, {"p0"}, nodes, {"p0": "n-p0"}, BS)
    assert d.path == PathChoice(ReadPath.PE) and nodes["n-p0"].read_q == 640 and engines[0].tok == 64  # the paper's
