"""GRPO-style groups in an offline rollout: every task sampled G times, its first round (the task's long prompt) as
one request with n = G (computed once, the samples forking off its blocks), each sample continuing on its own,
against the same G samples as G agents of their own (what a job had to do before: each computes the prompt), on
the same cluster in the same run (each way on tasks of its own, same lengths).

Reports the job completion time, the prompt tokens the prefill engines computed (submitted minus cache hits) and
the requests submitted; both ways run the same rounds with the same lengths (forced).

    python bench/rollout_groups.py [--group-size 4] [--tasks 2] [--prompt 1024] [--rounds 3] [--model DIR]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_result  # noqa: E402


def tasks(args, seed: int) -> list:
    """Each task: a long first round (the problem), then short tool outputs; lengths forced. Each way runs tasks of
    its own seed, so neither finds the other's prompts stored."""
    from dualpath.rollout.trajectory import Round, Trajectory

    rng = random.Random(seed)
    out = []
    for k in range(args.tasks):
        rounds = [Round(tuple(rng.randrange(3, 49000) for _ in range(args.prompt)), generate=args.generate)]
        rounds += [
            Round(tuple(rng.randrange(3, 49000) for _ in range(args.append)), generate=args.generate)
            for _ in range(args.rounds - 1)
        ]
        out.append(Trajectory(f"task-{k}", tuple(rounds)))
    return out


def run(client, trajectories, cfg, out: Path) -> dict:
    from dualpath.rollout.runner import Rollout

    before = client.stats()
    summary = Rollout(client, cfg).run(trajectories, out, progress=False)
    after = client.stats()
    delta = {k: after[k] - before[k] for k in ("submitted", "prompt_tokens", "hit_tokens")}
    return {
        "jct_s": summary["job_completion_time_s"],
        "requests": delta["submitted"],
        "computed_prompt_tokens": delta["prompt_tokens"] - delta["hit_tokens"],
        "rounds": summary["rounds"],
        "generated_tokens": summary["generated_tokens"],
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--tasks", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=1024, help="the first round's tokens (the task)")
    ap.add_argument("--append", type=int, default=64, help="each later round's appended tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--generate", type=int, default=8, help="tokens generated per round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from dualpath.checkpoints.smollm2 import default_model_dir
    from dualpath.client import ClusterClient
    from dualpath.launcher import ClusterSpec, LocalCluster
    from dualpath.rollout.runner import RolloutConfig
    from dualpath.rollout.trajectory import Trajectory

    model = args.model or str(default_model_dir())
    work = Path(tempfile.mkdtemp(prefix="dualpath-bench-groups-"))
    spec = ClusterSpec(model=model, kv_store=str(work / "kv"), workspace_tokens=8192)
    g = args.group_size
    group = tasks(args, args.seed)
    copies = [Trajectory(f"{t.id}~{s}", t.rounds) for t in tasks(args, args.seed + 1) for s in range(g)]
    rows = []
    with LocalCluster(spec, run_dir=str(work / "run")) as cluster:
        client = ClusterClient(cluster.scheduler_address)
        warm = RolloutConfig(temperature=1.0, seed=99, group_size=2)
        run(
            client,
            tasks(argparse.Namespace(**{**vars(args), "tasks": 1, "prompt": 64}), args.seed + 2),
            warm,
            work / "warm.jsonl",
        )
        for name, trajectories, size in (("separate agents", copies, 1), ("one group", group, g)):
            cfg = RolloutConfig(temperature=1.0, seed=args.seed, group_size=size)
            rows.append({"way": name, **run(client, trajectories, cfg, work / f"{len(rows)}.jsonl")})
        client.close()
    if rows[0]["rounds"] != rows[1]["rounds"] or rows[0]["generated_tokens"] != rows[1]["generated_tokens"]:
        raise SystemExit("the two ways ran different rounds")
    speedup = rows[0]["jct_s"] / rows[1]["jct_s"]
    print_table(rows, ["way", "jct_s", "requests", "computed_prompt_tokens", "rounds", "generated_tokens"])
    print(f"one group / separate agents: {speedup:.2f}x faster")
    result = {
        "group_size": g,
        "tasks": args.tasks,
        "prompt_tokens": args.prompt,
        "rounds_per_sample": args.rounds,
        "append_tokens": args.append,
        "generate_tokens": args.generate,
        "model": Path(model).name,
        "rows": rows,
        "speedup": speedup,
    }
    print("wrote", write_result("rollout_groups", result, args.out))
    return result


if __name__ == "__main__":
    main()
