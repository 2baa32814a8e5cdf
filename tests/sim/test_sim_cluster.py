"""The simulated cluster, driven by the real scheduler core, on scenarios whose timeline is worked out by hand."""

import math

import pytest

from dualpath.sim.cluster import _MIX, BlockKeys, ClusterSim, SimConfig
from dualpath.sim.hardware import MODELS, EngineModel, Hardware, ModelPreset
from dualpath.engines.batcher import CostModel

FAST = Hardware(gpus=1, cnic_bps=1e12, snic_bps=1e12, dram_bps=1e12)
MODEL = ModelPreset("toy", 1000)  # 1 KB of KV per token
ENGINE = EngineModel(
    CostModel(0.01, 0.001, 0.0),
    decode_fixed_s=0.016,
    decode_per_seq_s=0.0,
    decode_per_token_s=0.0,
    decode_kv_tokens=100_000,
    num_layers=2,
)


def two_rounds(system: str, storage_bps: float = 1e6):
    cfg = SimConfig(FAST, MODEL, ENGINE, 1, 1, system, storage_bps=storage_bps, pull_interval_s=0.05, pull_jitter=0.0)
    return ClusterSim(cfg, [[(128, 4), (60, 4)]]).run()


# Pulls: the decode group at 0, 0.05, ...; the prefill group at 0.025, 0.075, ... Round 1 (t=0): 128 new tokens,
# nothing stored; placed on the decode side at 0 and prefilled from 0.025 for 0.01 + 0.128 s, hand-off at 0.163,
# three 16 ms decode steps -> done 0.211, reported at the decode pull at 0.25, where the next round is submitted,
# routed and given a decode engine (the same pull); the prefill pull at 0.275 places it. Round 2: 192 tokens, 2
# blocks (128 tokens) stored: 128 KB read at 1 MB/s = 0.128 s; prefill of 64 new tokens 0.074 s over 2 layers.
@pytest.mark.parametrize(
    "system, jct",
    [
        ("dualpath", 0.5),  # layerwise: compute from 0.275, read ends 0.403, last layer +0.037 -> 0.44, done 0.488
        ("basic", 0.55),  # whole KV first: 0.403 + 0.074 = 0.477, done 0.525
        ("oracle", 0.4),  # no read: 0.275 + 0.074 = 0.349, done 0.397
    ],
)
def test_two_round_agent_timeline_by_hand(system, jct):
    r = two_rounds(system)
    assert r.jct_s == pytest.approx(jct, abs=1e-9)
    assert r.turns == 2
    assert r.ttft_s[0] == pytest.approx(0.163)
    if system != "oracle":
        assert sum(r.storage_read_bytes.values()) == pytest.approx(128 * 1000)
        assert r.link_bytes["storage"] == pytest.approx(128 * 1000)


def test_storage_bandwidth_is_shared_by_concurrent_reads():
    """Two agents on two prefill GPUs: their second rounds read 128 KB each from 0.275, sharing 1 MB/s, so both
    reads end at 0.531 (alone: 0.403); prefill to 0.605, decode to 0.653, reported at 0.7."""
    hw = Hardware(gpus=2, cnic_bps=1e12, snic_bps=1e12, dram_bps=1e12)
    cfg = SimConfig(hw, MODEL, ENGINE, 1, 1, "basic", storage_bps=1e6, pull_interval_s=0.05, pull_jitter=0.0)
    r = ClusterSim(cfg, [[(128, 4), (60, 4)], [(128, 4), (60, 4)]]).run()
    assert r.turns == 4
    assert r.link_bytes["storage"] == pytest.approx(2 * 128 * 1000)
    assert r.jct_s == pytest.approx(0.7, abs=1e-9)


def reference_block_keys(agent: int, first: int, last: int) -> bytes:
    """``BlockKeys.keys`` as its docstring defines it, in Python integers."""
    mask = (1 << 64) - 1
    return b"".join(
        ((((agent + 1) << 32 | b) * _MIX) & mask).to_bytes(8, "little") + agent.to_bytes(8, "little")
        for b in range(first, max(first, last))
    )


def test_block_keys_are_distinct_per_agent_and_position():
    keys = BlockKeys()
    firsts = {keys.keys(a, b, b + 1)[:8] for a in range(50) for b in range(500)}
    assert len(firsts) == 50 * 500  # the index keys on the first 8 bytes


