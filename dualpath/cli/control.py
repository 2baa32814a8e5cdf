"""Commands on a running cluster: ``dualpath status``, ``pause``, ``resume``, ``abort``, ``flush-cache`` and
``update-weights``."""

from __future__ import annotations

import argparse
import sys

from dualpath.cli.options import Options, opt, options


@options
class StatusOptions(Options):
    scheduler: str | None = opt(
        None,
        "scheduler host:port",
        default_text="this host's `dualpath serve`, found by the record it keeps under ~/.cache/dualpath/runs "
        "while it serves, its cluster token with it; the newest of several",
    )
    run_dir: str | None = opt(
        None, "instead: the `dualpath serve --run-dir` of the run to show", default_text="the newest run's"
    )
    wait_prefill: int = opt(0, "first wait for this many live prefill engines")
    wait_decode: int = opt(0, "first wait for this many live decode engines")
    timeout: float = opt(0.0, "seconds to wait (0: ask once)")
    json: bool = opt(False, "the scheduler's stats as JSON (for machines)")


@options
class ControlOptions(Options):
    scheduler: str = opt(help="scheduler host:port")


@options
class PauseOptions(ControlOptions):
    abort: bool = opt(False, "end every request in flight now")
    timeout: float = opt(600.0, "seconds to wait for the requests sent before the pause to end")


@options
class AbortOptions(ControlOptions):
    rid: str | None = opt(
        None, "the requests of this label (SGLang's rid, or an X-Request-Id)", one_of="which requests"
    )
    all: bool = opt(False, "every request in flight", one_of="which requests")


CONTROLS = {  # action: (help, options)
    "pause": (
        "hand no request sent from now on to an engine until resume (requests sent before run to their end; with "
        "--abort every request in flight ends now)",
        PauseOptions,
    ),
    "resume": ("end a pause", ControlOptions),
    "abort": ("end requests in flight where they are (finish reason abort)", AbortOptions),
    "flush-cache": ("remove every stored KV block of the served weights (refused while requests run)", ControlOptions),
}


@options
class UpdateWeightsOptions(Options):
    model_path: str = opt(help="a checkpoint directory every engine's node can read", positional=True)
    scheduler: str = opt(help="scheduler host:port")
    version: str = opt("", "a label for these weights (GET /get_weight_version)", default_text="none")
    timeout: float = opt(600.0, "seconds for the requests in flight to finish, then for the engines to load")
    abort: bool = opt(False, "do not wait: requeue requests not yet generating, end those generating")
    json: bool = opt(False, "the reply as JSON (for machines)")


def cmd_status(args: argparse.Namespace) -> int:
    """Print the scheduler's view as a table (``--json``: its stats); with ``--wait-prefill/--wait-decode``, first
    wait for that many live engines (deployment scripts use it to know the cluster is up). No ``--scheduler``: this
    host's ``dualpath serve`` (``dualpath.runs``), whose cluster token is then used too."""
    import json
    import time

    from dualpath.core.errors import ConfigError
    from dualpath.status import find_scheduler, render, use_token_file

    deadline = time.monotonic() + args.timeout  # (finding the run and its engines share the wait)
    try:
        target = find_scheduler(args.scheduler, args.run_dir, wait_s=args.timeout)
    except ConfigError as e:
        print(json.dumps({"error": str(e)}) if args.json else f"no scheduler: {e}")
        return 1
    use_token_file(target.run)
    if target.note:
        print(target.note, file=sys.stderr)
    data, up = _wait_for_engines(target.run.scheduler, args, max(0.0, deadline - time.monotonic()))
    if args.json:
        print(json.dumps(data))
    elif up:
        print(render(data, target.run))
    else:
        print(
            f"{'refused' if 'UNAUTHENTICATED' in str(data.get('error')) else 'timed out'}: {data.get('error') or data}"
        )
    return 0 if up else 1


def _wait_for_engines(scheduler: str, args: argparse.Namespace, timeout: float) -> tuple[dict, bool]:
    """The scheduler's stats once it has ``--wait-prefill`` and ``--wait-decode`` live engines (within ``timeout``
    seconds), and whether it came to that; else ``{"error": ...}`` or the last stats."""
    import time

    from dualpath.client import ClusterClient
    from dualpath.core.errors import DualPathError

    client, deadline, data, up = (ClusterClient(scheduler), time.monotonic() + timeout, {}, False)
    try:
        while not up:
            try:
                data = client.stats()
                alive = data.get("engines_alive_by_role", {})
                up = alive.get("prefill", 0) >= args.wait_prefill and alive.get("decode", 0) >= args.wait_decode
            except DualPathError as e:
                data = {"error": str(e)}
                if getattr(getattr(e, "code", None), "name", "") == "UNAUTHENTICATED":  # waiting will not help
                    data["error"] += (
                        " (this process lacks the cluster's token: set DUALPATH_CLUSTER_TOKEN or "
                        "DUALPATH_CLUSTER_TOKEN_FILE; `dualpath serve` prints where its file is)"
                    )
                    break
            if not up and time.monotonic() > deadline:
                break
            time.sleep(0 if up else 1.0)
    finally:
        client.close()
    return data, up


def cmd_control(args: argparse.Namespace) -> int:
    """Pause, resume, abort or flush a running cluster through its scheduler: what a frontend's /pause, /resume,
    /abort_request and /flush_cache do, for jobs without one (``dualpath rollout``) and for operators. Exit status
    0 when it was done."""
    from dualpath.client import ClusterClient
    from dualpath.core.errors import DualPathError

    client = ClusterClient(args.scheduler)
    try:
        if args.action == "pause":
            reply = client.hold(True, args.abort, 0.0 if args.abort else args.timeout)
            done = args.abort or reply.drained
            print(
                f"paused; {reply.aborted} requests aborted"
                if done
                else f"paused, but requests sent before still ran after {args.timeout:g} s",
                flush=True,
            )
        elif args.action == "resume":
            client.hold(False)
            done = True
            print("resumed", flush=True)
        elif args.action == "abort":
            print(f"{client.abort(args.rid or '', args.all)} requests aborted", flush=True)
            done = True
        else:
            ack = client.flush_cache()
            done = ack.ok
            print("cache flushed" if done else f"cache not flushed: {ack.error}", flush=True)
    except DualPathError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0 if done else 1


def cmd_update_weights(args: argparse.Namespace) -> int:
    """Every engine of a running cluster loads new weights (``ClusterClient.update_weights``); exit status 0 only
    if all did."""
    import dataclasses
    import json
    from pathlib import Path

    from dualpath.client import ClusterClient
    from dualpath.core.errors import DualPathError

    client = ClusterClient(args.scheduler)
    try:
        reply = client.update_weights(
            str(Path(args.model_path).expanduser().resolve()), args.version, args.timeout, args.abort
        )
    except DualPathError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if args.json:
        print(json.dumps(dataclasses.asdict(reply)))
    elif reply.fingerprint:
        print(
            f"{reply.engines} engines serve {args.model_path} (version {reply.version!r}, fingerprint "
            f"{reply.fingerprint[:12]}) after {reply.seconds:.1f} s; {reply.aborted} requests aborted"
        )
    if not reply.ok:
        print(f"error: {reply.error}", file=sys.stderr)
    return 0 if reply.ok else 1
