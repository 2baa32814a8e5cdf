"""Shared helpers for benchmark scripts: timing, CPU use, JSON results, tables."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Callable

RESULTS = Path(__file__).parent / "results"


def best_of(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    """Fastest wall time of ``fn`` over ``repeats`` runs after ``warmup`` runs (seconds): on a shared, noisy
    machine the minimum is the best estimate of the code's own cost."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used, from ``/proc`` (another process's, unlike
    ``time.process_time``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rel_err(out, ref) -> float:
    """Largest absolute error of ``out`` against ``ref`` (a float64 reference), over ``ref``'s largest magnitude."""
    return float((out.double() - ref).abs().max() / ref.abs().max())


def machine() -> dict:
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def write_result(name: str, result: dict, out: str | None = None) -> Path:
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), **result}, indent=1))
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)
