"""Failpoints fire once per run, and the chaos suite's short form (``bench/chaos.py --quick``: a prefill engine dying
mid-prefill, a decode engine dying mid-reply, the scheduler killed, clients hanging up mid-chunk, corrupted blocks)
meets its targets: no wrong or hung reply, nothing lost, crashed parts back."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dualpath.core import faults

ROOT = Path(__file__).resolve().parents[2]


def test_a_failpoint_fires_once_across_processes(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV, "storage.read=stall,decode.handoff=exit")
    monkeypatch.setenv(faults.DIR_ENV, str(tmp_path))
    monkeypatch.setenv(faults.STALL_ENV, "0")
    faults.failpoint("prefill.queued")  # not armed: nothing happens
    assert faults.fired(str(tmp_path)) == []
    faults.failpoint("storage.read")  # stalls 0 s, once
    assert faults.fired(str(tmp_path)) == ["storage.read"]
    code = "from dualpath.core.faults import failpoint; failpoint('decode.handoff'); print('alive')"
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True) for _ in range(2)]
    assert [r.returncode for r in runs] == [137, 0] and runs[1].stdout.strip() == "alive"
    assert faults.fired(str(tmp_path)) == ["decode.handoff", "storage.read"]


def test_an_unknown_action_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv(faults.ENV, "storage.read=explode")
    monkeypatch.setenv(faults.DIR_ENV, str(tmp_path))
    with pytest.raises(ValueError, match="action one of exit, hang, stall"):
        faults.failpoint("storage.read")


def test_failpoints_are_off_without_the_variable(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    monkeypatch.delenv(faults.DIR_ENV, raising=False)
    faults.failpoint("decode.handoff")  # would need the marker directory if it were armed


@pytest.mark.slow  # ~90 s: five clusters
def test_the_quick_chaos_suite_meets_its_targets(tmp_path):
    out = tmp_path / "chaos.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "chaos.py"),
            "--quick",
            "--agents",
            "3",
            "--heartbeat-timeout",
            "5",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert len(rows) == 5 and all(r["ok"] for r in rows), rows
    assert sum(r["wrong"] + r["hung"] for r in rows) == 0
    assert next(r for r in rows if "hang up" in r["scenario"])["restarts"] == {}  # the crash of issue 46