def test_block_keys_table_gives_the_formulas_keys():
    """BlockKeys (from a table of block x MIX, grown on demand) packs exactly the formula's bytes; an empty or
    reversed range packs nothing."""
    fast = BlockKeys()
    for agent, first, last in [(0, 0, 1), (7, 0, 900), (7, 899, 2500), (49151, 3, 5000), (2**31, 10, 20), (3, 5, 2)]:
        assert fast.keys(agent, first, last) == reference_block_keys(agent, first, last)
    assert fast.keys(1, 4, 4) == b""


def test_unknown_system_is_refused():
    with pytest.raises(ValueError, match="system"):
        SimConfig(FAST, MODEL, ENGINE, 1, 1, "magic")
    assert math.isinf(SimConfig(FAST, MODEL, ENGINE, 1, 1).storage_bps)


@pytest.mark.slow  # ~3 s: a search over arrival rates
def test_online_capacity_of_one_prefill_gpu():
    """One-round agents, 0.1 s of prefill each on one prefill GPU, nothing stored: the GPU saturates at 10
    agents/s, beyond which TTFT grows with time: over a finite run of T seconds the mean TTFT at load rho is about
    (rho - 1) T / 2, so a 4 s objective over 100 s admits rho up to ~1.08: the capacity found lies just above 10."""
    from dualpath.sim.cluster import Slo, online_capacity

    engine = EngineModel(
        CostModel(0.1, 0.0, 0.0),
        decode_fixed_s=0.001,
        decode_per_seq_s=0.0,
        decode_per_token_s=0.0,
        decode_kv_tokens=10**7,
        num_layers=2,
    )
    cfg = SimConfig(FAST, MODEL, engine, 1, 1, "dualpath", pull_interval_s=0.05)
    found = online_capacity(cfg, [[(64, 2)]], duration_s=100.0, slo=Slo(4.0, 0.05), iters=5)
    assert 9.5 <= found["agents_per_s"] <= 11.5, found
    rates = dict(found["tried"])
    assert rates[1.0] and not rates[16.0]


def _decode_by_steps(arrivals, e: EngineModel) -> list[float]:
    """Reference: one decode GPU stepping one step at a time; a request arriving during a step joins at its end,
    one arriving at an idle GPU starts a step at once. Returns each request's finish time."""
    done, running, pending, t = {}, {}, sorted(range(len(arrivals)), key=lambda i: arrivals[i][0]), 0.0
    while pending or running:
        if not running:
            t = max(t, arrivals[pending[0]][0])
        while pending and arrivals[pending[0]][0] <= t:
            running[pending.pop(0)] = 1  # the first token came from prefill
        t += e.decode_step(len(running), sum(arrivals[i][1] + g for i, g in running.items()))
        for i in list(running):
            running[i] += 1
            if running[i] >= arrivals[i][2]:
                done[i] = t
                del running[i]
    return [done[i] for i in range(len(arrivals))]


@pytest.mark.parametrize("per_token_s", [1e-6, 0.0])
@pytest.mark.parametrize("seed", range(6))
def test_decode_segments_match_stepping_one_step_at_a_time(seed, per_token_s):
    """The simulator advances a decode GPU in segments (many steps per event, cut when a request joins); the finish
    times must equal stepping one step at a time, with step times growing with the batch's context (or not)."""
    import numpy as np

    from dualpath.sim.cluster import Agent, SimRequest

    rng = np.random.default_rng(seed)
    e = EngineModel(
        CostModel(0.0, 0.0, 0.0),
        decode_fixed_s=0.01,
        decode_per_seq_s=0.002,
        decode_per_token_s=per_token_s,
        decode_kv_tokens=10**7,
        num_layers=2,
    )
    arrivals = [
        (float(t), int(p), int(g))
        for t, p, g in zip(np.sort(rng.uniform(0, 2.0, 12)), rng.integers(10, 5000, 12), rng.integers(1, 60, 12))
    ]
    sim = ClusterSim(SimConfig(FAST, MODEL, e, 1, 1), [])
    pe, de = sim.engines["p0-0"], sim.engines["d0-0"]
    reqs = []

    def arrive(i, t, prompt, gen):
        req = SimRequest(Agent(i, []), prompt, gen, t, de=de.info.engine_id)
        reqs.append(req)
        pe.admit(f"w{i}", req)
        de.admit(f"w{i}", req)
        sim._hand_off(pe, f"w{i}")

    for i, (t, prompt, gen) in enumerate(arrivals):
        sim.loop.at(t, lambda i=i, a=(t, prompt, gen): arrive(i, *a))
    sim.loop.run()
    got = [r.done for r in sorted(reqs, key=lambda r: r.agent.index)]
    assert got == pytest.approx(_decode_by_steps(arrivals, e), rel=1e-9, abs=1e-9)
    assert de.held_tokens == 0 and de.reserved == 0 and not de.held


