"""Tensor-parallel engines in the cluster simulator and in ``dualpath plan``/``simulate``: a node of g GPUs runs
g / TP engines of TP GPUs, each with TP GPUs' KV tokens and TP GPUs' compute less the all-reduces."""

import json
import logging

import pytest

from dualpath.cli import main
from dualpath.core.errors import ConfigError
from dualpath.core.messages import Role
from dualpath.sim.cluster import ClusterSim, SimConfig
from dualpath.sim.hardware import MODELS, EngineModel, Hardware, ModelPreset
from dualpath.sim.links import PE_PATH, path_route
from dualpath.engines.batcher import CostModel

MODEL = ModelPreset("toy", 1000)  # 1 KB of KV per token
ENGINE = EngineModel(
    CostModel(0.01, 0.001, 0.0),
    decode_fixed_s=0.016,
    decode_per_seq_s=0.0,
    decode_per_token_s=0.0,
    decode_kv_tokens=100_000,
    num_layers=2,
)


def _small_run(**tp):
    from dualpath.rollout.tracegen import trace_shapes

    rounds, _ = trace_shapes("64k", 16, 0.5, 0.1, 5)
    hw, model = Hardware(gpus=4, storage_read_bps=13e9), MODELS["ds27b"]
    sim = ClusterSim(SimConfig(hw, model, model.engine, 1, 2, "dualpath", 40e9, **tp), rounds)
    return sim, sim.run()


def test_tp_1_is_exactly_the_run_before_tp_existed():
    """The default call, an explicit TP 1, and the numbers this run gave before tensor parallelism was modelled
    (commit 48f7ea7): bit for bit, engine ids included."""
    default, r0 = _small_run()
    _, r1 = _small_run(prefill_tp=1, decode_tp=1)
    assert (r0.jct_s, r0.ttft_s, r0.tpot_s, r0.link_bytes) == (r1.jct_s, r1.ttft_s, r1.tpot_s, r1.link_bytes)
    assert r0.jct_s == 24.978972212532838 and r0.turns == 150
    assert sum(r0.ttft_s) == 22.804320512058414 and default.prefill_busy_s == 9.787635674210014
    assert r0.storage_read_bytes == {"p0": 2514862080.0, "d1": 2481684480.0, "d0": 2262712320.0}
    assert sorted(default.engines) == [f"{n}-{i}" for n in ("d0", "d1", "p0") for i in range(4)]
    assert ENGINE.with_tp(1) is ENGINE and ENGINE.tp_speedup(1) == 1


def test_a_tp_2_decode_engine_holds_twice_the_kv_tokens_and_there_are_half_as_many():
    hw = Hardware(gpus=4)
    one = ClusterSim(SimConfig(hw, MODEL, ENGINE, 1, 1), [])
    two = ClusterSim(SimConfig(hw, MODEL, ENGINE, 1, 1, decode_tp=2), [])
    decode = lambda sim: [e for e in sim.engines.values() if e.info.role is Role.DECODE]
    assert len(decode(one)) == 4 and len(decode(two)) == 2
    assert [e.gpu for e in decode(two)] == [("d0", 0), ("d0", 2)] and {e.ranks for e in decode(two)} == {2}
    for e in decode(two):  # what the scheduler was told at registration, and what it counts as free
        rec = two.core.engines[e.info.engine_id]
        assert rec.info.capacity_tokens == 2 * ENGINE.decode_kv_tokens
        assert two.core._state(rec).free_tokens == 2 * ENGINE.decode_kv_tokens
        assert two._load(e, 0).free_tokens == 2 * ENGINE.decode_kv_tokens
    assert sum(len(sim.engines) for sim in (one, two)) == 8 + 6  # the prefill engines are untouched
    assert decode(one)[0].info.capacity_tokens == ENGINE.decode_kv_tokens
    # and it steps by its ranks' compute: a 16 ms step of one GPU takes 16 x (1 + 0.05) / 2 ms
    r = ClusterSim(SimConfig(hw, MODEL, ENGINE, 1, 1, pull_interval_s=0.05, decode_tp=2), [[(128, 4)]]).run()
    assert r.tpot_s == [pytest.approx(0.016 * 1.05 / 2, abs=1e-12)]


