"""``dualpath plan`` (the P/D ratios that add no link bottleneck, paper §4.2) and ``dualpath simulate`` (an agentic
trace on a simulated cluster placed by the real scheduler): their options and commands."""

from __future__ import annotations

import argparse
import logging
import os

from dualpath.cli.options import Options, gpu_count, opt, options
from dualpath.sim.hardware import MODELS  # plain data

PRESETS = ["32k", "48k", "64k"]  # dualpath.rollout.tracegen.PRESETS


@options
class HardwareOptions(Options):
    """One node of the simulated cluster (``dualpath.sim.hardware.Hardware``)."""

    GROUP = "the node"

    gpus: int = opt(8, "GPUs per node (one compute NIC each)")
    cnic_gbps: float = opt(400.0, "compute NIC bandwidth per GPU, Gbps")
    snic_gbps: float = opt(400.0, "storage NIC bandwidth per node, Gbps")
    dram_gbs: float = opt(500.0, "node DRAM bandwidth, GB/s")
    storage_read_gbs: float | None = opt(
        None,
        "what one node's storage client reads, GB/s (0: the SNIC's line rate); the §4.2 bounds use the SNIC line rate",
        default_text="the paper's, 14.6, calibrated from its Basic runs",
    )
    storage_gbps: float | None = opt(
        None,
        "simulations: cap the storage system's aggregate read bandwidth, Gbps (0: no cap beyond each node's "
        "--storage-read-gbs)",
        default_text="no cap",
    )


@options
class SimParallelOptions(Options):
    """The GPUs of each role's engines: a node runs --gpus / N engines of that role."""

    GROUP = "tensor parallelism"

    prefill_tp: int = opt(
        1,
        "GPUs per prefill engine: a prefill node runs --gpus / N engines of N GPUs each (N must divide --gpus), each "
        "with N GPUs' compute less the all-reduces (--tp-comm); node links are the same at any N (1: an engine per "
        "GPU)",
        flags=("--prefill-tp", "--prefill-tensor-parallel-size"),
        type=gpu_count,
        metavar="N",
    )
    decode_tp: int = opt(
        1,
        "GPUs per decode engine: a decode node runs --gpus / N engines of N GPUs each (N must divide --gpus), each "
        "with N GPUs' KV tokens and N GPUs' compute less the all-reduces (--tp-comm); node links are the same at "
        "any N (1: an engine per GPU)",
        flags=("--decode-tp", "--decode-tensor-parallel-size"),
        type=gpu_count,
        metavar="N",
    )
    tp_comm: float | None = opt(
        None,
        "tensor parallelism's all-reduce time as a fraction of one GPU's compute for the same tokens: an engine of "
        "N GPUs computes N / (1 + F (N - 1)) times as fast as one (see EngineModel in dualpath/sim/hardware.py)",
        metavar="F",
        default_text="the model preset's, 0.05",
    )


@options
class PlanOptions(Options):
    nodes: int = opt(0, "list the P/D splits of this many nodes in range")
    prefill: int = opt(0, "with --decode: per-link loads of this split (prefill nodes)")
    decode: int = opt(0, "with --prefill: per-link loads of this split (decode nodes)")
    model: str = opt(
        "ds660b", "KV bytes per token of this preset, and its engines' KV tokens and timings", choices=sorted(MODELS)
    )
    hit_tokens: int = opt(0, "with --prefill/--decode: stored tokens loaded per turn")
    json: bool = opt(False, "the result as JSON (for machines)")
    simulate: bool = opt(
        False, "also simulate every split of --nodes under the model preset and trace; report the best"
    )
    preset: str = opt("64k", "with --simulate: the trace", choices=PRESETS)
    agents_per_node: int = opt(170, "with --simulate: agents (enough to saturate)")
    seconds: float = opt(900.0, "with --simulate: simulated seconds per split")
    target_turns_per_s: float = opt(0.0, "with --simulate: the nodes this rate needs at the best ratio")
    jobs: int | None = opt(None, "with --simulate: splits simulated at once, one process each", default_text="the CPUs")


@options
class SimulateOptions(Options):
    prefill: int = opt(2, "prefill nodes")
    decode: int = opt(4, "decode nodes")
    model: str = opt(
        "ds660b",
        "model preset: KV bytes per token and calibrated engine timings (dualpath/sim/hardware.py)",
        choices=sorted(MODELS),
    )
    preset: str = opt("64k", "trace statistics (Table 2)", choices=PRESETS)
    agents: int = opt(64, "agents of the trace")
    scale: float = opt(1.0, "scale tokens per round")
    turns_scale: float = opt(1.0, "scale rounds per agent")
    systems: str = opt("basic,layerwise,dualpath-rr,dualpath,oracle", "the systems to simulate, comma-separated")
    prefill_tps: float = opt(
        0.0,
        "override the model preset: prefill tokens/s of one GPU, flat in context (an engine at --prefill-tp N: N "
        "GPUs' worth less the all-reduces; 0: the preset's)",
    )
    decode_step_ms: float = opt(0.0, "override the preset: a flat decode step time (0: the preset's)")
    decode_kv_tokens: int = opt(
        0, "override the preset: KV tokens a decode GPU holds (an engine at --decode-tp N: N times it; 0: the preset's)"
    )
    layers: int = opt(0, "override the preset's layer count (0: the preset's)")
    pull_interval: float = opt(0.1, "seconds between an engine group's pulls")
    online_seconds: float = opt(
        0.0,
        "also find each system's highest Poisson agent arrival rate holding the paper's SLO (mean TTFT <= 4 s, TPOT "
        "<= 50 ms) over the second half of runs of this many seconds (0: no)",
    )
    seed: int = opt(0, "the trace's random seed")
    json: bool = opt(False, "the result as JSON (for machines)")


