"""How long a one-host cluster (a scheduler, one prefill and one decode engine) takes to start and to stop, against
the floor no engine's start can beat, measured in the same run: a bare process that imports the engine modules and
loads the checkpoint, which every engine process does before anything of its own.

Two starts: ``serve``, the default model (SmolLM2-135M-Instruct) as ``dualpath serve`` starts it (its options, the
prefill engine's start-up profile, the storage read probe), and ``tests``, the tiny random Llama as the cluster tests
start it (a given cost model). Reported per start: the floor, ready (from the start until every part serves),
ready / floor, and stop (SIGTERM until every process exited). Each is the best of ``--repeats``.

    python bench/startup.py [--repeats 3] [--starts serve,tests]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_result  # noqa: E402

FLOOR = (
    "import sys, torch, dualpath.engines.prefill, dualpath.engines.decode; from dualpath.engines.models import load_model, open_checkpoint; "
    "torch.set_num_threads(1); load_model(open_checkpoint(sys.argv[1]), torch.device('cpu'), torch.float32, "
    "'torch')"
)


def floor_s(model: str) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", FLOOR, model], check=True, timeout=300)
    return time.perf_counter() - t


def serve_cluster(tmp: Path, shared: Path):
    """The cluster ``dualpath serve`` starts with its default options, started."""
    from dualpath.cli import build_parser
    from dualpath.serving.serve import cluster_from_args

    args = build_parser().parse_args(["serve", "--kv-store", str(tmp / "kv"), "--run-dir", str(tmp / "run")])
    cluster, model_dir, _ = cluster_from_args(args)
    return cluster, model_dir


def tests_cluster(tmp: Path, shared: Path):
    """A 1P1D cluster of the tiny random Llama (built once, in ``shared``), as ``tests/cluster/test_cluster.py`` starts one,
    started."""
    from dualpath.checkpoints.tiny import build_tiny_checkpoint
    from dualpath.launcher import ClusterSpec, LocalCluster

    model = shared / "llama"
    if not model.exists():
        build_tiny_checkpoint(model, "llama", seed=1)
    spec = ClusterSpec(
        model=str(model),
        block_size=16,
        kv_store=str(tmp / "kv"),
        buffer_bytes=8 << 20,
        cache_bytes=16 << 20,
        workspace_tokens=2048,
        cost_model="0.001,0.0001,0",
    )
    return LocalCluster(spec, run_dir=str(tmp / "run")).start(), str(model)


def measure(start, repeats: int) -> dict:
    readies, stops = [], []
    with tempfile.TemporaryDirectory() as d:
        for i in range(repeats):
            run = Path(d) / str(i)
            (run / "kv").mkdir(parents=True)
            t = time.perf_counter()
            cluster, model = start(run, Path(d))
            readies.append(time.perf_counter() - t)
            t = time.perf_counter()
            cluster.stop()
            stops.append(time.perf_counter() - t)
        floor = min(floor_s(model) for _ in range(repeats))
    return {"floor_s": floor, "ready_s": min(readies), "ready_over_floor": min(readies) / floor, "stop_s": min(stops)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--starts", default="serve,tests")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    starts = {"serve": serve_cluster, "tests": tests_cluster}
    rows = []
    for name in args.starts.split(","):
        rows.append({"start": name, **measure(starts[name], args.repeats)})
        print(f"{name}: ready in {rows[-1]['ready_s']:.2f} s", flush=True)
    print_table(rows, ["start", "floor_s", "ready_s", "ready_over_floor", "stop_s"])
    print("wrote", write_result("startup", {"repeats": args.repeats, "rows": rows}, args.out))


if __name__ == "__main__":
    main()
