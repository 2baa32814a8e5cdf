"""Agent sessions on the simulator at the paper's 48P96D scale: tool gaps between turns, with and without KV
prefetch during the gaps (issue 51; ``dualpath/sim/sessions.py``).

The cluster is the paper's scale run's (48 prefill and 96 decode nodes of 8 GPUs, DeepSeek 660B, storage read at
14.6 GB/s per node: ``dualpath/sim/hardware.py``), the trace Table 2's 64K one with coding-agent tool gaps
(``CODING_AGENT_TOOL_GAP``: median 1 s, p90 12 s; see ``dualpath/rollout/tracegen.py`` for the sources). To see a
steady state in a short run, each agent joins at a random round of its trajectory, its context so far already
stored (``ClusterSim(first_rounds=...)``), and the agents start within the first 10 s; the simulated run lasts
``--seconds`` and follow-up turns are measured after the first third. Runs (same trace, same starts):

* ``no-prefetch``: the paper's scheduler, turns naming no session (the runtime's ``dualpath``); the next turn
  comes ``tool_s`` after the last.
* ``affinity``: turns name their sessions and the scheduler's ``session_affinity`` is on (``dualpath+affinity``):
  phase 1 keeps a turn's decode group within 1.05 x the mean, phase 2 its decode engine under Z.
* ``prefetch``: affinity and ``session_prefetch`` (``dualpath+prefetch``): at ``end + max(0, q20(gap) - 1.5 x load
  time)`` the scheduler orders the session's stored KV read into its last decode engine's buffer (48 prefill groups:
  its prefill engine is not sure), the next turn prefers that engine and reads there on the DE path; the engines read
  at low priority (only while the node's storage client has no demand read), keep read blocks after use (LRU,
  within half the buffer) and free them 30 s+ after their last read or order.
All of the scheduler's part is the scheduler's own code (``dualpath/sim/sessions.py``); prefetch reads go
``--chunk-blocks`` blocks at a time (the runtime: one; chunks bound the events at this scale).

    PYTHONPATH=. python bench/sim_sessions.py [--agents 4800] [--seconds 90] [--jobs 3] [--chunk-blocks 64]

Writes ``bench/results/sim_sessions.json`` (each run's summary, with the working set over time) and prints a table:
follow-up TTFT (all, and split by prefetched or not), engines kept, prefetch bytes issued / used / wasted, extra
storage reads as a fraction of the hit KV, and the working set's peaks in storage and in the DRAM buffers.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from common import print_table, write_result  # noqa: E402

RUNS = {"no-prefetch": (False, False), "affinity": (False, True), "prefetch": (True, True)}
GB = 1e9


def run_one(task: dict) -> dict:
    """One simulator run: the summary of its sessions, tagged with the task."""
    logging.getLogger("dualpath.scheduler").setLevel(logging.WARNING)
    import numpy as np

    from dualpath.rollout.tracegen import trace_shapes, with_tool_gaps
    from dualpath.sim.cluster import ClusterSim, SimConfig
    from dualpath.sim.hardware import MODELS, PAPER_CLUSTER_NODE

    model = MODELS["ds660b"]
    shapes, _ = trace_shapes("64k", task["agents"], 1.0, 1.0, task["seed"])
    rounds = with_tool_gaps(shapes, task["gap_median_s"], task["gap_p90_s"], task["seed"])
    rng = np.random.default_rng(task["seed"] + 1)
    starts = rng.uniform(0, 10.0, len(rounds)).tolist()
    first = [int(rng.integers(0, len(r))) for r in rounds]
    prefetch, affinity = RUNS[task["run"]]
    cfg = SimConfig(
        PAPER_CLUSTER_NODE,
        model,
        model.engine,
        task["p"],
        task["d"],
        "dualpath",
        prefetch=prefetch,
        affinity=affinity,
        prefetch_chunk_blocks=task["chunk_blocks"],
    )
    t0 = time.perf_counter()
    sim = ClusterSim(cfg, rounds, starts, first_rounds=first)
    r = sim.run(until=task["seconds"])
    since = task["seconds"] / 3
    s = sim.sessions.summary(since=since)
    s.update(
        task=task,
        turns=r.turns,
        turns_per_s=sum(1 for t in r.ttft_at if t >= since) / (task["seconds"] - since),
        storage_read_bytes=sum(r.storage_read_bytes.values()),
        wall_s=time.perf_counter() - t0,
    )
    print(f"  done {task['run']:<12} {r.turns:,} turns in {s['wall_s']:.0f} s", flush=True)
    return s


def row(s: dict) -> dict:
    f, pre, nope = s["follow_up"], s["follow_up_prefetched"], s["follow_up_not_prefetched"]
    peak = s["working_set_peak_bytes"]
    return {
        "run": s["task"]["run"],
        "turns/s": s["turns_per_s"],
        "follow-ups": f["turns"],
        "TTFT p50": f["ttft_p50_s"],
        "TTFT p90": f["ttft_p90_s"],
        "prefetched": pre["turns"],
        "p50 prefetched": pre["ttft_p50_s"],
        "p50 not": nope["ttft_p50_s"],
        "DRAM share": s["dram_share_of_hits"],
        "kept PE": s["kept_prefill_engine"],
        "kept DE": s["kept_decode_engine"],
        "issued GB": s["prefetch_issued_bytes"] / GB,
        "used GB": s["prefetch_used_bytes"] / GB,
        "wasted GB": s["prefetch_wasted_bytes"] / GB,
        "served GB": s["prefetch_served_bytes"] / GB,
        "extra reads": s["extra_storage_read_fraction"],
        "storage WS GB": peak["storage"] / GB,
        "DRAM demand GB": peak["dram_demand"] / GB,
        "DRAM prefetch GB": peak["dram_prefetch"] / GB,
        "wall_s": s["wall_s"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", type=int, default=48, help="prefill nodes (decode: twice as many)")
    ap.add_argument("--agents", type=int, default=4800, help="agents (the paper's offline run: 49,152, saturated)")
    ap.add_argument("--seconds", type=float, default=90.0, help="simulated seconds")
    ap.add_argument("--gap-median-s", type=float, default=1.0)
    ap.add_argument("--gap-p90-s", type=float, default=12.0)
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated: " + ", ".join(RUNS))
    ap.add_argument("--jobs", type=int, default=3, help="processes (one per run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk-blocks", type=int, default=64, help="blocks per prefetch read (the runtime: 1)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    base = {
        "p": args.prefill,
        "d": 2 * args.prefill,
        "agents": args.agents,
        "seconds": args.seconds,
        "gap_median_s": args.gap_median_s,
        "gap_p90_s": args.gap_p90_s,
        "seed": args.seed,
        "chunk_blocks": args.chunk_blocks,
    }
    tasks = [{**base, "run": name} for name in args.runs.split(",")]
    print(
        f"{len(tasks)} runs of {args.prefill}P{2 * args.prefill}D, {args.agents:,} agents, {args.seconds:g} s",
        flush=True,
    )
    with multiprocessing.get_context("fork").Pool(min(args.jobs, len(tasks))) as pool:
        runs = pool.map(run_one, tasks, chunksize=1)
    rows = [row(s) for s in runs]
    path = write_result(
        "sim_sessions", {"setup": base, "wall_s": time.perf_counter() - t0, "table": rows, "runs": runs}, args.out
    )
    print_table(rows, list(rows[0]))
    print(f"\n(TTFT in s over the follow-up turns after the first third; GB = 1e9 bytes) wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
