"""Entry points of the engine and scheduler processes (``dualpath engine`` / ``dualpath scheduler``)."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

from dualpath.core.config import EngineProcessConfig, QosConfig, SchedulerConfig

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """When started by a launcher (``DUALPATH_PARENT_PID``), end when it ends, even if it was killed."""
    parent = os.environ.get("DUALPATH_PARENT_PID")
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        return
    if os.getppid() != int(parent):  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_large_buffers(limit: int = 64 << 20) -> None:
    """Serve message-sized allocations (a 30K-token prompt is 120 KB) from the heap instead of fresh mmaps.

    glibc maps each allocation above its threshold (128 KB to start) anew and the kernel zero-fills every page
    of it on first touch: the scheduler relays ~300 MB/s of prompts at the paper's rate, and those faults cost
    more than the copies. Fixed thresholds keep freed buffers in the heap for reuse.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, limit)
        libc.mallopt(_M_TRIM_THRESHOLD, 4 * limit)
    except (OSError, AttributeError):  # not glibc
        return


def write_ready(path: str | None, text: str) -> None:
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)


def unlink_shared_memory_on_term() -> None:
    """SIGTERM (a supervisor stopping us, or the parent-death signal when it died) ends the process at once, as
    the default action would, but first unlinks the shared-memory segments it created: else, with the supervisor
    itself killed, nobody could, and each keeps its bytes in RAM until reboot. Covers start-up: once running, the
    engine's loop takes SIGTERM over for a graceful stop, whose ``Engine.stop`` closes the buffer itself."""
    from dualpath.traffic.memory import remove_segments

    def handler(signum, frame):
        remove_segments(os.getpid())
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def set_collective_classes(qos: QosConfig) -> dict[str, str]:
    """Put the collectives' priority classes (``NCCL_IB_SL``, ``NCCL_IB_TC``) into this process's environment
    before anything starts NCCL or the engine's other ranks: they are processes started from this one, and inherit
    it. The config wins over a different value already set (said in the log). Returns what was set."""
    env = qos.collective_env()
    for k, v in env.items():
        if os.environ.get(k, v) != v:
            log.warning("%s=%s in the environment; the engine's QoS config sets %s", k, os.environ[k], v)
        os.environ[k] = v
    return env


def run_engine(cfg: EngineProcessConfig, ready_file: str | None = None) -> None:
    unlink_shared_memory_on_term()
    die_with_parent()
    set_collective_classes(cfg.qos)
    if cfg.role == "prefill":
        from dualpath.engines.prefill import PrefillEngine as cls
    else:
        from dualpath.engines.decode import DecodeEngine as cls
    log.info("%s engine %s: loading %s on %s", cfg.role, cfg.engine_id, cfg.model, cfg.engine.device)
    engine = cls(cfg)
    log.info("%s engine %s: registering with the scheduler at %s", cfg.role, engine.engine_id, cfg.scheduler)
    try:
        engine.register()
    except Exception:
        engine.stop()
        raise
    # "ID ADDRESS KV_TOKENS": the launcher learns the control address, and reports the KV capacity
    write_ready(ready_file, f"{engine.engine_id} {cfg.host}:{engine.port} {engine.capacity_tokens()}\n")
    engine.run()
    logging.shutdown()
    os._exit(engine.exit_code)  # NIXL (if loaded) crashes in exit-time destructors


def run_scheduler(cfg: SchedulerConfig, ready_file: str | None = None) -> None:
    import asyncio

    from dualpath.scheduler.service import run_scheduler_async

    die_with_parent()
    keep_large_buffers()

    async def main():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run_scheduler_async(cfg, lambda port, http: write_ready(ready_file, f"{port} {http}\n"), stop)

    asyncio.run(main())