def test_a_tp_prefill_engine_computes_its_ranks_worth_less_the_all_reduces():
    """One agent on a 2-GPU prefill node at TP 2: its first round (128 new tokens: 0.138 s on one GPU) is placed
    at the prefill pull at 0.025 and takes 0.138 x (1 + 0.05) / 2 s; the scheduler's beta (5 s of prefill, its
    compute quota) grows by the same speed-up."""
    hw = Hardware(gpus=2, cnic_bps=1e12, snic_bps=1e12, dram_bps=1e12)
    cfg = SimConfig(hw, MODEL, ENGINE, 1, 1, storage_bps=1e6, pull_interval_s=0.05, pull_jitter=0.0, prefill_tp=2)
    sim = ClusterSim(cfg, [[(128, 4)]])
    r = sim.run()
    assert r.ttft_s[0] == pytest.approx(0.025 + 0.138 * 1.05 / 2, abs=1e-12)
    assert sim.prefill_busy_s == pytest.approx(0.138 * 1.05)  # GPU seconds: both ranks were busy
    (pe,) = [e for e in sim.engines.values() if e.info.role is Role.PREFILL]
    assert pe.info.beta_tokens == pytest.approx((5.0 - 0.01 * 0.525) / (0.001 * 0.525), abs=1)
    assert ENGINE.tp_speedup(8) == pytest.approx(8 / 1.35)


def test_with_tp_scales_kv_and_every_timing():
    e = EngineModel(CostModel(0.01, 0.001, 1e-6), 0.02, 1e-4, 1e-8, 1000, 4, tp_comm=0.1)
    four = e.with_tp(4)
    f = 1.3 / 4
    assert four.decode_kv_tokens == 4000 and four.num_layers == 4
    assert four.decode_step(32, 10_000) == pytest.approx(e.decode_step(32, 10_000) * f)
    assert four.prefill.predict([(500, 100)]) == pytest.approx(e.prefill.predict([(500, 100)]) * f)
    with pytest.raises(ConfigError, match="tp_comm"):
        EngineModel(CostModel(), 0.0, 0.0, 0.0, 1, 1, tp_comm=-0.1)


def test_saturated_prefill_throughput_follows_the_tp_efficiency():
    """Identical one-round agents, no storage (oracle), fast decode: prefill-bound, so turns/s at prefill TP t is
    TP 1's x speed-up(t) / t (the same GPUs, less the all-reduces); decode TP changes nothing here."""
    rounds = [[(4000, 4)] for _ in range(600)]
    hw = Hardware(gpus=8)
    rate = {}
    for tp in ((1, 1), (8, 1), (1, 4)):
        r = ClusterSim(SimConfig(hw, MODEL, ENGINE, 1, 1, "oracle", prefill_tp=tp[0], decode_tp=tp[1]), rounds).run()
        rate[tp] = r.turns / r.jct_s
    assert rate[8, 1] / rate[1, 1] == pytest.approx(ENGINE.tp_speedup(8) / 8, rel=0.03)
    assert rate[1, 4] == pytest.approx(rate[1, 1], rel=0.01)


def test_reads_spread_over_the_ranks_cnics_and_node_totals_stay():
    one = path_route(PE_PATH, ("p0", 0), ("d0", 0))
    assert one == path_route(PE_PATH, ("p0", 0), ("d0", 0), 1, 1)
    four = dict(path_route(PE_PATH, ("p0", 4), ("d0", 0), 4, 2))
    assert four["p0/gpu4/cnic_read"] == four["p0/gpu7/cnic_read"] == dict(one)["p0/gpu0/cnic_read"] / 4
    assert "p0/gpu3/cnic_read" not in four and "d0/gpu2/cnic_write" not in four
    for link in ("cnic_read", "cnic_write", "snic", "dram"):  # per node and link, the same bytes as at TP 1
        for node in ("p0", "d0"):
            total = lambda route: sum(f for n, f in route if n.startswith(node + "/") and n.endswith(link))
            assert total(four.items()) == pytest.approx(total(one))


