"""Run ``dualpath serve`` as a user would, in a subprocess, for the serving tests and benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class ServeProcess:
    def __init__(self, *args: str, timeout: float = 300.0):
        self.dir = Path(tempfile.mkdtemp(prefix="dualpath-serve-"))
        ready = self.dir / "ready"
        self.log = self.dir / "serve.log"
        cmd = [
            sys.executable,
            "-m",
            "dualpath.cli",
            "--log-level",
            "WARNING",
            "serve",
            "--port",
            "0",
            "--ready-file",
            str(ready),
            "--run-dir",
            str(self.dir / "run"),
            *args,
        ]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"dualpath serve did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        self.port = int(ready.read_text())
        self.url = f"http://127.0.0.1:{self.port}"

    def children(self) -> list[int]:
        try:
            out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        except FileNotFoundError:
            return []
        return [int(x) for x in out.split()]

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text()[-n:] if self.log.exists() else ""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
