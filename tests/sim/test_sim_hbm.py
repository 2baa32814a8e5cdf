"""The prefill GPUs' HBM bound in the simulator: basic prefill keeps every layer of a request's KV resident from its
read's start to its prefill's end, layerwise two layers; reads that do not fit wait for earlier prefills."""

import math

import pytest

from dualpath.engines.batcher import CostModel
from dualpath.sim.cluster import ClusterSim, SimConfig
from dualpath.sim.hardware import MODELS, PAPER_CLUSTER_NODE, EngineModel, Hardware, ModelPreset

HW = Hardware(gpus=1, cnic_bps=1e12, snic_bps=1e12, dram_bps=1e12)
MODEL = ModelPreset("toy", 1000)  # 1 KB of KV per token (all layers)
ENGINE = EngineModel(CostModel(0.01, 0.001, 0.0), 0.016, 0.0, 0.0, 100_000, num_layers=8)
ROUNDS = [[(128, 4), (60, 4)] for _ in range(3)]  # prompts of 128 then 192 tokens: 128 KB, then 192 KB


def run(system: str, budget: float | None):
    cfg = SimConfig(
        HW, MODEL, ENGINE, 1, 1, system, storage_bps=1e6, pull_interval_s=0.05, prefill_kv_budget_bytes=budget
    )
    sim = ClusterSim(cfg, ROUNDS)
    return sim, sim.run()


def test_basic_reads_wait_for_hbm_room_and_layerwise_ones_do_not():
    budget = 250e3  # one 192 KB prompt at a time over all layers; all three over two layers (48 KB each)
    free_sim, free = run("basic", None)
    sim, bound = run("basic", budget)
    assert free_sim.hbm_waits == [] and free_sim.engines["p0-0"].resident_peak > budget
    assert len(sim.hbm_waits) >= 2 and sim.engines["p0-0"].resident_peak <= budget
    assert bound.turns == free.turns == 6 and bound.jct_s > free.jct_s  # reads no longer overlap prefills
    assert sim.engines["p0-0"].resident == pytest.approx(0.0) and not sim.engines["p0-0"].hbm_wait

    lw_free_sim, lw_free = run("layerwise", None)
    lw_sim, lw_bound = run("layerwise", budget)
    assert lw_sim.hbm_waits == [] and lw_bound.jct_s == lw_free.jct_s and lw_bound.ttft_s == lw_free.ttft_s


def test_a_prompt_over_the_budget_is_an_error_not_a_hang():
    with pytest.raises(ValueError, match="HBM budget"):
        run("basic", 100e3)  # the 128-token first round alone needs 128 KB


def test_the_paper_node_budget_comes_from_the_weights():
    m = MODELS["ds660b"]
    cfg = SimConfig(PAPER_CLUSTER_NODE, m, m.engine, 2, 4, "basic")
    per_gpu = cfg.pe_kv_budget_bytes()
    # 80 GiB - 19.8 GB on every GPU - 653.8 GB of experts over 16 GPUs - 6 GB reserve
    assert per_gpu == pytest.approx(80 * 2**30 - 19.8e9 - 653.8e9 / 16 - 6e9)
    assert 13 < per_gpu / (m.kv_bytes_per_token * 32_721) < 15  # ~14 of the 64K trace's mean prompts, all layers
    one_node = SimConfig(PAPER_CLUSTER_NODE, m, m.engine, 1, 1, "basic")  # 8 GPUs cannot hold the experts
    assert math.isinf(one_node.pe_kv_budget_bytes())
