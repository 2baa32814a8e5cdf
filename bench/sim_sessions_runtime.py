"""Agent sessions, runtime vs simulator at the runtime benchmark's scale (issue 51): does the simulator, given one
calibrated profile of the CPU engines, reproduce what prefetch did on the runtime?

Input: a ``dualpath bench agentic`` run of the sessions systems on SmolLM2-135M (CPU, 1 prefill and 2 decode
engines, block 64, float32 KV), e.g.

    dualpath bench agentic --agents 6 --scale 0.2 --turns-scale 0.1 \\
        --systems dualpath,dualpath+affinity,dualpath+prefetch --storage-cap 20000000 \\
        --tool-gap-median-s 3 --tool-gap-p90-s 12 --out bench/results/agentic_sessions

its ``agentic.json`` and ``rounds-<system>.jsonl``. The script rebuilds the very same trace (``generate_trace`` with
the run's preset, agents, scale, turns scale, seed, tool gaps, and the vocabulary range ``agentic.py`` uses), checks
every round's prompt length against the runtime's, simulates the three systems on one profile of the CPU engines
(``cpu_profile``: the same for all three) and prints, per system, next to the runtime's: follow-up turns' TTFT p50
and its ratio to ``dualpath``'s, the fraction of follow-ups placed where their prefetch was, storage bytes read
against ``dualpath``'s, and JCT; and the relative error of the headline, the follow-up TTFT p50 ratio of
``dualpath+prefetch`` to ``dualpath`` (the issue asks for 10%).

    PYTHONPATH=. python bench/sim_sessions_runtime.py [bench/results/agentic_sessions] [--out ...]

Writes ``bench/results/sim_sessions_runtime.json``: the profile, each system's numbers (runtime and sim), the
headline's error and how much the runtime's own headline moves when its follow-up rounds are resampled, follow-up
TTFT p50 by read path and by whether the turn was placed on its prefetch, and every round's TTFT on both.

**The CPU profile** (``measure_profile``, ``cpu_profile``), from the run's configuration where it fixes a number and
from the runtime's rounds where it does not, pooled over the three systems (no system gets its own). A run's *quiet
tail* is the rounds sent after every agent but the last to finish was done (one agent left: nothing queues):

* one engine per node (the runtime's engines are nodes ``prefill-node0``, ``decode-node0/1``), the transport and
  local copies far faster than storage (``shm``: ~17 GB/s in ``bench/results/transport.json``);
* storage: every engine's ``ReadAccounting`` throttles to the run's cap; the rate the simulator reads at is the cap
  with the time per block the quiet tails' PE-path storage reads show on top (their compute hides behind the read,
  so their TTFT is the read and what comes after it: ~12-16 ms per 2.9 MB block);
* KV bytes per token from the checkpoint (float32: 2 x layers x KV heads x head dim x 4 = 46,080 for SmolLM2-135M),
  the decode engines' KV from ``agentic.py``'s 512 MiB cache, each engine's DRAM buffer its 256 MiB (91 blocks), of
  which prefetch takes at most half (``prefetch_share``), one block per prefetch read (as the runtime);
* pulls every 20 ms (the engines' interval); ``de_read_overlap=False``: the runtime's decode engine answers
  ``Prepare`` after its DE-side load, so a DE-path prefill starts once the read has ended;
* prefill: the fixed cost is the intercept of the quiet tails' PE-path follow-ups served from a DRAM buffer against
  their new tokens (~0.35 s: the prefill, the hand-off and the first token's trip); the per-token cost is the first
  rounds' rate while the decode engines run (all six queue at the start: the last first token after ~13 s for 2,023
  tokens, less six fixed costs: ~5.6 ms; uncontended it is ~4 ms, the simulator has no CPU contention: the three
  engines, the scheduler and the client share 2 cores);
* decode: a step alone is the quiet tails' median time per token (~80 ms); the busy phase's median (~0.14 s at ~3.3
  requests per engine) gives the cost per request batched (~27 ms).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from common import RESULTS, print_table, write_result  # noqa: E402

SYSTEMS = {"dualpath": (False, False), "dualpath+affinity": (False, True), "dualpath+prefetch": (True, True)}
BASE, HEADLINE = "dualpath", "dualpath+prefetch"
PULL_S = 0.02  # the engines pull every 20 ms
LINK_BPS = 17e9  # shm transport and local copies (bench/results/transport.json)
GOAL = 0.10  # the bound on the headline's relative error


def load_rounds(run_dir: Path, system: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"rounds-{system}.jsonl").read_text().splitlines() if line]


def measure_profile(run_dir: Path, cap_bps: float, block_bytes: int) -> dict:
    """The profile's timings as the runtime's rounds give them, pooled over the three systems' runs (see the module
    docstring). A run's *quiet tail*: the rounds sent after every agent but the last to finish was done."""
    quiet, busy, firsts = [], [], []
    for system in SYSTEMS:
        recs = load_rounds(run_dir, system)
        ends: dict[str, float] = {}
        for r in recs:
            ends[r["agent"]] = max(ends.get(r["agent"], 0.0), r["end"])
        last = max(ends, key=ends.get)
        calm = max((t for a, t in ends.items() if a != last), default=0.0)
        quiet += [r for r in recs if r["start"] > calm]
        busy += [r for r in recs if r["start"] <= calm]
        firsts.append([r for r in recs if r["round"] == 0])
    per_block = block_bytes / cap_bps
    # storage: PE-path follow-ups read from storage in the quiet tails (their compute hides behind the read)
    pe = [r for r in quiet if r["round"] and not r.get("prefetched") and r["path"] == "pe"]
    blocks = sum(r["kv_bytes"] for r in pe) / block_bytes
    extra = (sum(r["ttft"] for r in pe) - blocks * per_block) / blocks if blocks else 0.0
    # prefill, uncontended: follow-ups served from a DRAM buffer in the quiet tails, TTFT = fixed + per token x new
    dram = [r for r in quiet if r["round"] and r.get("prefetched") and r["path"] == "pe"]
    new = [r["prompt_tokens"] - r["cached_tokens"] for r in dram]
    if len(dram) >= 3:
        slope, fixed = statistics.linear_regression(new, [r["ttft"] for r in dram])
    else:
        slope, fixed = 0.0, 0.0
    # prefill while the decode engines run: a run's first rounds (no hit) all queue at the start; the last first
    # token comes after all of them were prefilled (median over the runs)
    spans = sorted(max(r["ttft"] for r in rs) - len(rs) * fixed for rs in firsts if rs)
    tokens = sorted(sum(r["prompt_tokens"] for r in rs) for rs in firsts if rs)
    busy_per_token = spans[len(spans) // 2] / tokens[len(tokens) // 2]
    # decode: a step alone (quiet tails) and with the busy phase's batch per engine (2 decode engines)
    alone = statistics.median(r["tpot"] for r in quiet if r["completion_tokens"] > 1)
    spans_d = [(r["start"] + r["ttft"], r["end"]) for r in busy]
    batch = (
        statistics.median(
            1 + sum(max(0.0, min(b, e) - max(a, s)) for s, e in spans_d if (s, e) != (a, b)) / max(1e-9, b - a)
            for a, b in spans_d
        )
        / 2
    )
    crowded = statistics.median(r["tpot"] for r in busy if r["completion_tokens"] > 1)
    per_seq = max(0.0, (crowded - alone) / max(1e-9, batch - 1)) if batch > 1 else 0.0
    return {
        "storage_read_bps": block_bytes / (per_block + extra),
        "storage_extra_s_per_block": extra,
        "prefill_fixed_s": fixed,
        "prefill_per_token_s": busy_per_token,
        "prefill_per_token_s_uncontended": slope,
        "decode_fixed_s": max(0.0, alone - per_seq),
        "decode_per_seq_s": per_seq,
        "decode_batch_busy": batch,
        "samples": {"quiet_pe_reads": len(pe), "quiet_dram_turns": len(dram), "busy_rounds": len(busy)},
    }


def kv_bytes_per_token(model: str, dtype_bytes: int = 4) -> tuple[int, int]:
    """(KV bytes per token, layers) of the run's checkpoint (float32 KV); SmolLM2-135M's when it is not here."""
    try:
        c = json.loads((Path(model) / "config.json").read_text())
        heads = c.get("num_key_value_heads", c["num_attention_heads"])
        head_dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
        return 2 * c["num_hidden_layers"] * heads * head_dim * dtype_bytes, c["num_hidden_layers"]
    except (OSError, KeyError, ValueError):
        return 46_080, 30


def vocab_size(model: str) -> int:
    try:
        return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    except (OSError, KeyError, ValueError):
        return 49_152  # SmolLM2's (only token ids depend on it: lengths and gaps do not)


def rebuild_trace(cfg: dict) -> list[list[tuple[int, int, float]]]:
    """The run's trajectories, as ``agentic.py`` generated them, in the simulator's (append, gen, tool_s) rounds."""
    from dualpath.rollout.tracegen import generate_trace

    vocab = vocab_size(cfg["model"])
    trajectories, _ = generate_trace(
        cfg["preset"],
        cfg["agents"],
        cfg["scale"],
        cfg["turns_scale"],
        (3, min(vocab, 32000) - 1),
        cfg["seed"],
        cfg["tool_gap_median_s"],
        cfg["tool_gap_p90_s"],
    )
    return [[(len(r.append), r.generate, r.tool_s or 0.0) for r in t.rounds] for t in trajectories]


def cpu_profile(cfg: dict, m: dict):
    """The hardware, model and engine timings of the run's CPU engines (``m``: ``measure_profile``'s numbers)."""
    from dualpath.engines.batcher import CostModel
    from dualpath.sim.hardware import EngineModel, Hardware, ModelPreset

    kv, layers = kv_bytes_per_token(cfg["model"])
    hw = Hardware(
        gpus=1, cnic_bps=LINK_BPS, snic_bps=LINK_BPS, dram_bps=2 * LINK_BPS, storage_read_bps=m["storage_read_bps"]
    )
    engine = EngineModel(
        CostModel(m["prefill_fixed_s"], m["prefill_per_token_s"], 0.0),
        m["decode_fixed_s"],
        m["decode_per_seq_s"],
        0.0,
        (512 << 20) // kv,  # agentic.py's decode cache: 512 MiB
        layers,
    )
    return hw, ModelPreset("SmolLM2-135M (float32 KV)", kv), engine, cfg.get("buffer_bytes", 256 << 20)


def simulate(cfg: dict, m: dict, rounds, system: str) -> dict:
    from dualpath.sim.cluster import ClusterSim, SimConfig

    hw, model, engine, buffer = cpu_profile(cfg, m)
    prefetch, affinity = SYSTEMS[system]
    sim_cfg = SimConfig(
        hw,
        model,
        engine,
        cfg["prefill"],
        cfg["decode"],
        "dualpath",
        block_size=cfg["block_size"],
        pull_interval_s=PULL_S,
        prefetch=prefetch,
        affinity=affinity,
        buffer_bytes_per_node=buffer,
        prefetch_chunk_blocks=1,
        session_sample_s=1.0,
        de_read_overlap=False,  # the runtime's decode engine answers Prepare after its load
    )
    sim = ClusterSim(sim_cfg, rounds)
    r = sim.run()
    s = r.sessions
    turns = [(x[8], x[3], x[1]) for x in sim.sessions.turns]  # (on the PE path, placed on its prefetch, TTFT)
    # follow-up rounds: every TTFT entry of an agent after its first (the sim's TTFTs come in prefill order)
    seen: dict[int, int] = {}
    per_round = {}
    for agent, ttft in zip(r.ttft_agent, r.ttft_s):
        k = seen.get(agent, 0)
        seen[agent] = k + 1
        per_round[(agent, k)] = ttft
    follow = [t for (a, k), t in per_round.items() if k > 0]
    return {
        "jct_s": r.jct_s,
        "rounds": r.turns,
        "ttft_followup_p50_s": statistics.median(follow) if follow else 0.0,
        "followups": len(follow),
        "prefetched_fraction": s["prefetched_fraction"],
        "dram_share_of_hits": s["dram_share_of_hits"],
        "storage_read_bytes": sum(r.storage_read_bytes.values()),
        "prefetch_read_bytes": s["prefetch_issued_bytes"],
        "prefetch_counts": s["prefetch_counts"],
        "by_path": by_path([("pe" if pe else "de", flag, t) for pe, flag, t in turns]),
        "per_round": {f"agent-{a}/{k}": t for (a, k), t in sorted(per_round.items())},
    }


def by_path(turns) -> dict:
    """Follow-ups' TTFT p50 by read path and whether they were placed where their prefetch was: (count, p50)."""
    out = {}
    for path in ("pe", "de"):
        for flag in (True, False):
            xs = [t for p, f, t in turns if p == path and bool(f) == flag]
            if xs:
                out[f"{path}{'/prefetched' if flag else ''}"] = [len(xs), statistics.median(xs)]
    return out


def bootstrap_ratio(a: list[float], b: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 5th and 95th percentiles of p50(a) / p50(b) over resamples of both (how much the runtime's own headline
    moves with which rounds it happened to have)."""
    import random

    rng = random.Random(seed)
    ratios = sorted(
        statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b))) for _ in range(n)
    )
    return ratios[int(0.05 * n)], ratios[int(0.95 * n) - 1]


def runtime(run_dir: Path, system: str, summary: dict) -> dict:
    recs = load_rounds(run_dir, system)
    later = [r for r in recs if r["round"] > 0]
    return {
        "jct_s": summary["job_completion_time_s"],
        "rounds": len(recs),
        "ttft_followup_p50_s": summary["ttft_followup_p50_s"],
        "followups": len(later),
        "prefetched_fraction": sum(1 for r in later if r.get("prefetched")) / len(later) if later else 0.0,
        "storage_read_bytes": summary["storage_read_bytes"],
        "tpot_p50_s": summary.get("tpot_p50_s"),
        "by_path": by_path([(r["path"], r.get("prefetched"), r["ttft"]) for r in later]),
        "followup_ttfts": [r["ttft"] for r in later],
        "prompt_tokens": {f"{r['agent']}/{r['round']}": r["prompt_tokens"] for r in recs},
        "per_round": {f"{r['agent']}/{r['round']}": r["ttft"] for r in recs},
    }


def check_trace(rounds, rt: dict) -> int:
    """Rounds whose prompt length differs between the rebuilt trace and the runtime's records (0: the same)."""
    bad = 0
    for i, rs in enumerate(rounds):
        context = 0
        for k, (append, gen, _) in enumerate(rs):
            want = rt["prompt_tokens"].get(f"agent-{i}/{k}")
            if want is not None and want != context + append:
                bad += 1
            context += append + gen
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", nargs="?", default=str(RESULTS / "agentic_sessions"), help="the agentic run's output dir")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    logging.getLogger("dualpath.scheduler").setLevel(logging.WARNING)
    run_dir = Path(args.run)
    result = json.loads((run_dir / "agentic.json").read_text())
    cfg, cap = result["config"], result["cap_bps"]
    summaries = {s["system"]: s for s in result["systems"]}
    missing = [s for s in SYSTEMS if s not in summaries]
    if missing:
        raise SystemExit(f"{run_dir}/agentic.json has no {', '.join(missing)} run")
    rounds = rebuild_trace(cfg)
    kv, _ = kv_bytes_per_token(cfg["model"])
    m = measure_profile(run_dir, cap, kv * cfg["block_size"])
    rows, systems = [], {}
    for system in SYSTEMS:
        rt = runtime(run_dir, system, summaries[system])
        mismatched = check_trace(rounds, rt)
        if mismatched:
            raise SystemExit(f"the rebuilt trace differs from the runtime's {system} run in {mismatched} rounds")
        systems[system] = {"runtime": rt, "sim": simulate(cfg, m, rounds, system)}
    for system, both in systems.items():
        row = {"system": system}
        for side in ("runtime", "sim"):
            x, base = both[side], systems[BASE][side]
            x["ttft_ratio_vs_dualpath"] = x["ttft_followup_p50_s"] / base["ttft_followup_p50_s"]
            x["storage_reads_vs_dualpath"] = x["storage_read_bytes"] / base["storage_read_bytes"]
        for key, label in (
            ("ttft_followup_p50_s", "follow-up TTFT p50"),
            ("ttft_ratio_vs_dualpath", "TTFT ratio"),
            ("prefetched_fraction", "prefetched"),
            ("storage_reads_vs_dualpath", "storage reads"),
            ("jct_s", "JCT"),
        ):
            row[f"{label} rt"] = both["runtime"][key]
            row[f"{label} sim"] = both["sim"][key]
        rows.append(row)
    rt_ratio = systems[HEADLINE]["runtime"]["ttft_ratio_vs_dualpath"]
    sim_ratio = systems[HEADLINE]["sim"]["ttft_ratio_vs_dualpath"]
    error = sim_ratio / rt_ratio - 1
    lo, hi = bootstrap_ratio(systems[HEADLINE]["runtime"]["followup_ttfts"], systems[BASE]["runtime"]["followup_ttfts"])
    headline = {
        "metric": f"follow-up TTFT p50, {HEADLINE} / {BASE}",
        "runtime": rt_ratio,
        "runtime_resampled_90": [lo, hi],
        "sim": sim_ratio,
        "relative_error": error,
        "within_goal": abs(error) <= GOAL,
        "goal": GOAL,
    }
    hw, model, engine, buffer = cpu_profile(cfg, m)
    profile = {
        "measured": m,
        "storage_cap_bps": cap,
        "link_bps": LINK_BPS,
        "kv_bytes_per_token": model.kv_bytes_per_token,
        "decode_kv_tokens": engine.decode_kv_tokens,
        "buffer_bytes": buffer,
        "pull_interval_s": PULL_S,
        "de_read_overlap": False,
    }
    for both in systems.values():
        both["runtime"].pop("prompt_tokens")
    path = write_result(
        "sim_sessions_runtime",
        {
            "run": str(run_dir),
            "run_config": cfg,
            "profile": profile,
            "headline": headline,
            "table": rows,
            "systems": systems,
        },
        args.out,
    )
    print_table(rows, list(rows[0]))
    print("\nfollow-up TTFT p50 (s) by read path, [turns, p50]; '/prefetched': placed where its prefetch was")
    for system, both in systems.items():
        print(f"  {system:<18} runtime {both['runtime']['by_path']}")
        print(f"  {'':<18} sim     {both['sim']['by_path']}")
    print(
        f"\nheadline: {headline['metric']}: runtime {rt_ratio:.3f} (resampling its rounds: {lo:.2f}-{hi:.2f}), sim "
        f"{sim_ratio:.3f}, relative error {100 * error:+.1f}% "
        f"({'within' if headline['within_goal'] else 'outside'} the {100 * GOAL:.0f}% goal)"
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