PLAN = (PlanOptions, HardwareOptions, SimParallelOptions)
SIMULATE = (SimulateOptions, HardwareOptions, SimParallelOptions)


def _with_tp_comm(args: argparse.Namespace, engine):
    """One GPU's engine model with ``--tp-comm`` applied (None: the model's own)."""
    from dataclasses import replace

    return engine if args.tp_comm is None else replace(engine, tp_comm=args.tp_comm)


def _sim_layout(args: argparse.Namespace, hw, engine) -> dict:
    """Each role's engines per node, TP, compute (in GPUs) and decode KV tokens; a TP the node cannot take is a
    ConfigError, before any simulation starts."""
    from dualpath.sim.plan import engine_layout

    return engine_layout(hw, _with_tp_comm(args, engine), args.prefill_tp, args.decode_tp)


def _hardware(args: argparse.Namespace):
    from dualpath.sim.hardware import GBPS, PAPER_STORAGE_READ_BPS, Hardware

    read = PAPER_STORAGE_READ_BPS if args.storage_read_gbs is None else args.storage_read_gbs * 1e9
    return Hardware(
        gpus=args.gpus,
        cnic_bps=args.cnic_gbps * GBPS,
        snic_bps=args.snic_gbps * GBPS,
        dram_bps=args.dram_gbs * 1e9,
        storage_read_bps=read,
    )


def cmd_simulate(args: argparse.Namespace) -> int:
    """Each system on the same trace and simulated cluster; a table (or JSON) of job completion times."""
    import json

    from dualpath.sim.cluster import engine_for, simulate_systems

    logging.getLogger("dualpath.scheduler").setLevel(logging.WARNING)  # thousands of simulated engines join
    hw = _hardware(args)
    layout = _sim_layout(args, hw, engine_for(args))  # refuses a bad TP before the trace is built
    rows = simulate_systems(args, hw)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(_engines_line(layout, args.prefill, args.decode))
    print(f"{'system':<12} {'JCT s':>9} {'turns/s':>9} {'TTFT p50 ms':>12} {'reads max/avg':>14}  busiest link")
    for r in rows:
        online = f"  online capacity {r['online_agents_per_s']:.3g} agents/s" if "online_agents_per_s" in r else ""
        print(
            f"{r['system']:<12} {r['jct_s']:>9.1f} {r['turns_per_s']:>9.1f} {r['ttft_p50_s'] * 1e3:>12.0f} "
            f"{r['storage_read_max_over_avg']:>14.2f}  {r['busiest_link']} {r['busiest_utilization']:.0%}{online}"
        )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """The P/D ratios that add no bottleneck (paper §4.2) for the given node, and the link loads of one split."""
    import json

    from dualpath.sim.hardware import MODELS
    from dualpath.sim.plan import as_fraction, bottleneck_free_range, describe, node_counts, storage_bound_turns_per_s

    hw = _hardware(args)
    layout = _sim_layout(args, hw, MODELS[args.model].engine)  # the §4.2 range is per node: TP leaves it as is
    r = bottleneck_free_range(hw)
    splits = node_counts(r, args.nodes) if args.nodes else []
    if args.json:
        print(
            json.dumps(
                {
                    "storage_ratio": hw.storage_ratio,
                    "low": r.low,
                    "high": r.high,
                    "binding_high": r.binding_high,
                    "feasible": r.feasible,
                    "splits": splits,
                    "prefill_tp": args.prefill_tp,
                    "decode_tp": args.decode_tp,
                    "engines": _with_engine_counts(layout, args.prefill, args.decode),
                }
            )
        )
        return 0
    print(
        f"node: {hw.gpus} GPUs, CNIC {args.cnic_gbps:g} Gbps each, SNIC {args.snic_gbps:g} Gbps (s = "
        f"{hw.storage_ratio:.3g}), DRAM {args.dram_gbs:g} GB/s"
    )
    print(_engines_line(layout, args.prefill, args.decode))
    if not r.feasible:
        print(
            "no P/D ratio is bottleneck-free: "
            + ("s > g/2 saturates the prefill CNICs" if not r.pe_read_ok else "the low bound exceeds the high bound")
        )
    else:
        print(
            f"bottleneck-free P/D: {as_fraction(r.low)} ({r.low:.3f}) .. {as_fraction(r.high)} ({r.high:.3f}),"
            f" upper bound set by the {r.binding_high}"
        )
    if args.nodes:
        print(f"splits of {args.nodes} nodes inside it: " + (", ".join(f"{p}P{d}D" for p, d in splits) or "none"))
    if args.simulate:
        _plan_by_simulation(args, hw, splits)
    if args.prefill and args.decode:
        print(describe(hw, args.prefill, args.decode))
        if args.hit_tokens:
            m = MODELS[args.model]
            dual = storage_bound_turns_per_s(hw, args.prefill + args.decode, m.kv_bytes_per_token, args.hit_tokens)
            basic = storage_bound_turns_per_s(hw, args.prefill, m.kv_bytes_per_token, args.hit_tokens)
            print(
                f"{m.name}, {args.hit_tokens} stored tokens per turn ({m.kv_bytes_per_token / 1024:.0f} KiB each): "
                f"storage-bound {dual:.1f} turns/s with both paths, {basic:.1f} through prefill nodes only"
            )
    return 0


