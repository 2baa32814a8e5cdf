"""The simulator's bandwidth sharing: completion times computed by hand for small scenarios."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.sim.hardware import PAPER_NODE
from dualpath.sim.links import DE_PATH, PE_PATH, cluster_links, path_route
from dualpath.sim.network import FlowNetwork

GB = 1e9


def run(net: FlowNetwork) -> dict[str, float]:
    finished = {}
    while net.flows:
        t, _ = net.next_completion()
        for fid in net.advance(t):
            finished[fid] = t
    return finished


def test_two_flows_share_a_link_then_one_has_it_alone():
    net = FlowNetwork({"a": 100.0})
    net.add("x", 100, (("a", 1),))
    net.add("y", 300, (("a", 1),))
    assert run(net) == {"x": pytest.approx(2.0), "y": pytest.approx(4.0)}  # 50/s each, then y alone at 100/s


def test_max_min_fairness_gives_the_unconstrained_flow_the_rest():
    net = FlowNetwork({"a": 100.0, "b": 10.0})
    net.add("long", 90, (("a", 1),))
    net.add("narrow", 10, (("a", 1), ("b", 1)))  # held to 10/s by b; long gets the other 90/s of a
    assert run(net) == {"long": pytest.approx(1.0), "narrow": pytest.approx(1.0)}
    assert net.carried["a"] == pytest.approx(100) and net.carried["b"] == pytest.approx(10)


def test_a_flow_that_arrives_later_slows_the_first():
    net = FlowNetwork({"a": 10.0})
    net.add("first", 30, (("a", 1),))
    net.advance(1.0)  # 10 moved, 20 left
    net.add("second", 10, (("a", 1),))  # now 5/s each: second ends at t=3, first has 10 left, ends at t=4
    assert run(net) == {"second": pytest.approx(3.0), "first": pytest.approx(4.0)}


def test_one_pe_path_read_is_held_by_its_gpu_cnic_read_side():
    """Idle paper node: the prefill GPU's CNIC reads each byte twice (loopback into HBM, then out to decode), and
    the decode GPU's CNIC writes it twice (into the buffer, then into HBM): 50 GB/s / 2 = 25 GB/s; 1 GB in 40 ms."""
    net = FlowNetwork(cluster_links(PAPER_NODE, ["p0", "d0"]))
    net.add("r", 1 * GB, path_route(PE_PATH, ("p0", 0), ("d0", 0)))
    assert run(net)["r"] == pytest.approx(0.04)


def test_eight_pe_reads_on_one_node_share_its_storage_nic():
    """Eight GPUs each loading 1 GB: the node's 50 GB/s SNIC gives each 6.25 GB/s, below the CNIC's 25: 160 ms."""
    net = FlowNetwork(cluster_links(PAPER_NODE, ["p0", "d0"]))
    for g in range(8):
        net.add(f"r{g}", 1 * GB, path_route(PE_PATH, ("p0", g), ("d0", g)))
    assert list(run(net).values()) == [pytest.approx(0.16)] * 8
    assert net.carried["p0/snic"] == pytest.approx(8 * GB) and net.carried["d0/dram"] == pytest.approx(16 * GB)


def test_both_paths_at_once_use_both_storage_nics():
    """A PE read into p0 and a DE read into d0 on different GPUs, 1 GB each: disjoint bottlenecks, 40 ms each;
    the same two reads on one path would share one SNIC and one CNIC."""
    net = FlowNetwork(cluster_links(PAPER_NODE, ["p0", "d0"]))
    net.add("pe", 1 * GB, path_route(PE_PATH, ("p0", 0), ("d0", 0)))
    net.add("de", 1 * GB, path_route(DE_PATH, ("p0", 1), ("d0", 1)))
    assert run(net) == {"pe": pytest.approx(0.04), "de": pytest.approx(0.04)}
    assert net.carried["p0/snic"] == pytest.approx(GB) and net.carried["d0/snic"] == pytest.approx(GB)


def test_bad_flows_are_rejected():
    net = FlowNetwork({"a": 1.0})
    with pytest.raises(ValueError):
        net.add("x", 1, (("nope", 1),))
    net.add("x", 1, (("a", 1),))
    with pytest.raises(ValueError):
        net.add("x", 1, (("a", 1),))
    with pytest.raises(ValueError):
        net.advance(-1)


