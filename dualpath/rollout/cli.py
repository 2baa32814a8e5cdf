"""``dualpath rollout`` and ``dualpath trace``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


def rollout_main(args) -> int:
    from dualpath.client import ClusterClient
    from dualpath.rollout.runner import Rollout, RolloutConfig
    from dualpath.rollout.trajectory import read_trajectories
    from dualpath.core.tokenizer import Tokenizer

    trajectories = list(read_trajectories(args.trajectories, skip_invalid=args.skip_invalid))
    if not trajectories:
        print("no trajectories to run")
        return 1
    cfg = RolloutConfig(
        think_time_s=args.think_time,
        temperature=args.temperature,
        seed=args.seed,
        agents=args.agents,
        max_concurrency=args.max_concurrency,
        group_size=args.group_size,
        longest_first=args.longest_first,
        adapter=rollout_adapter(args),
        sessions=not args.no_sessions,
        tool_hints=args.tool_hints,
    )
    if args.longest_first and not args.scheduler:
        args.scheduling_policy = "priority"  # the cluster this job starts orders its queues by the priorities,
        args.disable_priority_preemption = True  # as measured: without preempting (each one reloads a context)
    cluster = None
    try:
        if args.scheduler:
            scheduler, model_dir, max_len = args.scheduler, args.model, args.max_model_len
        else:
            from dualpath.serving.serve import cluster_from_args

            cluster, model_dir, max_len = cluster_from_args(args)
            scheduler = cluster.scheduler_address
        tokenizer = Tokenizer(model_dir) if model_dir else None
        cfg = dataclasses.replace(cfg, max_model_len=max_len or 0)
        client = ClusterClient(scheduler)
        ensure_adapter(client, args, cfg.adapter)
        summary = Rollout(client, cfg, tokenizer).run(trajectories, args.out, progress=not args.no_progress)
        client.close()
    finally:
        if cluster is not None:
            cluster.stop()
    path = Path(args.summary or f"{args.out}.summary.json")
    path.write_text(json.dumps(summary, indent=1))
    keys = (
        "agents",
        "rounds",
        "job_completion_time_s",
        "generated_tokens_per_s",
        "hit_rate",
        "ttft_p50_s",
        "tpot_p50_s",
        "storage_read_max_over_avg",
    )
    print("  ".join(f"{k}={summary[k]:.3g}" if isinstance(summary[k], float) else f"{k}={summary[k]}" for k in keys))
    print(f"results: {args.out}; summary: {path}")
    return 1 if summary.get("agents_failed") else 0


def rollout_adapter(args) -> str:
    """``--lora``'s identity: a ``--lora-modules`` name's, else a PEFT directory's ("" without one)."""
    from dualpath.core.lora import adapter_digest, read_adapter_config

    if not args.lora:
        return ""
    path = _named(args).get(args.lora, args.lora)
    read_adapter_config(path)  # a CheckpointError naming the file, before any engine starts
    return adapter_digest(path)


def _named(args) -> dict[str, str]:
    """``--lora-modules`` as name -> directory."""
    from dualpath.serving.serve import lora_modules

    return {m.name: m.path for m in lora_modules(args)}


def ensure_adapter(client, args, digest: str) -> None:
    """A ``--lora`` directory the cluster's engines did not start with is loaded on all of them first (an RL
    trainer's latest adapter: ``rollout --scheduler ... --lora /ckpt/step-17``); ``DualPathError`` if they could
    not, or read other bytes than this job did."""
    from dualpath.core.errors import DualPathError

    if not digest or args.lora in _named(args):
        return
    reply = client.load_adapter(args.lora)
    if not reply.ok or reply.digest != digest:
        raise DualPathError(
            f"the engines could not load the LoRA adapter {args.lora}: "
            f"{reply.error or 'they read other bytes than this job'}"
        )


def trace_main(args) -> int:
    from dualpath.rollout.tracegen import PRESETS, generate_trace, measure
    from dualpath.rollout.trajectory import write_trajectories

    lo, hi = (int(x) for x in args.vocab.split(","))
    trajectories, target = generate_trace(
        args.preset,
        args.agents,
        args.scale,
        args.turns_scale,
        (lo, hi),
        args.seed,
        args.tool_gap_median_s,
        args.tool_gap_p90_s or 0.0,
    )
    write_trajectories(args.out, trajectories)
    got = measure(trajectories)
    print(f"{len(trajectories)} trajectories -> {args.out}")
    print(f"{'':10}{'turns':>10}{'append':>10}{'gen':>10}{'context':>12}{'total':>12}{'longest':>12}")
    for name, st in (("target", target), ("generated", got), ("paper", PRESETS[args.preset])):
        print(
            f"{name:10}{st.turns:10.1f}{st.append:10.1f}{st.gen:10.1f}{st.context:12.0f}{st.total:12.0f}"
            f"{st.limit:12.0f}"
        )
    print("(per-turn averages, as the paper's Table 2; longest: the generated trace's, else MaxLen)")
    if got.tool_gaps:
        print(
            f"tool gaps: {got.tool_gaps} (after every round but the last), median {got.tool_median_s:.2f} s, "
            f"p90 {got.tool_p90_s:.2f} s, mean {got.tool_mean_s:.2f} s"
        )
    return 0
