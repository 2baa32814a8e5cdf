"""Link accounting of the two read paths against the paper's §4.2 formulas, and the P/D planner's range."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.sim.hardware import GBPS, PAPER_NODE, Hardware
from dualpath.sim.links import DECODE, PREFILL, link_load
from dualpath.sim.plan import bottleneck_free_range, node_counts


def test_paper_node_range_is_one_seventh_to_seven_halves():
    r = bottleneck_free_range(PAPER_NODE)  # g = 8, s = 1, M / (B s) = 10
    assert r.low == pytest.approx(1 / 7) and r.high == pytest.approx(7 / 2) and r.feasible


@pytest.mark.parametrize("p,d", [(1, 7), (7, 2), (2, 4), (1, 1), (3, 1)])
def test_no_link_saturates_inside_the_range(p, d):
    assert not link_load(PAPER_NODE, p, d).saturated()


@pytest.mark.parametrize(
    "p,d,side,link", [(1, 8, PREFILL, "cnic_write"), (4, 1, DECODE, "cnic_write"), (4, 1, DECODE, "dram")]
)
def test_a_link_saturates_just_outside(p, d, side, link):
    """1/8 < 1/7: the prefill CNICs receive too much; 4 > 7/2: the decode CNIC writes and DRAM overflow."""
    assert (side, link) in {(s, l) for s, l, _ in link_load(PAPER_NODE, p, d).saturated()}


def test_loads_equal_the_papers_per_link_formulas():
    """Hand-derived for B = 50 GB/s, s = 1, g = 8, P = 2, D = 4: T_p = Bs/(D g^2), T_c = Bs/(P g^2) per GPU pair."""
    B, g, P, D = 50e9, 8, 2, 4
    Tp, Tc = B / (D * g * g), B / (P * g * g)
    load = link_load(Hardware(cnic_bps=B, snic_bps=B), P, D).load
    per_gpu = {side: {k: v / g for k, v in links.items()} for side, links in load.items()}
    assert per_gpu[PREFILL]["cnic_read"] == pytest.approx(2 * Tp * D * g)
    assert per_gpu[PREFILL]["cnic_write"] == pytest.approx((Tp + Tc) * D * g)
    assert per_gpu[DECODE]["cnic_read"] == pytest.approx((Tp + 2 * Tc) * P * g)
    assert per_gpu[DECODE]["cnic_write"] == pytest.approx((2 * Tp + Tc) * P * g)
    assert load[PREFILL]["dram"] == pytest.approx(2 * B)
    assert load[DECODE]["dram"] == pytest.approx((3 + 2 * P / D) * B)
    assert load[PREFILL]["snic"] == load[DECODE]["snic"] == pytest.approx(B)


@settings(max_examples=200, deadline=None)
@given(g=st.integers(2, 16), s=st.floats(0.25, 4), m=st.floats(3.5, 30), p=st.integers(1, 40), d=st.integers(1, 40))
def test_the_closed_form_range_is_exactly_where_no_link_saturates(g, s, m, p, d):
    B = 50e9
    hw = Hardware(gpus=g, cnic_bps=B, snic_bps=s * B, dram_bps=m * s * B)
    inside = bottleneck_free_range(hw).contains(p / d, tol=1e-9)
    utils = [u for links in link_load(hw, p, d).utilization.values() for k, u in links.items() if k != "snic"]
    if abs(max(utils) - 1) > 1e-6:  # off the boundary, the two views agree
        assert inside == (max(utils) <= 1), (g, s, m, p, d, max(utils))


def test_partial_storage_load_scales_every_link():
    full, half = link_load(PAPER_NODE, 2, 4), link_load(PAPER_NODE, 2, 4, 25 * 1e9, 25 * 1e9)
    for side in (PREFILL, DECODE):
        for link, v in full.load[side].items():
            assert half.load[side][link] == pytest.approx(v / 2)


def test_node_splits_and_the_plan_command():
    assert node_counts(bottleneck_free_range(PAPER_NODE), 12)[0] == (2, 10)
    out = subprocess.run(
        [sys.executable, "-m", "dualpath.cli", "plan", "--nodes", "12", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    data = json.loads(out)
    assert data["low"] == pytest.approx(1 / 7) and [2, 10] in data["splits"] and [10, 2] not in data["splits"]
    text = subprocess.run(
        [sys.executable, "-m", "dualpath.cli", "plan", "--snic-gbps", str(5 * 400)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert "no P/D ratio is bottleneck-free" in text


def test_storage_bound_turn_rate_counts_every_nodes_storage_nic():
    from dualpath.sim.hardware import MODELS
    from dualpath.sim.plan import storage_bound_turns_per_s

    kv = MODELS["ds660b"].kv_bytes_per_token
    assert kv == 40 * 1024 and MODELS["qwen32b"].kv_bytes_per_token == 256 * 1024
    assert storage_bound_turns_per_s(PAPER_NODE, 6, kv, 64000) == pytest.approx(6 * 50e9 / (kv * 64000))
    out = subprocess.run(
        [sys.executable, "-m", "dualpath.cli", "plan", "--prefill", "2", "--decode", "4", "--hit-tokens", "64000"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert "114.4 turns/s with both paths, 38.1 through prefill nodes only" in out


def test_bad_hardware_is_rejected():
    with pytest.raises(ValueError):
        Hardware(gpus=0)
    with pytest.raises(ValueError):
        link_load(PAPER_NODE, 0, 1)
    assert GBPS == 125e6


def test_splits_simulated_on_two_processes_give_one_processs_rows_in_order():
    """``plan --simulate`` runs its splits on forked processes (a 6-node plan: 67 s on one core, 34 s on two):
    each split's row is what a run in this process gives, and the rows come in the splits' order."""
    from dualpath.rollout.tracegen import trace_shapes
    from dualpath.sim.hardware import MODELS, PAPER_CLUSTER_NODE
    from dualpath.sim.plan import simulate_splits

    rounds, _ = trace_shapes("64k", 16, scale=0.05, turns_scale=0.5)
    splits = [(1, 2), (2, 1), (1, 1)]
    args = (PAPER_CLUSTER_NODE, MODELS["ds27b"], splits, rounds, 20.0)
    alone, forked = list(simulate_splits(*args, jobs=1)), list(simulate_splits(*args, jobs=2))
    assert forked == alone and [(r["prefill"], r["decode"]) for r in forked] == splits
    assert all(r["turns_per_s"] > 0 for r in alone)


def test_a_short_plan_run_counts_prefill_busy_time_only_inside_it():
    """A run stopped while prefills still compute: their time past its end is not counted (it printed 101%)."""
    from dualpath.rollout.tracegen import trace_shapes
    from dualpath.sim.cluster import ClusterSim, SimConfig
    from dualpath.sim.hardware import MODELS, PAPER_CLUSTER_NODE
    from dualpath.sim.plan import simulate_split

    rounds, _ = trace_shapes("64k", 256, turns_scale=0.5)  # the GPUs busy throughout (the whole-prefill count: 114%)
    model = MODELS["ds27b"]
    row = simulate_split(PAPER_CLUSTER_NODE, model, 1, 2, rounds, 5.0)
    assert 0.9 < row["prefill_busy"] <= 1.0
    sim = ClusterSim(SimConfig(PAPER_CLUSTER_NODE, model, model.engine, 1, 2, "dualpath"), rounds)
    sim.run(until=5.0)
    running = [pe for pe in sim.engines.values() if pe.computing and pe.busy_until > 5.0]
    assert running and sim.prefill_busy_by(5.0) < sim.prefill_busy_s  # (the case at hand: some still run)
    assert sim.prefill_busy_by(1e9) == sim.prefill_busy_s