def test_bad_tp_is_refused_with_a_clear_message(capsys):
    with pytest.raises(ConfigError, match="prefill tensor-parallel size 3 does not divide the node's 8 GPUs"):
        SimConfig(Hardware(gpus=8), MODEL, ENGINE, 1, 1, prefill_tp=3)
    with pytest.raises(ConfigError, match="decode tensor-parallel size must be a whole number of GPUs >= 1"):
        SimConfig(Hardware(gpus=8), MODEL, ENGINE, 1, 1, decode_tp=0)
    assert main(["plan", "--gpus", "4", "--decode-tp", "8"]) == 2
    assert "decode tensor-parallel size 8 does not divide the node's 4 GPUs" in capsys.readouterr().err
    for cmd in ("plan", "simulate"):
        with pytest.raises(SystemExit):
            main([cmd, "--prefill-tp", "0"])
        assert "--prefill-tp/--prefill-tensor-parallel-size: a tensor-parallel size" in capsys.readouterr().err


def test_plan_json_reports_the_engines_of_each_role(capsys):
    assert main(["plan", "--prefill-tp", "8", "--decode-tp", "4", "--prefill", "2", "--decode", "4", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert main(["plan", "--prefill", "2", "--decode", "4", "--json"]) == 0
    tp1 = json.loads(capsys.readouterr().out)
    assert (got["prefill_tp"], got["decode_tp"]) == (8, 4)
    p, d = got["engines"]["prefill"], got["engines"]["decode"]
    assert (p["tp"], p["engines_per_node"], p["engines"]) == (8, 1, 2)
    assert (d["tp"], d["engines_per_node"], d["engines"]) == (4, 2, 8)
    assert d["kv_tokens"] == 4 * MODELS["ds660b"].engine.decode_kv_tokens
    assert p["compute_gpus"] == pytest.approx(8 / 1.35)
    assert (tp1["engines"]["prefill"]["engines"], tp1["engines"]["decode"]["engines"]) == (16, 32)
    assert {k: got[k] for k in ("low", "high", "splits")} == {k: tp1[k] for k in ("low", "high", "splits")}  # per node
    assert main(["plan", "--prefill-tensor-parallel-size", "2", "--decode-tensor-parallel-size", "8"]) == 0
    assert "prefill 4 per node at TP 2" in capsys.readouterr().out


@pytest.fixture
def scheduler_log_level():
    """``dualpath simulate`` quiets the scheduler's logger; put its level back for the tests after."""
    import logging

    logger = logging.getLogger("dualpath.scheduler")
    level = logger.level
    yield
    logger.setLevel(level)


def test_simulate_with_one_prefill_engine_per_node(capsys, caplog, scheduler_log_level):
    """(And the simulated engines' joining is not logged: a 48P96D run would print 1,152 lines.)"""
    caplog.set_level(logging.INFO)
    argv = [
        "simulate",
        "--prefill",
        "1",
        "--decode",
        "1",
        "--gpus",
        "8",
        "--agents",
        "6",
        "--scale",
        "0.1",
        "--turns-scale",
        "0.1",
        "--systems",
        "dualpath",
        "--model",
        "ds27b",
    ]
    assert main(argv + ["--prefill-tp", "8", "--decode-tp", "4", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["prefill_engines"], row["decode_engines"], row["prefill_tp"], row["decode_tp"]) == (1, 2, 8, 4)
    assert row["turns"] > 0 and row["jct_s"] > 0
    assert main(argv + ["--prefill-tp", "8"]) == 0
    assert "engines: prefill 1 (1 per node) at TP 8" in capsys.readouterr().out
    assert not [r for r in caplog.records if r.name.startswith("dualpath.scheduler") and r.levelno < logging.WARNING]
