"""The policies' rules at the edges ``test_policy`` and ``test_policy_boundaries`` leave open (found by
``bench/mutation.py``): the recompute rule at its exact break-even point and at each rate's edge, a single hit block's
split, the decode prefix that sets Z, and the baselines' turns and draws."""

import pytest

from dualpath.core.messages import Mode, ReadPath
from dualpath.scheduler.baselines import LeastLoadedPolicy, RandomPolicy, RoundRobinPolicy
from dualpath.scheduler.paper import DualPathPolicy
from dualpath.scheduler.policy import (
    Affinity,
    EngineState,
    NodeState,
    PathChoice,
    QueuedRequest,
    add_read,
    blocks_to_load,
    preemption,
    preferred,
    prefetched_side,
    split_path,
    take_decode,
    take_prefill,
)

BASELINES = [LeastLoadedPolicy, RoundRobinPolicy, RandomPolicy]


def test_recompute_at_exactly_the_gain_and_load_just_past_it():
    """Reads at alpha / 3 = 100 tokens/s, prefill at beta / 5 = 100 tokens/s, 300 hit tokens: behind a queue of 100
    loading takes 4 s and computing 3 s, exactly 75% of it: recompute. A queue of 99 (3.99 s) tips it to loading."""
    assert blocks_to_load(3, 100, 0, 100, 300, 0, 500) == 0
    assert blocks_to_load(3, 100, 0, 99, 300, 0, 500) == 3
    # 50 new tokens behind 100 queued on the engine: loading ends at (200 + 200) / 100 + 150 / 100 = 5.5 s, computing
    # at 350 / 100 = 3.5 s, under 75% of it
    assert blocks_to_load(2, 100, 50, 200, 300, 100, 500) == 0


def test_the_slowest_known_rates_still_decide():
    """A rate of 1 is known (only 0 is unknown): a node reading a token in 3 s, or a device prefilling one in 5 s,
    behind a long read queue, recomputes even a single hit block."""
    assert blocks_to_load(1, 16, 0, 1000, 1, 0, 5) == 0
    assert blocks_to_load(1, 16, 0, 1000, 3, 0, 1) == 0
    assert blocks_to_load(1, 100, 0, 200, 300, 0, 500) == 0


def test_split_with_no_whole_hit_block_reads_on_the_prefill_side_and_one_block_can_go_either_way():
    r0 = QueuedRequest("a", 100, 0, 200)
    assert split_path(r0, 0, 500, 64) == PathChoice(ReadPath.PE)
    r1 = QueuedRequest("b", 100, 64, 200)
    assert split_path(r1, 500, 0, 64) == PathChoice(ReadPath.DE)  # the prefill side's queue is the longer
    assert split_path(r1, 0, 500, 64) == PathChoice(ReadPath.PE)


def _decode_engines():
    # A is idle by seq, B by tok: the head goes to A when A stays under Z (tok 100 + 10 <= Z), else to B
    return [
        EngineState("A", "n", "g", seq=0, tok=100, free_tokens=1000),
        EngineState("B", "n", "g", seq=5, tok=0, free_tokens=1000),
    ]


def test_z_counts_the_reserves_of_the_prefix_cumulatively():
    """Free memory 2,000: reserves of 800 fit twice, not three times, so Z = 1.05 x (10 + 10 + 100) / 2 = 63 keeps
    A (110) over it; counting a third request (100 more tokens) would put A under."""
    queue = [QueuedRequest("r1", 10, 0, 800), QueuedRequest("r2", 10, 0, 800), QueuedRequest("r3", 100, 0, 800)]
    out = DualPathPolicy().assign_decode(queue, _decode_engines(), {"A", "B"})
    assert out[0] == ("r1", "B")


def test_z_counts_no_free_memory_of_a_full_engine():
    """C's memory is full: the group's free memory is 2,000, which the first two reserves fill, so the third
    (300 tokens) is not in Z = 1.05 x (10 + 10 + 100) / 3 = 42, and A stays over it."""
    engines = _decode_engines() + [EngineState("C", "n", "g", seq=9, tok=0, free_tokens=0)]
    queue = [QueuedRequest("r1", 10, 0, 1000), QueuedRequest("r2", 10, 0, 1000), QueuedRequest("r3", 300, 0, 1)]
    out = DualPathPolicy().assign_decode(queue, engines, {"A", "B", "C"})
    assert out[0] == ("r1", "B")


@pytest.mark.parametrize("cls", BASELINES)
def test_a_baseline_charges_the_prefill_engines_node_and_splits_by_the_block_size(cls):
    """A split read of 4 hit blocks of 16 tokens between two empty queues: 2 blocks (32 tokens) on each node."""
    policy, nodes = cls(), {}
    engines = [EngineState("p0", "n-p0", "g")]
    r = QueuedRequest("a", 100, 64, 200, "n-de", Mode.SPLIT)
    (d,) = policy.assign_prefill([r], engines, {"p0"}, nodes, {"p0": "n-p0"}, 16)
    assert (d.engine_id, d.path) == ("p0", PathChoice(ReadPath.DE, 2))
    assert (nodes["n-p0"].read_q, nodes["n-de"].read_q, engines[0].tok) == (32, 32, 36)
    assert set(nodes) == {"n-p0", "n-de"}


