"""Failpoints: named places on a request's path where the chaos suite (``bench/chaos.py``) makes a process fail,
exactly once per run, so recovery is tested at each phase of a request instead of wherever a timed kill lands.

Off unless ``DUALPATH_FAILPOINTS`` names points (never set it in production): ``point=action[,point=action]``.
Actions: ``exit`` ends the process at once, as SIGKILL would (no cleanup, no last report); ``hang`` stops the whole
process (SIGSTOP: a wedged host, which only health checks notice); ``stall`` makes only the calling thread sleep
``DUALPATH_FAILPOINT_STALL_S`` (default 3600) seconds (a storage read that never returns). Each point fires once
across every process of the run and their restarts: the first to reach it creates its marker file in
``DUALPATH_FAILPOINT_DIR`` (required when points are set), and whoever finds the marker goes on.

The points (grep ``failpoint(`` for where each sits):
  prefill.queued      a prefill engine took an assignment, before it prepares it
  prefill.loading     a prefill engine started reading a request's hit blocks from storage
  prefill.prefilling  a prefill batch is half way through its layers
  prefill.handoff     a prompt is prefilled, before the decode engine is told
  decode.loading      a decode engine started reading a request's hit blocks (DE read path)
  decode.handoff      a decode engine was told a prompt is prefilled, before it takes it
  decode.decoding     a decode engine's tenth step with replies generating
  scheduler.assign    the scheduler handed work to a prefill engine, before the reply leaves
  storage.read        a storage read of a block, before it reads
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time

log = logging.getLogger(__name__)
ENV, DIR_ENV, STALL_ENV = "DUALPATH_FAILPOINTS", "DUALPATH_FAILPOINT_DIR", "DUALPATH_FAILPOINT_STALL_S"
ACTIONS = ("exit", "hang", "stall")


@functools.lru_cache(maxsize=1)
def _armed(spec: str) -> dict[str, str]:
    points = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, action = item.partition("=")
        if action not in ACTIONS:
            raise ValueError(f"{ENV}: {item!r} is not point=action with action one of {', '.join(ACTIONS)}")
        points[name] = action
    return points


def failpoint(name: str) -> None:
    """Fire ``name`` if it is armed and no process of this run fired it yet."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    action = _armed(spec).get(name)
    if action is None or not _claim(name):
        return
    log.error("failpoint %s fires: %s", name, action)
    if action == "exit":
        os._exit(137)
    elif action == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        time.sleep(float(os.environ.get(STALL_ENV, "3600")))


def _claim(name: str) -> bool:
    try:
        os.close(os.open(os.path.join(os.environ[DIR_ENV], name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def fired(directory: str) -> list[str]:
    """The points that fired in a run whose markers are in ``directory``."""
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []
