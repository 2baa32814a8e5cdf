"""Where this host's ``dualpath serve`` runs can be found: each one, while it serves, keeps a record in
``<cache dir>/runs/<pid>.json`` (``dualpath.core.paths.cache_dir``: ``$DUALPATH_CACHE_DIR``, else
``~/.cache/dualpath``) naming its scheduler, run directory, cluster-token file and API. ``dualpath status`` with no
``--scheduler`` reads them (``local_runs``); ``--run-dir DIR`` reads a run directory itself (``from_run_dir``).

Why records and not a default port: ``serve`` gives its scheduler any free port (``--scheduler-port 0``), so two
servers on one host never collide, and a status caller needs the cluster token as well as the address: the record
names both. A record whose process is gone (killed with SIGKILL) is stale and removed when read.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dualpath.core.errors import ConfigError
from dualpath.core.paths import cache_dir


@dataclass(frozen=True)
class LocalRun:
    scheduler: str  # host:port of its scheduler's gRPC
    run_dir: str  # its processes' logs and ready files
    token_file: str = ""  # the cluster token, readable by this user alone ("" where the run wrote none)
    api: str = ""  # the OpenAI-compatible base URL
    model: str = ""
    pid: int = 0  # the serve process (0: unknown, read from a run directory)
    started: float = 0.0  # time.time() when it began serving


def runs_dir() -> Path:
    return cache_dir() / "runs"


def announce(run: LocalRun) -> Path:
    """Record ``run`` (atomically: a reader never sees half a record); returns the record's path, which the run
    removes (``withdraw``) when it stops."""
    path = runs_dir() / f"{run.pid}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(run)))
    os.replace(tmp, path)
    return path


def withdraw(path: Path | None) -> None:
    if path is not None:
        path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def local_runs() -> list[LocalRun]:
    """The runs serving on this host now, the most recently started first (stale records removed)."""
    out = []
    for f in runs_dir().glob("*.json"):
        try:
            run = LocalRun(**json.loads(f.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # (being written, or not ours)
        if run.pid and not _alive(run.pid):
            f.unlink(missing_ok=True)
            continue
        out.append(run)
    return sorted(out, key=lambda r: r.started, reverse=True)


def from_run_dir(run_dir: str | Path, host: str = "127.0.0.1") -> LocalRun:
    """The run whose processes write to ``run_dir`` (``serve --run-dir``): its scheduler's ready file holds its
    ports (``PORT HTTP_PORT``), beside the cluster-token file."""
    d = Path(run_dir)
    try:
        port = (d / "scheduler.ready").read_text().split()[0]
    except (OSError, IndexError):
        raise ConfigError(f"{d}: no scheduler.ready (not a running `dualpath serve`'s run directory)") from None
    token = d / "cluster-token"
    return LocalRun(f"{host}:{port}", str(d), str(token) if token.is_file() else "")


def this_run(scheduler: str, run_dir: Path, token_file: Path, api: str, model: str) -> LocalRun:
    """This process's run (``serve``), for ``announce``."""
    return LocalRun(
        scheduler, str(run_dir), str(token_file) if token_file.is_file() else "", api, model, os.getpid(), time.time()
    )