@pytest.mark.parametrize("seed", range(4))
def test_a_joining_request_cuts_the_segment_at_the_first_boundary_after_now(seed):
    """The cut is solved in closed form and then corrected; it must equal the first step boundary strictly after
    now found by scanning every step, for times on, just before and just after boundaries."""
    import random

    from dualpath.sim.cluster import Agent, SimRequest

    rng = random.Random(seed)
    e = EngineModel(
        CostModel(0.0, 0.0, 0.0),
        decode_fixed_s=rng.uniform(0.005, 0.05),
        decode_per_seq_s=1e-4,
        decode_per_token_s=rng.choice([0.0, 1e-7, 3e-6]),
        decode_kv_tokens=10**8,
        num_layers=2,
    )
    sim = ClusterSim(SimConfig(FAST, MODEL, e, 1, 1), [])
    de = sim.engines["d0-0"]
    for _ in range(200):
        batch = rng.randint(1, 64)
        de.running = {f"w{i}": SimRequest(Agent(i, []), 100, 10, 0.0) for i in range(batch)}
        de.seg_start, de.seg_context = rng.uniform(0, 100), rng.randint(batch, 10**6)
        de.seg_steps = rng.randint(1, 400)
        de.joining = [("new", SimRequest(Agent(-1, []), 10, 10, 0.0))]
        boundaries = [sim._steps_end(de, n) for n in range(1, de.seg_steps + 1)]
        k = rng.randrange(len(boundaries))
        sim.loop.net.now = max(de.seg_start, boundaries[k] + rng.choice([0.0, -1e-9, 1e-9, -1e-13, 1e-13]))
        want = next((n for n, t in enumerate(boundaries, 1) if t > sim.loop.net.now + 1e-12), de.seg_steps)
        steps = de.seg_steps
        sim._cut_segment(de)
        assert de.seg_steps == min(want, steps)


