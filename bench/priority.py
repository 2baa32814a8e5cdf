"""Priority scheduling under overload, in the simulator (the project's ``SchedulerCore`` places every request, the
prefill GPUs run their ready work most urgent first, as ``PrefillEngine._batchable`` does).

A DualPath cluster (DeepSeek 27B, 1P2D of the paper's nodes) serves multi-turn agents arriving as a Poisson stream;
one agent in ``--urgent-every`` is urgent (priority -1 on every turn). The cluster's capacity is found first (the
highest arrival rate whose mean TTFT meets the paper's 4 s objective, first come, first served); then each load
(a fraction of that capacity) runs twice on the same arrivals: ``--scheduling-policy priority`` and first come,
first served (the baseline). Reported: time to first token of the urgent and the other turns over the run's second
half, and the urgent turns' median TTFT under priority as a fraction of first come, first served.

Offline (``--offline-agents``, a rollout job's closed loop: every agent starts at once): the job's completion time
with ``dualpath rollout --longest-first`` (each round's priority minus its agent's rounds left) against first come,
first served, on the same trace, for each of ``--offline-seeds`` traces.

    python bench/priority.py [--loads 0.8,1.2] [--seconds 200] [--offline-agents 400]
                             [--out bench/results/priority.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_result  # noqa: E402


def arrivals(rate: float, seconds: float, seed: int) -> list[float]:
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=int(rate * seconds * 2) + 1)
    return [float(t) for t in np.cumsum(gaps) if t < seconds]


def ttfts(result, urgent, since: float) -> tuple[list[float], list[float]]:
    """(urgent turns' TTFTs, the others') whose first token came at ``since`` or later."""
    mine, others = [], []
    for x, agent, at in zip(result.ttft_s, result.ttft_agent, result.ttft_at):
        if at >= since:
            (mine if urgent(agent) else others).append(x)
    return mine, others


def offline_jct(cfg, args, seed: int) -> dict:
    """A rollout job's completion time, first come, first served and longest first, on one trace."""
    from dualpath.rollout.tracegen import trace_shapes
    from dualpath.sim.cluster import ClusterSim

    rounds, _ = trace_shapes(args.preset, args.offline_agents, 1.0, args.offline_turns_scale, seed)
    t = time.perf_counter()
    jct = {}
    for name, c in (("fcfs", cfg), ("longest_first", replace(cfg, scheduling_policy="priority", longest_first=True))):
        jct[name] = ClusterSim(c, rounds).run().jct_s
    print(f"  offline seed {seed}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    turns = [len(r) for r in rounds]
    return {
        "seed": seed,
        "agents": args.offline_agents,
        "turns_min": min(turns),
        "turns_max": max(turns),
        "jct_fcfs_s": jct["fcfs"],
        "jct_longest_first_s": jct["longest_first"],
        "jct_ratio": jct["longest_first"] / jct["fcfs"],
    }


def main() -> int:
    from dualpath.rollout.tracegen import trace_shapes
    from dualpath.sim.cluster import ClusterSim, SimConfig, online_capacity
    from dualpath.sim.hardware import MODELS, PAPER_CLUSTER_NODE

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ds27b", choices=sorted(MODELS))
    ap.add_argument("--prefill", type=int, default=1, help="prefill nodes")
    ap.add_argument("--decode", type=int, default=2, help="decode nodes")
    ap.add_argument("--preset", default="32k", help="the trace preset (the paper's Table 2)")
    ap.add_argument("--turns-scale", type=float, default=0.1, help="scales the agents' turns (32k: 60 -> 6)")
    ap.add_argument("--loads", default="0.8,1.2", help="arrival rates as fractions of the capacity found")
    ap.add_argument("--seconds", type=float, default=200.0, help="simulated seconds per run")
    ap.add_argument("--urgent-every", type=int, default=10, help="agent i is urgent when i % N == 0")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--offline-agents", type=int, default=400, help="agents of the offline part (0: skip it)")
    ap.add_argument("--offline-turns-scale", type=float, default=0.3, help="its agents' turns (32k: 60 -> 18)")
    ap.add_argument("--offline-seeds", type=int, default=3, help="traces of the offline part")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    model = MODELS[args.model]
    pool, _ = trace_shapes(args.preset, 64, 1.0, args.turns_scale, args.seed)
    cfg = SimConfig(PAPER_CLUSTER_NODE, model, model.engine, args.prefill, args.decode, "dualpath")
    t = time.perf_counter()
    capacity = online_capacity(cfg, pool, args.seconds, warmup_s=args.seconds / 2, iters=4)["agents_per_s"]
    print(
        f"capacity (first come, first served, mean TTFT <= 4 s): {capacity:.2f} agents/s "
        f"({time.perf_counter() - t:.0f} s)",
        file=sys.stderr,
    )
    urgent = lambda agent: agent % args.urgent_every == 0  # noqa: E731
    rows = []
    for load in (float(x) for x in args.loads.split(",")):
        starts = arrivals(capacity * load, args.seconds, args.seed)
        agents = [pool[i % len(pool)] for i in range(len(starts))]
        priorities = [-1 if urgent(i) else 0 for i in range(len(starts))]
        for policy in ("fcfs", "priority"):
            t = time.perf_counter()
            sim = ClusterSim(
                replace(cfg, scheduling_policy=policy), agents, starts, priorities if policy == "priority" else None
            )
            mine, others = ttfts(sim.run(until=args.seconds), urgent, args.seconds / 2)
            rows.append(
                {
                    "load": load,
                    "agents_per_s": capacity * load,
                    "policy": policy,
                    "urgent_turns": len(mine),
                    "other_turns": len(others),
                    "urgent_ttft_p50_s": float(np.median(mine)),
                    "urgent_ttft_p90_s": float(np.percentile(mine, 90)),
                    "other_ttft_p50_s": float(np.median(others)),
                    "other_ttft_p90_s": float(np.percentile(others, 90)),
                }
            )
            print(f"  load {load:g} {policy}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    by = {(r["load"], r["policy"]): r for r in rows}
    for r in rows:
        base = by[r["load"], "fcfs"]
        r["urgent_p50_vs_fcfs"] = r["urgent_ttft_p50_s"] / base["urgent_ttft_p50_s"]
        r["other_p50_vs_fcfs"] = r["other_ttft_p50_s"] / base["other_ttft_p50_s"]
    print_table(
        rows,
        [
            "load",
            "policy",
            "urgent_turns",
            "urgent_ttft_p50_s",
            "urgent_ttft_p90_s",
            "other_ttft_p50_s",
            "other_ttft_p90_s",
            "urgent_p50_vs_fcfs",
            "other_p50_vs_fcfs",
        ],
    )
    offline = [offline_jct(cfg, args, seed) for seed in range(args.offline_seeds)] if args.offline_agents else []
    if offline:
        print_table(
            offline, ["seed", "agents", "turns_min", "turns_max", "jct_fcfs_s", "jct_longest_first_s", "jct_ratio"]
        )
    path = write_result(
        "priority",
        {
            "model": args.model,
            "prefill_nodes": args.prefill,
            "decode_nodes": args.decode,
            "preset": args.preset,
            "turns_scale": args.turns_scale,
            "seconds": args.seconds,
            "urgent_every": args.urgent_every,
            "capacity_agents_per_s": capacity,
            "rows": rows,
            "offline": offline,
        },
        args.out,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