@pytest.mark.parametrize("cls", BASELINES)
def test_a_baseline_with_no_engine_or_group_places_nothing(cls):
    r = QueuedRequest("a", 100, 0, 200)
    assert cls().assign_prefill([r], [], set(), {}, {}, 16) == []
    assert cls().assign_decode([r], [], set()) == []
    assert cls().route_decode_group(r, {}) is None


def test_least_loaded_prefills_on_the_engine_with_the_fewest_tokens_first_id_on_ties():
    engines = [
        EngineState("p0", "n0", "g", tok=100),
        EngineState("p1", "n1", "g", tok=50),
        EngineState("p2", "n2", "g"),
    ]
    queue = [QueuedRequest(f"r{i}", 60, 0, 100) for i in range(3)]
    out = LeastLoadedPolicy().assign_prefill(
        queue, engines, {"p0", "p1", "p2"}, {}, {"p0": "n0", "p1": "n1", "p2": "n2"}, 16
    )
    assert [d.engine_id for d in out] == ["p2", "p1", "p2"]  # 0, then 50 < 60, then 60 < 100


@pytest.mark.parametrize("cls", BASELINES)
def test_a_baseline_places_a_reply_on_an_engine_with_exactly_its_reserve_free(cls):
    engines = [EngineState("d0", "n", "g", free_tokens=200)]
    assert cls().assign_decode([QueuedRequest("a", 100, 0, 200)], engines, {"d0"}) == [("a", "d0")]
    assert engines[0].free_tokens == 0


def test_round_robin_skips_an_engine_without_room_to_the_next_in_turn_and_waits_for_one_not_pulling():
    rr = RoundRobinPolicy()
    engines = [EngineState(f"d{i}", "n", "g", free_tokens=1000) for i in range(3)]
    small, big = QueuedRequest("s", 10, 0, 10), QueuedRequest("b", 10, 0, 600)
    assert rr.assign_decode([small], engines, {"d0", "d1", "d2"}) == [("s", "d0")]
    engines[1].free_tokens = 100  # d1, next in turn, has no room for b: d2 (not d0) takes it
    assert rr.assign_decode([big], engines, {"d0", "d1", "d2"}) == [("b", "d2")]
    # d0's turn: a pull by d1 alone leaves it waiting, and the turn stays with d0
    assert rr.assign_decode([small], engines, {"d1"}) == []
    assert rr.assign_decode([small], engines, {"d0"}) == [("s", "d0")]


def test_random_is_seeded_and_keeps_a_draw_until_its_engine_pulls():
    engines = [EngineState(f"d{i}", "n", "g", free_tokens=10_000) for i in range(4)]
    queue = [QueuedRequest(f"r{i}", 10, 0, 10) for i in range(30)]
    everyone = {e.engine_id for e in engines}
    default = RandomPolicy().assign_decode(queue, [EngineState(**vars(e)) for e in engines], everyone)
    assert default == RandomPolicy(seed=0).assign_decode(queue, [EngineState(**vars(e)) for e in engines], everyone)
    assert default != RandomPolicy(seed=1).assign_decode(queue, [EngineState(**vars(e)) for e in engines], everyone)
    policy = RandomPolicy(seed=5)
    drawn = None
    for _ in range(10):  # pulls by the other engines: the draw stands
        assert policy.assign_decode(queue[:1], engines, set()) == []
        (eid,) = policy._drawn.values()
        assert drawn in (None, eid)
        drawn = eid
    assert policy.assign_decode(queue[:1], engines, {drawn}) == [("r0", drawn)] and policy._drawn == {}


def test_round_robin_alternates_the_read_path_starting_on_the_prefill_side():
    policy, r = RoundRobinPolicy(), QueuedRequest("a", 100, 64, 200)
    paths = [policy.choose_path(r, NodeState(), NodeState(), Mode.DUALPATH, 16).path for _ in range(4)]
    assert paths == [ReadPath.PE, ReadPath.DE, ReadPath.PE, ReadPath.DE]


def test_random_forgets_the_draws_of_the_requests_it_placed():
    """A request's draw is kept only until its engine pulls: once placed (decode, then prefill) none is left."""
    policy = RandomPolicy(seed=3)
    queue = [QueuedRequest(f"r{i}", 100, 0, 10, "n-de") for i in range(6)]
    decode = [EngineState(f"d{i}", "n-de", "g", free_tokens=1000) for i in range(2)]
    prefill = [EngineState(f"p{i}", f"n-p{i}", "g") for i in range(2)]
    assert len(policy.assign_decode(queue, decode, {"d0", "d1"})) == 6
    out = policy.assign_prefill(queue, prefill, {"p0", "p1"}, {}, {"p0": "n-p0", "p1": "n-p1"}, 16)
    assert len(out) == 6 and policy._drawn == {}
    # a draw naming an engine of another group waits for that engine's pull, kept
    assert policy.assign_prefill(queue[:1], prefill, {"nobody"}, {}, {"p0": "n-p0", "p1": "n-p1"}, 16) == []
    assert list(policy._drawn) == [("prefill", "r0")]


