"""Agent sessions in the cluster simulator: a round's next turn comes ``tool_s`` after it ends; the scheduler's own
session support orders prefetches (to the engine its rules pick) and places the next turn by them; the engines'
prefetchers keep read blocks after use; prefetch during the gap cuts follow-up TTFT when the gap covers the load,
does nothing (and costs nothing) without gaps; unused blocks expire, demand reclaims them, and the bytes add up."""

import pytest

from dualpath.engines.batcher import CostModel
from dualpath.sim.cluster import ClusterSim, SimConfig
from dualpath.sim.hardware import EngineModel, Hardware, ModelPreset

FAST = Hardware(gpus=1, cnic_bps=1e12, snic_bps=1e12, dram_bps=1e12)
# storage-bound: an 8,000-token context (8 MB) takes 0.8 s to read, its prefill of 64 new tokens 0.01 s
SLOW_STORE = Hardware(gpus=1, cnic_bps=50e9, snic_bps=50e9, dram_bps=500e9, storage_read_bps=10e6)
MODEL = ModelPreset("toy", 1000)  # 1 KB of KV per token
ENGINE = EngineModel(
    CostModel(0.01, 0.001, 0.0),
    decode_fixed_s=0.016,
    decode_per_seq_s=0.0,
    decode_per_token_s=0.0,
    decode_kv_tokens=100_000,
    num_layers=2,
)
LIGHT = EngineModel(CostModel(0.01, 1e-5, 0.0), 0.01, 0.0, 0.0, 1_000_000, 4)


@pytest.mark.parametrize("gap", [0.37, 1.0])
def test_the_next_turn_is_sent_tool_s_after_the_round_ends(gap):
    """tests/sim/test_sim_cluster.py's two-round timeline: round 1 is reported finished at the decode pull at 0.25;
    round 2 is sent ``gap`` later (without a gap: at 0.25)."""
    cfg = SimConfig(FAST, MODEL, ENGINE, 1, 1, "dualpath", storage_bps=1e6, pull_interval_s=0.05, pull_jitter=0.0)
    r = ClusterSim(cfg, [[(128, 4, gap), (60, 4)]]).run()
    assert r.turns == 2
    assert r.ttft_at[1] - r.ttft_s[1] == pytest.approx(0.25 + gap, abs=1e-9)  # when round 2 was submitted
    assert r.sessions["gaps_observed"] == 1 and r.sessions["gap_prior_median_s"] == pytest.approx(gap)


def slow_store_run(prefetch: bool, gap: float, agents: int = 2, rounds: int = 6, p: int = 1, d: int = 1, **kw):
    rs = [[(8000, 16, gap)] + [(64, 16, gap)] * (rounds - 1) for _ in range(agents)]
    cfg = SimConfig(SLOW_STORE, MODEL, LIGHT, p, d, "dualpath", pull_interval_s=0.05, prefetch=prefetch, **kw)
    sim = ClusterSim(cfg, rs)
    return sim.run(), sim


