"""The paper's rules at their boundary values, on hand-built states: each test names the comparison it pins (``<=``
against ``<``, which queue Z sums, which side a tie goes to), so that turning one comparison around fails here."""

from dualpath.core.messages import Mode, ReadPath
from dualpath.scheduler.paper import DualPathPolicy, classify
from dualpath.scheduler.policy import EngineState, NodeState, QueuedRequest, shorter_queue

BS = 64


def req(rid, n, hit=0, reserve=None):
    return QueuedRequest(rid, n, hit, n if reserve is None else reserve, "dn", Mode.DUALPATH)


def pe(eid, tok, beta):
    return EngineState(eid, f"n-{eid}", "g", tok=tok, beta=beta)


def de(eid, tok=0, seq=0, free=10_000):
    return EngineState(eid, f"n-{eid}", "dg", seq=seq, tok=tok, free_tokens=free)


def ids(engines):
    return [e.engine_id for e in engines]


# --- Algorithm 1: C1 = {tok > β}, C2 = {read_q <= α, tok <= β}, C3 = {read_q > α, tok <= β} -------------------
def test_an_engine_at_exactly_beta_is_not_overloaded_and_one_past_it_is():
    engines = [pe("at", 800, 800), pe("past", 801, 800)]
    c1, c2, _ = classify(
        engines, {"n-at": NodeState(0, 100), "n-past": NodeState(0, 100)}, {"at": "n-at", "past": "n-past"}
    )
    assert ids(c1) == ["past"] and ids(c2) == ["at"]


def test_a_node_whose_read_queue_is_exactly_alpha_is_c2_and_one_past_it_c3():
    engines = [pe("at", 500, 800), pe("past", 0, 800)]
    nodes = {"n-at": NodeState(100, 100), "n-past": NodeState(101, 100)}
    _, c2, c3 = classify(engines, nodes, {"at": "n-at", "past": "n-past"})
    assert ids(c2) == ["at"] and ids(c3) == ["past"]
    # so the C2 engine gets the request although the C3 one has fewer tokens
    (d,) = DualPathPolicy().assign_prefill(
        [req("a", 10)], engines, {"at", "past"}, nodes, {"at": "n-at", "past": "n-past"}, BS
    )
    assert d.engine_id == "at"


def test_equal_tokens_in_c2_go_to_the_first_engine_id():
    engines = [pe("p1", 100, 800), pe("p0", 100, 800)]
    nodes = {"n-p0": NodeState(0, 100), "n-p1": NodeState(0, 100)}
    (d,) = DualPathPolicy().assign_prefill(
        [req("a", 10)], engines, {"p0", "p1"}, nodes, {"p0": "n-p0", "p1": "n-p1"}, BS
    )
    assert d.engine_id == "p0"


# --- decode phase 2 --------------------------------------------------------------------------------------------
def test_z_sums_the_prefix_that_fits_not_the_whole_queue():
    """R is the queue's longest prefix that fits the group's free memory: a huge request behind it must not raise
    Z. Here R = [a] (b's reserve does not fit beside it): Z = 1.05 (50 + 100) / 2 = 78.75, so d0 (100 + 50) is over
    it and d1 (0 + 50) under: d1. Summing b's 10,000 tokens too would put both under Z and pick d0 (fewest seq)."""
    engines = [de("d0", tok=100, seq=0, free=1000), de("d1", tok=0, seq=5, free=1000)]
    queue = [req("a", 50, reserve=1000), req("b", 10_000, reserve=1500)]
    out = DualPathPolicy().assign_decode(queue, engines, {"d0", "d1"})
    assert out[0] == ("a", "d1")


def test_a_request_whose_reserve_exactly_fills_the_free_memory_is_in_the_prefix():
    """fitting + reserve <= free: b fills the group's memory to the token, so R = [a, b] and
    Z = (10 + 1000 + 5 + 0) / 2 = 507.5 (z_factor 1): a stays under it on the fewest-seq d0. Without b in R,
    Z = 7.5, both engines go over it and a goes to the least-tok d1."""
    engines = [de("d0", tok=5, seq=0, free=1000), de("d1", tok=0, seq=4, free=1000)]
    queue = [req("a", 10, reserve=1000), req("b", 1000, reserve=1000)]
    out = DualPathPolicy(z_factor=1.0).assign_decode(queue, engines, {"d0", "d1"})
    assert out[0] == ("a", "d0")


def test_an_engine_landing_exactly_on_z_is_under_it():
    """tok + len <= Z. Four engines, z_factor 1, a request of 10: Z = (10 + 10 + 0 + 30 + 30) / 4 = 20 exactly.
    x (10 + 10 = 20) is under Z with the fewest seq and wins; with ``<`` only y would be under, and y would win."""
    engines = [de("x", tok=10, seq=0), de("y", tok=0, seq=5), de("w1", tok=30, seq=9), de("w2", tok=30, seq=9)]
    out = DualPathPolicy(z_factor=1.0).assign_decode([req("a", 10, reserve=10)], engines, {"x", "y", "w1", "w2"})
    assert out == [("a", "x")]


def test_an_engine_with_exactly_the_reserve_free_has_room():
    engines = [de("exact", free=100), de("short", tok=0, free=99)]
    assert DualPathPolicy().assign_decode([req("a", 50, reserve=100)], engines, {"exact", "short"}) == [("a", "exact")]


# --- the read path -----------------------------------------------------------------------------------------------
def test_equal_read_queues_go_to_the_side_that_read_less_lately_and_a_full_tie_to_the_prefill_side():
    r = req("a", 2000, hit=1280)
    assert shorter_queue(r, NodeState(5, 0, 0.0), NodeState(5, 0, 0.0)).path is ReadPath.PE
    assert shorter_queue(r, NodeState(5, 0, 10.0), NodeState(5, 0, 0.0)).path is ReadPath.DE
    assert shorter_queue(r, NodeState(5, 0, 0.0), NodeState(5, 0, 10.0)).path is ReadPath.PE
    # the queue decides before the recent reads do
    assert shorter_queue(r, NodeState(4, 0, 1e9), NodeState(5, 0, 0.0)).path is ReadPath.PE
    assert shorter_queue(r, NodeState(6, 0, 0.0), NodeState(5, 0, 1e9)).path is ReadPath.DE
    p = DualPathPolicy()
    assert p.choose_path(r, NodeState(7), NodeState(7), Mode.DUALPATH, BS).path is ReadPath.PE