def test_preemption_skips_an_engine_with_no_reply_running():
    assert preemption(100, 0, {"d0": 0}, {}) == ("", [])


def test_placements_add_to_what_engines_and_nodes_already_hold():
    e = EngineState("d0", "n", "g", seq=3, tok=100, free_tokens=1000)
    r = QueuedRequest("a", 50, 32, 80)
    take_decode(e, r)
    assert (e.seq, e.tok, e.free_tokens) == (4, 150, 920)
    take_prefill(e, r)
    assert (e.seq, e.tok) == (5, 168)  # its 18 missing tokens
    take_prefill(e, r, recomputed=16)
    assert (e.seq, e.tok) == (6, 202)
    pn, dn = NodeState(read_q=10, recent_read=5.0), NodeState(read_q=20, recent_read=7.0)
    add_read(PathChoice(ReadPath.DE, 2), QueuedRequest("b", 100, 64, 200), pn, dn, 16)  # 2 of 4 blocks each side
    assert (pn.read_q, pn.recent_read, dn.read_q, dn.recent_read) == (42, 37.0, 52, 39.0)
    assert PathChoice(ReadPath.PE, load_blocks=2).loaded_tokens(QueuedRequest("c", 100, 64, 200), 16) == 32


def test_the_recompute_rule_reads_the_queue_of_the_side_that_would_read():
    """One node slow (a long read queue behind 30 tokens/s), the other fast: a request read on the slow side is
    recomputed, on the fast side loaded, whichever side the slow one is."""
    slow, fast = NodeState(read_q=10_000, alpha=90), NodeState(alpha=300_000)
    policy = DualPathPolicy()
    policy.recompute_slow_hits = True
    for mode, pe_node, de_node, load in (
        (Mode.PE, slow, fast, 0),
        (Mode.PE, fast, slow, -1),
        (Mode.DE, slow, fast, -1),
        (Mode.DE, fast, slow, 0),
    ):
        nodes = {"n-pe": NodeState(**vars(pe_node)), "n-de": NodeState(**vars(de_node))}
        e = EngineState("p0", "n-pe", "g", measured_beta=5000)
        d = policy.place_prefill(QueuedRequest("a", 200, 128, 300, "n-de", mode), e, nodes, "n-pe", 64)
        assert d.path.load_blocks == load, (mode, pe_node is slow)


def test_a_turn_prefers_its_prefetch_then_on_decode_its_last_engine():
    pool = [EngineState(i, "n", "g") for i in ("p0", "p1", "d0", "d1")]
    by_id = {e.engine_id: e for e in pool}

    def turn(**affinity):
        return QueuedRequest("r", 100, 64, 200, affinity=Affinity(**affinity))

    assert preferred(turn(prefetch_engine="p1", prefetch_blocks=1), pool, True, "pe") is by_id["p1"]
    assert preferred(turn(prefetch_engine="d1", prefetch_blocks=1, de="d0"), pool, True, "de") is by_id["d1"]
    assert preferred(turn(prefetch_engine="p1"), pool, True, "pe") is None  # no block prefetched: no preference
    assert preferred(turn(de="d0"), pool, True, "de") is by_id["d0"]
    assert preferred(turn(de="d0"), pool, False, "de") is None  # not sticky
    assert preferred(turn(de="d0"), pool, True, "pe") is None  # the last decode engine means nothing to prefill
    assert preferred(QueuedRequest("r", 100, 64, 200), pool, True, "de") is None
    assert prefetched_side(turn(prefetch_engine="p0"), "p0") is None  # nothing prefetched there


def test_a_turn_reads_a_prefetch_held_by_its_prefill_engine_on_that_side():
    nodes = {"n0": NodeState(), "n2": NodeState()}
    r = QueuedRequest(
        "r", 256, 192, 300, "n2", Mode.DUALPATH, "d0", Affinity(pe="p1", prefetch_engine="p1", prefetch_blocks=2)
    )
    d = DualPathPolicy().place_prefill(r, EngineState("p1", "n0", "g"), nodes, "n0", 64)
    assert d.path == PathChoice(ReadPath.PE) and (nodes["n0"].read_q, nodes["n2"].read_q) == (64, 0)


def test_a_turn_keeps_its_decode_group_at_exactly_the_slack():
    r = QueuedRequest("r", 10, 0, 20, affinity=Affinity(de="d1", de_group="g1"))
    assert DualPathPolicy().route_decode_group(r, {"g0": 900, "g1": 1050, "g2": 1050}) == "g1"  # 1.05 x 1000