def _with_engine_counts(layout: dict, prefill_nodes: int, decode_nodes: int) -> dict:
    """``layout`` with each role's engines in the cluster when a split is given (else 0)."""
    nodes = {"prefill": prefill_nodes, "decode": decode_nodes}
    return {role: {**v, "engines": v["engines_per_node"] * nodes[role]} for role, v in layout.items()}


def _engines_line(layout: dict, prefill_nodes: int = 0, decode_nodes: int = 0) -> str:
    """One line: each role's engines per node, their TP, compute and (decode) KV tokens; cluster totals too."""
    parts = []
    for role, v in _with_engine_counts(layout, prefill_nodes, decode_nodes).items():
        kv = f", {v['kv_tokens'] / 1e6:.3g}M KV tokens" if "kv_tokens" in v else ""
        count = (
            f"{v['engines']} ({v['engines_per_node']} per node)"
            if v["engines"]
            else f"{v['engines_per_node']} per node"
        )
        parts.append(f"{role} {count} at TP {v['tp']}, each {v['compute_gpus']:.3g}x a GPU's compute{kv}")
    return "engines: " + "; ".join(parts)


def _plan_by_simulation(args: argparse.Namespace, hw, in_range: list[tuple[int, int]]) -> None:
    """Every P/D split of ``--nodes`` (or, past 16 nodes, those in the bottleneck-free range) simulated under a
    closed loop of agents; the best, and the nodes a target rate needs at that ratio (throughput scales with
    nodes at a fixed ratio: see the scale part of bench/sim_reproduction.py)."""
    import math

    from dualpath.rollout.tracegen import trace_shapes
    from dualpath.sim.hardware import MODELS
    from dualpath.sim.plan import best_split, simulate_splits

    logging.getLogger("dualpath.scheduler").setLevel(logging.WARNING)
    if not args.nodes:
        raise SystemExit("plan --simulate needs --nodes")
    splits = [(p, args.nodes - p) for p in range(1, args.nodes)] if args.nodes <= 16 else in_range
    rounds, _ = trace_shapes(args.preset, args.agents_per_node * args.nodes)
    print(
        f"simulating {len(splits)} splits of {args.nodes} nodes, {MODELS[args.model].name}, {args.preset} trace, "
        f"{len(rounds)} agents, {args.seconds:g} s each (turns/s over the second half)"
    )
    print(f"{'split':>7} {'in range':>8} {'turns/s':>8} {'prefill busy':>12} {'TTFT s':>7}  busiest link")
    rows = []
    engine = _with_tp_comm(args, MODELS[args.model].engine)
    runs = simulate_splits(
        hw,
        MODELS[args.model],
        splits,
        rounds,
        args.seconds,
        jobs=args.jobs or os.cpu_count() or 1,
        storage_gbps=args.storage_gbps,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        engine=engine,
    )
    for (p, d), r in zip(splits, runs):
        rows.append(r)
        print(
            f"{p:>3}P{d}D {'yes' if (p, d) in in_range else 'no':>8} {r['turns_per_s']:>8.1f} "
            f"{r['prefill_busy']:>12.0%} {r['ttft_mean_s']:>7.2f}  {r['busiest']} {r['busiest_utilization']:.0%}",
            flush=True,
        )
    best = best_split(rows)
    print(
        f"best: {best['prefill']}P{best['decode']}D at {best['turns_per_s']:.1f} turns/s (prefill GPUs "
        f"{best['prefill_busy']:.0%} busy; busiest link {best['busiest']} at {best['busiest_utilization']:.0%})"
    )
    if args.target_turns_per_s:
        scale = args.target_turns_per_s / best["turns_per_s"]
        p, d = math.ceil(scale * best["prefill"]), math.ceil(scale * best["decode"])
        print(
            f"{args.target_turns_per_s:g} turns/s at P/D {best['prefill']}:{best['decode']} needs about {p + d} "
            f"nodes ({p}P{d}D)"
        )
