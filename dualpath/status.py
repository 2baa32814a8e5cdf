"""``dualpath status``: which scheduler to ask (``find_scheduler``) and its stats as a table for people
(``render``); ``--json`` prints the stats themselves for machines."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

from dualpath.core.errors import ConfigError
from dualpath.runs import LocalRun, from_run_dir, local_runs, runs_dir


@dataclass(frozen=True)
class Target:
    """The scheduler to ask, the run it belongs to where it was found on this host, and a note for the reader
    (other runs that were not chosen)."""

    run: LocalRun
    note: str = ""


STANDALONE = "127.0.0.1:50051"  # where a `dualpath scheduler` of this host listens by default (its --port)


def find_scheduler(scheduler: str | None, run_dir: str | None, wait_s: float = 0.0) -> Target:
    """``--scheduler`` as given; else the run of ``--run-dir``; else this host's ``dualpath serve`` (the newest of
    several), waiting up to ``wait_s`` for one to start; else a ``dualpath scheduler`` on its default port of this
    host. ConfigError where there is none."""
    if scheduler:
        return Target(LocalRun(scheduler, ""))
    if run_dir:
        return Target(from_run_dir(run_dir))
    deadline = time.monotonic() + wait_s
    while not (runs := local_runs()) and time.monotonic() < deadline and not _listening(STANDALONE):
        time.sleep(0.5)
    if not runs and _listening(STANDALONE):
        return Target(LocalRun(STANDALONE, ""), f"no `dualpath serve` here: the scheduler at {STANDALONE} shown")
    if not runs:
        raise ConfigError(
            f"no `dualpath serve` of this user runs on this host (none recorded in {runs_dir()}) and "
            f"no scheduler listens at {STANDALONE}; give --scheduler HOST:PORT or --run-dir DIR"
        )
    others = ", ".join(f"pid {r.pid} ({r.scheduler})" for r in runs[1:])
    note = (
        f"{len(runs)} `dualpath serve` runs here: the newest shown; --scheduler picks another: {others}"
        if others
        else ""
    )
    return Target(runs[0], note)


def _listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=0.5).close()
    except OSError:
        return False
    return True


def use_token_file(run: LocalRun) -> None:
    """Call with the run's cluster token unless this process was given one (``dualpath.core.rpc.PlaneAuth``)."""
    from dualpath.core.rpc import TOKEN_ENV, TOKEN_FILE_ENV

    if run.token_file and not os.environ.get(TOKEN_ENV) and not os.environ.get(TOKEN_FILE_ENV):
        os.environ[TOKEN_FILE_ENV] = run.token_file


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def _table(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    """Columns padded to their widest cell; numbers right-aligned."""
    cells = [tuple(str(c) for c in r) for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    numeric = [bool(rows) and all(isinstance(r[i], int) for r in rows) for i in range(len(header))]
    return [
        "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric)).rstrip() for r in cells
    ]


def _engine_row(eid: str, e: dict) -> tuple:
    cap, free = e.get("capacity_tokens", 0), e.get("free_tokens", 0)
    kv = f"{100 * (cap - free) / cap:.1f}% of {cap:,}" if cap else "-"
    store_cap = e.get("storage_capacity_bytes", 0)
    store = _bytes(e.get("storage_used_bytes", 0)) + (f" / {_bytes(store_cap)}" if store_cap else "")
    return (
        eid,
        e.get("role", "?"),
        e.get("node", "") or "-",
        e.get("group", "") or "-",
        e.get("requests", 0),
        e.get("tokens", 0),
        kv,
        store,
        "yes" if e.get("alive", True) else "no",
    )


def _header(data: dict, run: LocalRun) -> list[str]:
    where = [f"scheduler {run.scheduler}"]
    if run.pid:
        where.append(f"dualpath serve pid {run.pid}")
    if run.api:
        where.append(f"API {run.api}")
    if run.run_dir:
        where.append(f"run dir {run.run_dir}")
    alive = data.get("engines_alive_by_role", {})
    weights = data.get("weights_version") or "as started"
    return [
        " | ".join(where),
        " | ".join(
            x
            for x in (
                f"model {run.model}" if run.model else "",
                f"weights {weights}",
                f"scheduling {data.get('scheduling_policy', '?')}",
                "PAUSED" if data.get("paused") else "",
                "HELD" if data.get("held") else "",
            )
            if x
        ),
        f"engines alive: {alive.get('prefill', 0)} prefill, {alive.get('decode', 0)} decode",
    ]


def _requests(data: dict) -> list[str]:
    waiting = data.get("waiting_by_priority") or {}
    by_priority = ", ".join(f"priority {k}: {v}" for k, v in sorted(waiting.items(), key=lambda kv: int(kv[0])))
    prompt, hit = data.get("prompt_tokens", 0), data.get("hit_tokens", 0)
    return [
        f"requests: {data.get('in_flight', 0)} in flight, {data.get('submitted', 0)} submitted, "
        f"{data.get('finished', 0)} finished, {data.get('failed', 0)} failed, {data.get('rejected', 0)} rejected",
        f"queues: global {data.get('global_queue', 0)}, prefill {data.get('prefill_queue', 0)}, decode "
        f"{data.get('decode_queue', 0)}" + (f" (waiting by {by_priority})" if by_priority else ""),
        f"KV: {data.get('index_blocks', 0):,} blocks stored ({data.get('block_size', 0)} tokens each); "
        f"{hit:,} of {prompt:,} prompt tokens hit ({100 * hit / prompt if prompt else 0:.0f}%); requests by "
        f"read path: PE {data.get('path_pe', 0)}, DE {data.get('path_de', 0)}, split {data.get('path_split', 0)}",
    ]


def render(data: dict, run: LocalRun) -> str:
    """The scheduler's stats (``SchedulerCore.stats``) as a few lines and two tables: engines, and nodes."""
    lines = _header(data, run)
    lines += [f"NOT SERVING: {m}" for m in data.get("missing") or ()]
    lines += _requests(data)
    if data.get("lora_adapters"):
        lines.append("LoRA adapters loaded at runtime: " + ", ".join(data["lora_adapters"]))
    engines = data.get("engines") or {}
    lines += [
        "",
        *_table(
            ("ENGINE", "ROLE", "NODE", "GROUP", "REQUESTS", "TOKENS", "KV USED", "KV STORE", "ALIVE"),
            [_engine_row(eid, e) for eid, e in sorted(engines.items())],
        ),
    ]
    nodes = sorted(set(data.get("storage_read_bytes") or {}) | set(data.get("node_read_q_tokens") or {}))
    if nodes:
        reads, queue = data.get("storage_read_bytes") or {}, data.get("node_read_q_tokens") or {}
        lines += [
            "",
            *_table(
                ("NODE", "STORAGE READ", "READ QUEUE (TOKENS)"),
                [(n, _bytes(reads.get(n, 0)), queue.get(n, 0)) for n in nodes],
            ),
        ]
    return "\n".join(lines)
