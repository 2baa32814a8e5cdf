"""``dualpath bench agentic``: the paper's comparison (§6–7) run on this runtime.

The same trace runs on the same xPyD cluster as each system of the paper's ablation:

- ``basic``: PE read path only, no layerwise prefill (round-robin placement);
- ``layerwise``: PE read path, layerwise prefill (round-robin placement);
- ``dualpath-rr``: both read paths, paths and engines in round-robin;
- ``dualpath``: both read paths and the paper's scheduler;
- ``dualpath-split`` (beyond the paper): the paper's scheduler, each request's read divided between both sides so
  their queues drain together — a lone request (the tail of a job) reads at two nodes' bandwidth;
- ``oracle``: the full system with no storage cap and the KV store in memory (``/dev/shm``): the I/O-free bound;
- ``dualpath+affinity`` (beyond the paper): ``dualpath`` with agent sessions, each turn kept on its session's last
  decode engine where the balance rules allow;
- ``dualpath+prefetch`` (beyond the paper): that, and each session's KV read into the buffer of the engine that will
  serve its next turn while its tool runs (``dualpath.traffic.prefetch``).

The paper's systems run without sessions (as its traces have no tool time). ``--tool-gap-median-s`` gives every
round but an agent's last a tool call (``dualpath trace``'s gaps), during which the agent sends nothing.

Every node's storage reads are capped to the same bandwidth so the run is storage-bound, as the paper's are.
``--storage-cap auto`` measures the oracle's storage read rate R and caps each node at ``cap_factor × R``: one
node's reads then cannot keep up (Basic is storage-bound) while all of them together can. Writes a JSON result,
a table, and figures: job completion time per system, and storage-read throughput per node over time.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SYSTEMS = {  # name: (mode, policy, capped, kv store in memory, sessions: affinity, prefetch)
    "basic": ("basic", "round-robin", True, False, False, False),
    "layerwise": ("pe", "round-robin", True, False, False, False),
    "dualpath-rr": ("dualpath", "round-robin", True, False, False, False),
    "dualpath": ("dualpath", "dualpath", True, False, False, False),
    "dualpath-split": ("split", "dualpath", True, False, False, False),
    "oracle": ("dualpath", "dualpath", False, True, False, False),
    "dualpath+affinity": ("dualpath", "dualpath", True, False, True, False),
    "dualpath+prefetch": ("dualpath", "dualpath", True, False, True, True),
}
WORKSPACE_TOKENS = 16384  # each prefill engine's, per layer slot
PAPER_SYSTEMS = ("basic", "layerwise", "dualpath-rr", "dualpath", "dualpath-split", "oracle")


@dataclass(frozen=True)
class AgenticConfig:
    model: str
    preset: str = "64k"
    agents: int = 64
    scale: float = 0.05
    turns_scale: float = 0.1
    prefill: int = 1
    decode: int = 2
    device: str = "cpu"  # ClusterSpec.device: "cuda:0" puts every engine on that one GPU
    dtype: str = "float32"
    cache_bytes: int = 512 << 20  # each decode engine's paged KV cache
    block_size: int = 64
    storage_cap: str = "auto"
    cap_factor: float = 0.45
    systems: tuple[str, ...] = PAPER_SYSTEMS
    seed: int = 0
    torch_threads: int = 1
    tool_gap_median_s: float = 0.0  # tool calls between rounds (dualpath.rollout.tracegen.draw_tool_gaps); 0: none
    tool_gap_p90_s: float = 0.0
    buffer_bytes: int = 256 << 20
    prefill_kv_budget_bytes: int = 0  # EngineProcessConfig's: basic batches hold all layers' KV in it, layerwise two
    compute_quota_ms: float = 300.0  # the prefill batch's predicted time (the paper's 300 ms is a GPU's)


def run_system(name: str, cfg: AgenticConfig, trajectories, cap_bps: float, out_dir: Path) -> dict:
    from dualpath.client import ClusterClient
    from dualpath.launcher import ClusterSpec, LocalCluster
    from dualpath.rollout.runner import Rollout, RolloutConfig

    mode, policy, capped, in_memory, affinity, prefetch = SYSTEMS[name]
    kv = tempfile.mkdtemp(prefix=f"dualpath-agentic-{name}-", dir="/dev/shm" if in_memory else None)
    spec = ClusterSpec(
        model=cfg.model,
        num_prefill=cfg.prefill,
        num_decode=cfg.decode,
        mode=mode,
        policy=policy,
        kv_store=kv,
        device=cfg.device,
        dtype=cfg.dtype,
        block_size=cfg.block_size,
        buffer_bytes=cfg.buffer_bytes,
        cache_bytes=cfg.cache_bytes,
        workspace_tokens=WORKSPACE_TOKENS,
        prefill_kv_budget_bytes=cfg.prefill_kv_budget_bytes,
        compute_quota_ms=cfg.compute_quota_ms,
        storage_read_bps=cap_bps if capped else 0.0,
        torch_threads=cfg.torch_threads,
        load_every_hit=True,
        session_affinity=affinity,
        session_prefetch=prefetch,
    )  # as the paper's systems do
    try:
        with LocalCluster(spec, run_dir=str(out_dir / f"run-{name}")) as cluster:
            client = ClusterClient(cluster.scheduler_address)
            rounds = out_dir / f"rounds-{name}.jsonl"
            rounds.unlink(missing_ok=True)  # a benchmark measures whole runs: never resume an earlier one
            rollout = Rollout(client, RolloutConfig(sample_interval_s=0.25, sessions=affinity or prefetch))
            summary = rollout.run(trajectories, rounds, progress=False)
            client.close()
    finally:
        shutil.rmtree(kv, ignore_errors=True)
    summary["system"], summary["storage_read_bps_cap"] = name, cap_bps if capped else 0.0
    return summary


def figures(rows: list[dict], out_dir: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install -e '.[bench]'): no figures")
        return []
    paths = []
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [r["system"] for r in rows]
    ax.bar(names, [r["job_completion_time_s"] for r in rows], color="#4472c4")
    ax.set_ylabel("job completion time (s)")
    ax.set_title("Agentic rollout, same trace and cluster")
    fig.tight_layout()
    paths.append(str(out_dir / "agentic_jct.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3), sharey=True)
    for ax, r in zip(axes if len(rows) > 1 else [axes], rows):
        tl = r["timeline"]
        nodes = sorted({n for s in tl for n in s["storage_read_bytes"]})
        for n in nodes:
            pts = [(s["t"], s["storage_read_bytes"].get(n, 0)) for s in tl]
            rates = [((b1 - b0) / max(1e-9, t1 - t0)) / 1e6 for (t0, b0), (t1, b1) in zip(pts, pts[1:])]
            ax.plot([t for t, _ in pts[1:]], rates, label=n, linewidth=1)
        if r.get("storage_read_bps_cap"):
            ax.axhline(r["storage_read_bps_cap"] / 1e6, color="gray", linestyle="--", linewidth=0.8, label="cap")
        ax.set_title(r["system"])
        ax.set_xlabel("time (s)")
    (axes[0] if len(rows) > 1 else axes).set_ylabel("storage reads (MB/s)")
    (axes[-1] if len(rows) > 1 else axes).legend(fontsize=7)
    fig.tight_layout()
    paths.append(str(out_dir / "agentic_storage.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def _vs_plain(r: dict, plain: dict) -> dict:
    """A sessions system against ``dualpath`` without sessions, on the same trace: follow-up turns' TTFT and the
    storage bytes read."""
    out = {}
    for k in ("ttft_followup_p50_s", "ttft_followup_p99_s"):
        if plain.get(k):
            out[f"{k}_vs_dualpath"] = r[k] / plain[k]
    if plain.get("storage_read_bytes"):
        out["storage_reads_vs_dualpath"] = r["storage_read_bytes"] / plain["storage_read_bytes"]
    return out


def session_figure(rows: list[dict], out_dir: Path) -> list[str]:
    """Follow-up turns' TTFT per system, and the working set over time: KV stored, and prefetched in DRAM."""
    if not any(r["system"] in ("dualpath", "dualpath+affinity", "dualpath+prefetch") for r in rows):
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6))
    names = [r["system"] for r in rows]
    x = range(len(rows))
    a.bar([i - 0.2 for i in x], [r.get("ttft_followup_p50_s", 0) for r in rows], 0.4, label="p50")
    a.bar([i + 0.2 for i in x], [r.get("ttft_followup_p99_s", 0) for r in rows], 0.4, label="p99")
    a.set_xticks(list(x), names, rotation=20, fontsize=8)
    a.set_ylabel("TTFT of follow-up turns (s)")
    a.legend(fontsize=8)
    for r in rows:
        tl = r["timeline"]
        t = [s["t"] for s in tl]
        b.plot(t, [s.get("storage_used_bytes", 0) / 1e6 for s in tl], label=f"{r['system']}: stored", linewidth=1)
        if any(s.get("prefetch_held_bytes") for s in tl):
            b.plot(t, [s["prefetch_held_bytes"] / 1e6 for s in tl], "--", label=f"{r['system']}: DRAM", linewidth=1)
    b.set_xlabel("time (s)")
    b.set_ylabel("working set (MB)")
    b.legend(fontsize=7)
    fig.tight_layout()
    path = str(out_dir / "agentic_sessions.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def prefill_batch_tokens(cfg: AgenticConfig, model) -> dict:
    """The most prompt tokens (cached + new) a prefill batch holds, basic and layerwise (the engines' rule:
    ``dualpath.engines.prefill.workspace_blocks``)."""
    from dualpath.core.geometry import KVGeometry
    from dualpath.engines.prefill import workspace_blocks

    g = KVGeometry.for_model(model, cfg.dtype, cfg.block_size)
    return {
        f"{mode}_batch_tokens": g.block_size
        * workspace_blocks(g, WORKSPACE_TOKENS, cfg.prefill_kv_budget_bytes, layerwise=mode == "layerwise")
        for mode in ("basic", "layerwise")
    }


def run(cfg: AgenticConfig, out_dir: str | Path) -> dict:
    from dualpath.rollout.tracegen import generate_trace, measure
    from dualpath.engines.models import open_checkpoint

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = open_checkpoint(cfg.model).config.vocab_size
    trajectories, target = generate_trace(
        cfg.preset,
        cfg.agents,
        cfg.scale,
        cfg.turns_scale,
        (3, min(vocab, 32000) - 1),
        cfg.seed,
        cfg.tool_gap_median_s,
        cfg.tool_gap_p90_s,
    )
    stats = measure(trajectories)
    batch_tokens = prefill_batch_tokens(cfg, open_checkpoint(cfg.model).config)
    order = ["oracle"] + [s for s in cfg.systems if s != "oracle"] if "oracle" in cfg.systems else list(cfg.systems)
    rows, cap = {}, 0.0
    for name in order:
        if name != "oracle" and not cap:
            if cfg.storage_cap == "auto":
                o = rows.get("oracle") or run_system("oracle", cfg, trajectories, 0.0, out_dir)
                rows["oracle"] = o
                rate = sum(o["storage_read_bytes_per_node"].values()) / o["job_completion_time_s"]
                cap = cfg.cap_factor * rate
            else:
                cap = float(cfg.storage_cap)
        if name not in rows:
            log.info("running %s", name)
            rows[name] = run_system(name, cfg, trajectories, cap, out_dir)
    ordered = [rows[s] for s in cfg.systems if s in rows]
    base = rows.get("basic")
    oracle = rows.get("oracle")
    plain = rows.get("dualpath")  # sessions' systems are measured against it
    for r in ordered:
        if base:
            r["jct_vs_basic"] = r["job_completion_time_s"] / base["job_completion_time_s"]
        if oracle:
            r["jct_vs_oracle"] = r["job_completion_time_s"] / oracle["job_completion_time_s"]
        if plain and r["system"].startswith("dualpath+"):
            r.update(_vs_plain(r, plain))
    result = {
        "config": {**cfg.__dict__, "systems": list(cfg.systems)},
        "cap_bps": cap,
        **batch_tokens,
        "trace": {"target": target.__dict__, "generated": stats.__dict__, "agents": len(trajectories)},
        "systems": ordered,
    }
    result["figures"] = figures(ordered, out_dir) + session_figure(ordered, out_dir)
    slim = {**result, "systems": [{k: v for k, v in r.items() if k != "timeline"} for r in ordered]}
    (out_dir / "agentic.json").write_text(json.dumps(slim, indent=1))
    (out_dir / "agentic_timelines.json").write_text(json.dumps({r["system"]: r["timeline"] for r in ordered}))
    return result


def print_table(result: dict) -> None:
    cols = [
        "system",
        "job_completion_time_s",
        "jct_vs_basic",
        "jct_vs_oracle",
        "hit_rate",
        "ttft_p50_s",
        "ttft_p99_s",
        "tpot_p50_s",
        "storage_read_max_over_avg",
        "generated_tokens_per_s",
        "ttft_followup_p50_s",
        "ttft_followup_p50_s_vs_dualpath",
        "storage_reads_vs_dualpath",
    ]
    print("  ".join(f"{c:>22}" for c in cols))
    for r in result["systems"]:
        print(
            "  ".join(
                f"{r.get(c, ''):>22.3f}" if isinstance(r.get(c), float) else f"{str(r.get(c, '')):>22}" for c in cols
            )
        )
    print(f"storage cap per node: {result['cap_bps'] / 1e6:.1f} MB/s")


def bench_main(args) -> int:
    model = args.model
    if args.tiny:
        from dualpath.checkpoints.tiny import build_tiny_checkpoint

        model = str(
            build_tiny_checkpoint(
                Path(args.out) / "model",
                "llama",
                seed=0,
                hidden_size=256,
                num_attention_heads=8,
                num_key_value_heads=8,
                intermediate_size=512,
                num_hidden_layers=4,
            )
        )
    if not model:
        from dualpath.checkpoints.smollm2 import default_model_dir

        model = str(default_model_dir())
    cfg = AgenticConfig(
        model=model,
        preset=args.preset,
        agents=args.agents,
        scale=args.scale,
        turns_scale=args.turns_scale,
        prefill=args.prefill,
        decode=args.decode,
        device=args.device,
        dtype=args.dtype,
        cache_bytes=args.cache_bytes,
        block_size=args.block_size,
        storage_cap=args.storage_cap,
        cap_factor=args.cap_factor,
        systems=tuple(args.systems.split(",")),
        seed=args.seed,
        tool_gap_median_s=args.tool_gap_median_s,
        tool_gap_p90_s=args.tool_gap_p90_s or 0.0,
        buffer_bytes=args.buffer_mb << 20,
        prefill_kv_budget_bytes=args.prefill_kv_budget,
        compute_quota_ms=args.compute_quota_ms,
        torch_threads=args.torch_threads or max(1, (os.cpu_count() or 2) // (args.prefill + args.decode)),
    )
    result = run(cfg, args.out)
    print_table(result)
    print(f"wrote {args.out}/agentic.json and figures {result['figures']}")
    return 0