def test_event_loop_orders_timers_and_transfers():
    """A request loads 1 GB on the PE path (40 ms on an idle paper node), then prefills for 10 ms; a second one
    starts at 20 ms on another GPU pair and shares nothing but the SNIC, which the first's 25 GB/s leaves room on:
    it ends its load at 60 ms and its prefill at 70 ms."""
    from dualpath.sim.events import EventLoop

    loop, log = EventLoop(FlowNetwork(cluster_links(PAPER_NODE, ["p0", "d0"]))), []

    def request(name, gpu):
        def loaded():
            log.append((name, "loaded", loop.now))
            loop.after(0.010, lambda: log.append((name, "prefilled", loop.now)))

        loop.transfer(name, 1 * GB, path_route(PE_PATH, ("p0", gpu), ("d0", gpu)), loaded)

    request("a", 0)
    loop.at(0.020, lambda: request("b", 1))
    assert loop.run() == pytest.approx(0.070)
    assert [(n, e) for n, e, _ in log] == [("a", "loaded"), ("a", "prefilled"), ("b", "loaded"), ("b", "prefilled")]
    assert [t for _, _, t in log] == [pytest.approx(x) for x in (0.040, 0.050, 0.060, 0.070)]
    with pytest.raises(ValueError):
        loop.at(0.0, lambda: None)


def test_event_loop_stops_at_until_with_flows_partly_moved():
    from dualpath.sim.events import EventLoop

    loop = EventLoop(FlowNetwork({"a": 10.0}))
    done = []
    loop.transfer("x", 100, (("a", 1),), lambda: done.append(loop.now))
    assert loop.run(until=4.0) == pytest.approx(4.0) and not done
    assert loop.net.remaining("x") == pytest.approx(60)
    assert loop.net.carried["a"] == pytest.approx(40)  # a flow in flight counts what it has moved so far
    loop.run()
    assert done == [pytest.approx(10.0)] and loop.net.carried["a"] == pytest.approx(100)


def test_a_transfer_ending_within_rounding_of_until_is_delivered_not_lost():
    from dualpath.sim.events import EventLoop

    loop = EventLoop(FlowNetwork({"a": 10.0}))
    done = []
    loop.transfer("x", 100, (("a", 1),), lambda: done.append(loop.now))
    loop.run(until=10.0 - 1e-13)  # the network counts the flow done; its callback must run
    assert done and not loop.net.flows
    assert loop.idle


def reference_rates(capacity: dict[str, float], routes: dict[str, list[tuple[str, float]]]) -> dict[str, float]:
    """Max-min fair rates the slow, obvious way: raise every unfrozen rate by the smallest step that fills a
    link, freeze that link's flows, repeat."""
    rate, left, active = dict.fromkeys(routes, 0.0), dict(capacity), set(routes)
    while active:
        weight: dict[str, float] = {}
        for f in active:
            for link, factor in routes[f]:
                weight[link] = weight.get(link, 0.0) + factor
        link, step = min(((l, left[l] / w) for l, w in weight.items()), key=lambda t: t[1])
        for f in active:
            rate[f] += step
            for l, factor in routes[f]:
                left[l] -= step * factor
        active -= {f for f in active if any(l == link or left[l] <= 1e-9 * capacity[l] for l, _ in routes[f])}
    return rate


@given(
    st.lists(
        st.lists(
            st.tuples(st.integers(0, 5), st.sampled_from([1.0, 2.0])), min_size=1, max_size=4, unique_by=lambda t: t[0]
        ),
        min_size=1,
        max_size=12,
    ),
    st.lists(st.floats(1.0, 100.0), min_size=6, max_size=6),
)
@settings(max_examples=200, deadline=None)
def test_heap_filling_equals_the_plain_algorithm(routes, caps):
    capacity = {f"l{i}": c for i, c in enumerate(caps)}
    named = {f"f{i}": [(f"l{link}", factor) for link, factor in r] for i, r in enumerate(routes)}
    net = FlowNetwork(dict(capacity))
    for fid, route in named.items():
        net.add(fid, 1e6, tuple(route))
    want = reference_rates(capacity, named)
    for fid, f in net.flows.items():
        assert f.rate == pytest.approx(want[fid], rel=1e-6)
    for link, u in net.utilization().items():
        assert u <= 1 + 1e-9