def test_prefetch_cuts_follow_up_ttft_when_the_gap_covers_the_load():
    """3 s gaps, 0.8 s loads: the follow-up turns find their KV in the buffer (read in the gap, from end + q20 -
    1.5 x 0.8 s) and wait for no storage read; without prefetch each waits ~0.8 s for its read. Read blocks stay in
    the buffer after use: each later prefetch reads only the blocks the last turn added and keeps the others."""
    base = slow_store_run(False, 3.0, affinity=True)[0].sessions
    pre = slow_store_run(True, 3.0, affinity=True)[0].sessions
    assert base["follow_up"]["ttft_p50_s"] > 0.8
    assert pre["follow_up"]["ttft_p50_s"] < 0.2 * base["follow_up"]["ttft_p50_s"]
    c = pre["prefetch_counts"]
    assert c["orders"] == c["full"] == pre["follow_up"]["turns"] == 10  # every one found all its hit in DRAM
    assert pre["scheduler"]["session_turns_prefetched"] == pre["follow_up_prefetched"]["turns"] == 10
    assert pre["prefetched_fraction"] == pre["dram_share_of_hits"] == 1.0
    assert c["read_blocks"] == 2 * ((8000 + 16 + 4 * 80) // 64)  # each context's blocks read once ...
    assert c["refreshed_blocks"] == c["ordered_blocks"] - c["read_blocks"] > 0  # ... the rest kept
    assert pre["prefetch_served_bytes"] == pre["hit_bytes"] > pre["prefetch_issued_bytes"]
    assert pre["storage_bytes_for_hits"] == pre["prefetch_issued_bytes"] < 0.25 * base["storage_bytes_for_hits"]
    assert pre["extra_storage_read_fraction"] == 0
    assert 0 < pre["working_set_peak_bytes"]["dram_prefetch"] <= 2 * (8000 + 6 * 80) * 1000  # both contexts at most


@pytest.mark.parametrize("affinity", [False, True])
def test_without_gaps_prefetch_does_nothing_and_costs_nothing(affinity):
    """Each turn is sent the moment the last ends: no prefetch is planned, and the run is the same, turn by turn."""
    runs = [slow_store_run(p, 0.0, agents=3, affinity=affinity)[0] for p in (False, True)]
    assert runs[0].ttft_s == runs[1].ttft_s and runs[0].jct_s == runs[1].jct_s
    assert runs[0].storage_read_bytes == runs[1].storage_read_bytes
    s = runs[1].sessions
    assert s["prefetch_issued_bytes"] == 0 and s["prefetch_counts"]["orders"] == s["scheduler"]["prefetch_orders"] == 0
    assert s["storage_bytes_for_hits"] == s["hit_bytes"] and s["extra_storage_read_fraction"] == 0


def test_without_sessions_a_run_is_what_it_was():
    """No gap, no prefetch, no affinity: no session bookkeeping at all (the paper's runs are untouched)."""
    cfg = SimConfig(FAST, MODEL, ENGINE, 1, 1, "dualpath", storage_bps=1e6, pull_interval_s=0.05, pull_jitter=0.0)
    sim = ClusterSim(cfg, [[(128, 4), (60, 4, 0.0)]])
    assert sim.sessions is None and sim.run().sessions == {}


def test_a_prefetch_unused_past_its_hold_time_expires_as_waste():
    """Gaps of 1 s teach the estimate; then a 100 s gap: its prefetch goes out about a second after the turn, and
    its blocks are freed 30 s after they were read or last ordered (max(30 s, 3 x the expected gap)), long before the
    turn comes. The scheduler still places the turn where it ordered the prefetch (the runtime's ``prefetched``
    flag), but it finds nothing there and reads storage; only the blocks no turn had used count as waste. (With one
    prefill group the target is the side whose node read less lately: here it alternates between the two engines,
    so each holds the context.)"""
    gaps = [1.0] * 6 + [100.0]
    rs = [[(8000, 16, gaps[0])] + [(64, 16, g) for g in gaps[1:]] + [(64, 16)]]
    cfg = SimConfig(SLOW_STORE, MODEL, LIGHT, 1, 1, "dualpath", pull_interval_s=0.05, prefetch=True, affinity=True)
    sim = ClusterSim(cfg, rs)
    s = sim.run().sessions
    c = s["prefetch_counts"]
    assert c["expired_blocks"] == c["read_blocks"] > 2 * (8000 // 64) and c["reclaimed_blocks"] == 0  # all expired
    wasted = s["prefetch_wasted_by"]["expired"]
    assert 0 < wasted == s["prefetch_wasted_bytes"] == 2 * 64_000  # the last order's new blocks: never used
    last = sim.sessions.turns[-1]
    assert last[7] == 7 and last[3] and last[2] == 0  # placed on its prefetch, served nothing from DRAM
    assert s["follow_up_from_dram"]["turns"] == 6 and s["extra_storage_read_fraction"] > 0


def test_prefetch_bytes_add_up_when_buffers_are_small():
    """Buffers that hold about one session's KV: prefetches stop for room or are evicted by demand; every byte
    read ahead is used, wasted, or still held, and the buffers never hold a negative amount."""
    rs = [[(6000 + 500 * i, 16, 2.0 + 0.3 * i)] + [(64, 16, 2.0 + 0.3 * i)] * 5 for i in range(4)]
    cfg = SimConfig(
        SLOW_STORE,
        MODEL,
        LIGHT,
        1,
        1,
        "dualpath",
        pull_interval_s=0.05,
        prefetch=True,
        affinity=True,
        buffer_bytes_per_node=8e6,
        prefetch_chunk_blocks=8,
    )
    sim = ClusterSim(cfg, rs)
    s = sim.run().sessions
    c = s["prefetch_counts"]
    assert c["no_room"] > 0 and c["skipped_blocks"] > 0 and c["full"] + c["partial"] > 0
    assert s["prefetch_issued_bytes"] == pytest.approx(
        s["prefetch_used_bytes"]
        + s["prefetch_wasted_bytes"]
        + s["prefetch_held_unused_bytes_at_end"]
        + s["prefetch_inflight_bytes_at_end"]
    )
    assert sum(s["prefetch_wasted_by"].values()) == pytest.approx(s["prefetch_wasted_bytes"])
    assert all(row["dram_prefetch_bytes"] >= 0 and row["dram_demand_bytes"] >= 0 for row in s["working_set"])
    for p in sim.sessions.engines.values():  # 125 slots per engine: prefetch takes at most half, demand is freed
        assert p.slots == 125 and len(p.ready) <= p.max_slots == 62 and p.demand == 0


def test_demand_reclaims_prefetched_blocks_least_recently_used_first():
    """A decode engine's buffer of 30 slots, 15 of them for prefetch: the turns' demand (their prompt's blocks, held
    until their prefill ends) takes slots from the prefetched blocks, least recently used first, and those no turn
    used are wasted."""
    rs = [[(600, 16, 2.0)] + [(64, 16, 2.0)] * 4 for _ in range(3)]
    kw = dict(pull_interval_s=0.05, prefetch=True, affinity=True, buffer_bytes_per_node=30 * 64_000)
    sim = ClusterSim(SimConfig(SLOW_STORE, MODEL, LIGHT, 1, 1, "dualpath", **kw), rs)
    s = sim.run().sessions
    assert s["prefetch_counts"]["reclaimed_blocks"] > 0 and s["prefetch_wasted_by"]["reclaimed"] >= 0
    assert s["prefetch_counts"]["full"] + s["prefetch_counts"]["partial"] > 0


def test_the_working_set_follows_the_sessions_still_running():
    """Storage holds each running session's blocks; a finished session's leave it, so the run ends at zero."""
    s = slow_store_run(False, 1.0, agents=2, session_sample_s=0.5)[0].sessions
    rows = s["working_set"]
    assert s["working_set_peak_bytes"]["storage"] >= 2 * (8000 // 64) * 64 * 1000  # both first contexts stored
    assert rows[0]["storage_bytes"] == 0 and max(r["storage_bytes"] for r in rows) > 0
    assert rows[-1]["storage_bytes"] == 0 and rows[-1]["dram_demand_bytes"] == 0  # every session done
    assert len(rows) > 10 and s["working_set_peak_bytes"]["dram_demand"] > 0


@pytest.mark.parametrize("system", ["oracle", "dualpath-rr"])
def test_prefetch_needs_a_system_that_reads_with_the_papers_policy(system):
    with pytest.raises(ValueError, match="prefetch and affinity"):
        SimConfig(FAST, MODEL, ENGINE, 1, 1, system, prefetch=True)


@pytest.mark.parametrize("prefill_nodes", [1, 2])
def test_prefetches_go_where_the_scheduler_sends_them(prefill_nodes):
    """The target is ``SchedulerCore._prefetch_engine``'s: with one prefill group the last prefill or decode engine
    by the shorter read queue, with more the last decode engine (a turn's prefill engine is not sure then); a turn
    placed where its prefetch went reads on that side."""
    r, sim = slow_store_run(True, 3.0, agents=4, p=prefill_nodes, d=2, affinity=True)
    held = {eid: p for eid, p in sim.sessions.engines.items() if p.ready}
    s = r.sessions
    assert s["prefetch_counts"]["orders"] == 4 * 5 and s["scheduler"]["prefetch_orders"] == 20
    if prefill_nodes > 1:
        assert all(eid.startswith("d") for eid in held)
        assert all(not t[8] for t in sim.sessions.turns if t[3])  # placed on its prefetch: the DE path
    else:
        assert held
    assert s["prefetched_fraction"] > 0.5 and s["follow_up_prefetched"]["ttft_p50_s"] < 0.3