def test_storage_bound_throughput_follows_the_storage_nics_in_use():
    """Storage-bound (0.5 GB/s per node, fast GPUs): Basic reads through the one prefill node's storage, so its
    turn rate is at most that bandwidth over the KV a turn loads; DualPath also reads through the decode node's
    and gets about twice as many turns per second."""
    hw = Hardware(gpus=2, cnic_bps=1e12, snic_bps=1e12, dram_bps=1e12, storage_read_bps=0.5e9)
    rounds = [[(640, 8)] * 10 for _ in range(40)]
    heavy = ModelPreset("heavy KV", 200_000)  # ~0.6 GB per turn: about a second of one node's storage
    rate = {}
    for system in ("basic", "dualpath"):
        sim = ClusterSim(SimConfig(hw, heavy, ENGINE, 1, 1, system, pull_interval_s=0.02), rounds)
        r = sim.run()
        loaded = sum(r.storage_read_bytes.values())
        assert (
            loaded == 40 * sum(k * 648 // 64 * 64 for k in range(1, 10)) * 200_000
        )  # each turn: the full blocks before
        rate[system] = loaded / r.jct_s
    assert 0.75 * 0.5e9 <= rate["basic"] <= 0.5e9 * 1.001
    assert rate["dualpath"] >= 1.6 * rate["basic"]


@pytest.mark.slow  # ~5 s: the CLI's simulate and plan end to end (the simulator's own tests stay in the default run)
def test_simulate_and_plan_commands(tmp_path):
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dualpath.cli",
            "simulate",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--gpus",
            "2",
            "--agents",
            "6",
            "--scale",
            "0.1",
            "--turns-scale",
            "0.1",
            "--systems",
            "basic,dualpath",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    rows = json.loads(out)
    assert [r["system"] for r in rows] == ["basic", "dualpath"] and all(r["turns"] > 0 for r in rows)
    text = subprocess.run(
        [
            sys.executable,
            "-m",
            "dualpath.cli",
            "plan",
            "--nodes",
            "3",
            "--gpus",
            "2",
            "--simulate",
            "--agents-per-node",
            "4",
            "--seconds",
            "60",
            "--model",
            "ds27b",
            "--target-turns-per-s",
            "50",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert "1P2D" in text and "2P1D" in text and "best: " in text and "needs about" in text


def test_prefill_groups_share_the_queue_when_pulls_drift():
    """2P1D Basic (DS 27B timings, 4 GPUs a node): the one decode group refills the prefill queue once per
    interval. With phase-locked pulls the same prefill group always pulls next and takes everything (Algorithm 1
    looks at the pulling group only, and beta is 5 s of prefill); real pulls drift (each waits after its reply),
    modelled by the jitter, and both prefill nodes then read about half."""
    from dualpath.rollout.tracegen import trace_shapes

    rounds, _ = trace_shapes("64k", 32, 1.0, 0.1, 0)
    hw, model = Hardware(gpus=4, storage_read_bps=13e9), MODELS["ds27b"]
    share = {}
    for jitter in (0.0, 0.2):
        r = ClusterSim(SimConfig(hw, model, model.engine, 2, 1, "basic", pull_jitter=jitter), rounds).run()
        share[jitter] = {n: b / sum(r.storage_read_bytes.values()) for n, b in r.storage_read_bytes.items()}
    assert share[0.0] == {"p0": 1.0}
    assert set(share[0.2]) == {"p0", "p1"} and min(share[0.2].values()) > 0.35, share


def test_leaving_unchanged_reports_and_idle_pulls_out_changes_no_decision(monkeypatch):
    """Also the scheduler's own skip: a prefill group that could take nothing at its last pull, unchanged since, is
    not placed for (``SchedulerCore._still_full``): a run without that skip decides the same."""
    from dualpath.rollout.tracegen import trace_shapes
    from dualpath.scheduler.paper import DualPathPolicy

    rounds, _ = trace_shapes("64k", 96, 1.0, 0.1, 1)  # enough agents to fill the prefill engines at times
    hw, model = Hardware(gpus=4, storage_read_bps=13e9), MODELS["ds27b"]

    def run(every: bool):
        sim = ClusterSim(SimConfig(hw, model, model.engine, 1, 2, "dualpath", 40e9, every_pull=every), rounds)
        return sim.run(), sim.core

    (skipping, core), (lean, _) = run(True), run(False)
    assert core._full_prefill, "no prefill pull found its group full: the comparison below would test nothing"
    monkeypatch.setattr(DualPathPolicy, "takes_no_prefill", lambda self, group: False)
    runs = [run(True)[0], skipping, lean]
    for r in runs[1:]:
        assert r.turns == runs[0].turns == sum(map(len, rounds))
        assert r.jct_s == runs[0].jct_s and r.ttft_s == runs[0].ttft_s
        assert r.storage_read_bytes == runs[0].storage_read_bytes


def test_progress_reports_along_the_run_without_changing_it():
    from dualpath.rollout.tracegen import trace_shapes

    rounds, _ = trace_shapes("64k", 16, 1.0, 0.1, 2)
    hw, model = Hardware(gpus=4, storage_read_bps=13e9), MODELS["ds27b"]
    cfg = SimConfig(hw, model, model.engine, 1, 1, "dualpath")
    plain = ClusterSim(cfg, rounds).run()
    seen = []
    watched = ClusterSim(cfg, rounds).run(progress=lambda t, turns: seen.append((t, turns)), every_s=10.0)
    assert (watched.jct_s, watched.turns, watched.ttft_s) == (plain.jct_s, plain.turns, plain.ttft_s)
    assert len(seen) >= plain.jct_s // 10 and [t for t, _ in seen] == sorted(t for t, _ in seen)
    assert [n for _, n in seen] == sorted(n for _, n in seen) and seen[-1][1] <= plain.turns