@given(
    st.lists(
        st.tuples(
            st.lists(
                st.tuples(st.integers(0, 5), st.sampled_from([1.0, 2.0])),
                min_size=1,
                max_size=4,
                unique_by=lambda t: t[0],
            ),
            st.floats(1.0, 50.0),
            st.floats(0.0, 0.5),
        ),
        min_size=1,
        max_size=16,
    ),
    st.lists(st.floats(1.0, 100.0), min_size=6, max_size=6),
)
@settings(max_examples=200, deadline=None)
def test_rates_stay_max_min_fair_as_flows_come_and_go(flows, caps):
    """Flows start at random times and end as their bytes arrive; after every change (fast path or full filling)
    each flow's rate equals the reference's for the flows then in flight, and completions happen in time order."""
    capacity = {f"l{i}": c for i, c in enumerate(caps)}
    net = FlowNetwork(dict(capacity))
    routes = {}

    def check():
        want = reference_rates(capacity, {fid: routes[fid] for fid in net.flows})
        for fid, f in net.flows.items():
            assert f.rate == pytest.approx(want[fid], rel=1e-6)

    for i, (route, size, gap) in enumerate(flows):
        t = net.now + gap
        while (nxt := net.next_completion()) is not None and nxt[0] <= t:
            assert nxt[1] in net.advance(nxt[0])
            check()
        net.advance(t)
        routes[f"f{i}"] = [(f"l{link}", factor) for link, factor in route]
        net.add(f"f{i}", size, tuple(routes[f"f{i}"]))
        check()
    run(net)
    assert not net.flows


def test_a_change_refills_only_the_flows_it_affects():
    """Reads held by their node's storage link (two prefill nodes, eight reads each, to separate decode nodes):
    starting or finishing one re-fills that node's reads, never the other node's."""
    net = FlowNetwork(
        cluster_links(PAPER_NODE, ["p0", "p1", "d0", "d1"]) | {"p0/storage_read": 20e9, "p1/storage_read": 20e9}
    )
    for g in range(8):
        for p, d in (("p0", "d0"), ("p1", "d1")):
            net.add(f"{p}.{g}", (g + 1) * GB, path_route(PE_PATH, (p, g), (d, g)) + ((f"{p}/storage_read", 1.0),))
    assert all(f.rate == pytest.approx(20e9 / 8) for f in net.flows.values())
    done = run(net)
    assert done["p0.0"] == pytest.approx(8 / 20)  # 8 GB moved through the link when the first (1 GB) is done
    assert done["p0.7"] == pytest.approx(36 / 20)
    assert net.refilled <= 2 * (36 + 28)  # each change: the node's reads then in flight (everything: ~4x more)


def test_a_storage_system_shared_by_every_nodes_reads_is_processor_shared():
    """Twelve reads on three nodes, each node's link faster than its share of the storage system: the storage
    link holds them all, so they share its 6 GB/s equally (processor sharing) and each change re-rates that
    group once (the one-pass path), with exact completion times; the last read alone is held by its node."""
    caps = {"storage": 6 * GB} | {f"n{i}": 4 * GB for i in range(3)}
    net = FlowNetwork(caps)
    sizes = {f"r{k}": (k + 1) * GB for k in range(12)}
    for k, (fid, size) in enumerate(sizes.items()):
        net.add(fid, size, ((f"n{k % 3}", 1.0), ("storage", 1.0)))
    assert all(f.bottleneck == "storage" and f.rate == pytest.approx(0.5 * GB) for f in net.flows.values())
    done, t = run(net), 0.0
    for k in range(12):  # sizes 1..12 GB: each next one has 1 GB more to move, shared by the 12 - k left;
        t += (12 - k) * GB / min(6 * GB, 4 * GB * (12 - k))  # the last alone is held by its node's 4 GB/s
        assert done[f"r{k}"] == pytest.approx(t)
    assert net.refilled <= sum(range(1, 13)) * 2


def test_completions_stay_exact_when_stale_heap_entries_are_dropped_in_bulk():
    """Forty flows share one link (every start re-rates all of them, leaving ~800 stale completion entries: the
    heap is rebuilt from the live flows); they finish as processor sharing says, in size order."""
    from dualpath.sim.events import EventLoop

    loop = EventLoop(FlowNetwork({"a": 1.0}))
    done = {}
    sizes = [float(k) for k in range(1, 41)]
    for k, size in enumerate(sizes):
        loop.transfer(f"f{k}", size, (("a", 1),), lambda k=k: done.setdefault(k, loop.now))
    assert len(loop.net._heap) > 4 * len(sizes) + 256  # many stale entries before the first completion
    loop.run()
    want, t, prev = [], 0.0, 0.0
    for k, size in enumerate(sizes):  # the k-th smallest ends after the rest shared the link for its extra bytes
        t += (size - prev) * (len(sizes) - k)
        prev = size
        want.append(t)
    assert [done[k] for k in range(len(sizes))] == pytest.approx(want, rel=1e-9)
    assert len(loop.net._heap) <= 4 * len(loop.net.flows) + 256
