"""The GPU bench's idle-time split (bench/gpu/timeline.py) on hand-made traces: what the H200 run reports about
where a call leaves the GPU idle must add up."""

import importlib.util
from pathlib import Path

import pytest

# by file, not through sys.path: bench/gpu/kernels.py would shadow the kernels package for every later test
_spec = importlib.util.spec_from_file_location(
    "bench_gpu_timeline", Path(__file__).resolve().parents[2] / "bench" / "gpu" / "timeline.py"
)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
timeline = _module.timeline


def test_lead_gaps_and_tail_add_up_to_wall_minus_busy():
    kernels = [(110, 150, "a"), (150, 200, "b"), (260, 300, "c"), (305, 400, "d"), (900, 950, "e")]
    t = timeline((100, 1000), kernels, min_gap=20)
    assert t["lead_seconds"] == pytest.approx(10e-6)
    assert t["tail_seconds"] == pytest.approx(50e-6)
    assert t["gaps"] == 2  # 60 us after b and 500 us after d; the 5 us after c is under min_gap
    assert t["gap_seconds"] == pytest.approx(560e-6)
    assert [(g["after"], g["before"]) for g in t["largest_gaps"]] == [("d", "e"), ("b", "c")]


def test_overlapping_activities_are_one_busy_stretch():
    # a copy running beside a longer kernel: the idle time starts when the kernel ends, and is named after it
    t = timeline((0, 1000), [(0, 500, "kernel"), (100, 200, "copy"), (700, 800, "next")], min_gap=20)
    assert t["gaps"] == 1 and t["gap_seconds"] == pytest.approx(200e-6)
    assert t["largest_gaps"][0]["after"] == "kernel"


def test_activities_outside_the_call_are_ignored_and_an_idle_call_is_all_lead():
    assert timeline((100, 200), [(0, 50, "before"), (300, 400, "after")])["lead_seconds"] == pytest.approx(100e-6)
    t = timeline((100, 200), [(0, 150, "spans the start")])
    assert t["lead_seconds"] == 0 and t["tail_seconds"] == pytest.approx(50e-6)
