"""A weight update across the cluster (``WeightUpdate`` to the scheduler), and a LoRA adapter loaded on every engine
(``AdapterLoad``), run on the scheduler's event loop.

Pause admission (``SchedulerCore.pause``), wait until no request is on an engine, have every engine load the
weights at once, then resume with the fingerprint they report. Nothing accepted is lost: requests that arrive
meanwhile queue and run on the new weights. If no engine could load them (a checkpoint of another model, a
missing directory) the cluster resumes on the old weights; if only some did, the others are counted gone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import replace

from dualpath.core.messages import AdapterLoad, AdapterLoadReply, WeightUpdate, WeightUpdateReply
from dualpath.core.rpc import ENGINE_METHODS, Client, RpcError
from dualpath.scheduler.core import SchedulerCore

log = logging.getLogger(__name__)
BUSY_RETRY_S = 0.1  # an engine still dropping cancelled work refuses to load; ask again this often


def _load_on(address: str, req: WeightUpdate, deadline: float) -> WeightUpdateReply:
    """Ask one engine to load the weights (blocking: run on a worker thread), again while it is busy."""
    client = Client("Engine", ENGINE_METHODS, address)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return WeightUpdateReply(False, f"engine at {address}: still busy after the update's timeout")
            try:
                reply = client.call("UpdateWeights", req, timeout=left)
            except RpcError as e:
                return WeightUpdateReply(False, str(e))
            if not reply.busy:
                return reply
            time.sleep(BUSY_RETRY_S)
    finally:
        client.close()


def _adapter_on(address: str, req: AdapterLoad, deadline: float) -> AdapterLoadReply:
    """Ask one engine to load the adapter (blocking: run on a worker thread)."""
    client = Client("Engine", ENGINE_METHODS, address)
    try:
        return client.call("LoadAdapter", req, timeout=max(0.1, deadline - time.monotonic()))
    except RpcError as e:
        return AdapterLoadReply(False, str(e))
    finally:
        client.close()


async def load_adapter(core: SchedulerCore, req: AdapterLoad, load_on=_adapter_on) -> AdapterLoadReply:
    """The adapter on every live engine, at once, with nothing paused: a new adapter is a new identity, so no
    request in flight runs under it. Remembered (for engines that join later) once every engine loaded the same
    bytes; an engine that could not keeps serving the rest."""
    engines = {e.info.engine_id: e.info.control_address for e in core.engines.values() if e.alive}
    if not engines:
        return AdapterLoadReply(False, "no engine is registered")
    by_id = await _on_all(load_on, engines, req, time.monotonic() + req.timeout_s)
    failed = {eid: r.error for eid, r in by_id.items() if not r.ok}
    digests = {r.digest for r in by_id.values() if r.ok}
    if failed or len(digests) != 1:
        return AdapterLoadReply(
            False,
            _summary(failed) or f"the engines read different bytes of {req.path}",
            engines=len(by_id) - len(failed),
        )
    digest = digests.pop()
    if req.path not in core.adapters:
        core.adapters.append(req.path)
    log.info("LoRA adapter %s (%s) loaded on %d engines", req.path, digest[:12], len(by_id))
    return AdapterLoadReply(True, digest=digest, engines=len(by_id))


async def update_weights(core: SchedulerCore, req: WeightUpdate, load_on=_load_on) -> WeightUpdateReply:
    start = time.monotonic()
    aborted = core.pause(req.abort)
    by_id: dict[str, WeightUpdateReply] = {}
    try:
        by_id, error = await _drain_and_load(core, req, load_on, start + req.timeout_s)
    finally:  # also when cancelled: the cluster never stays paused
        fp, loaded = _agreed(by_id)
        core.resume(bytes.fromhex(fp) if fp else None, req.version, loaded, req.model_path)
    seconds = time.monotonic() - start
    if not fp:
        error = error or _summary({eid: r.error for eid, r in by_id.items()})
        return WeightUpdateReply(False, error, aborted=aborted, seconds=seconds)
    failed = {eid: r.error or "it loaded other bytes" for eid, r in by_id.items() if eid not in loaded}
    for eid, why in failed.items():
        log.error("engine %s did not load the new weights (%s): it leaves the cluster", eid, why)
    log.info(
        "weights %s (version %r) loaded on %d engines in %.1f s", req.model_path, req.version, len(loaded), seconds
    )
    return WeightUpdateReply(not failed, _summary(failed), fp, req.version, len(loaded), aborted, seconds)


async def drained_by(drained, deadline: float) -> bool:
    """Whether ``drained()`` (``SchedulerCore.drained`` or ``hold_drained``) holds by ``deadline`` (monotonic)."""
    while not drained():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def _drain_and_load(
    core: SchedulerCore, req: WeightUpdate, load_on, deadline: float
) -> tuple[dict[str, WeightUpdateReply], str]:
    """Wait until no request is on an engine, check the checkpoint on every engine, then load it on every engine:
    ``(engine id -> its load reply, "")``, or ``({}, why nothing was loaded)``."""
    if not await drained_by(core.drained, deadline):
        return {}, f"requests still ran after {req.timeout_s:g} s; the weights are unchanged (pass abort to end them)"
    engines = {e.info.engine_id: e.info.control_address for e in core.engines.values() if e.alive}
    if not engines:
        return {}, "no engine is registered"
    checks = await _on_all(load_on, engines, replace(req, check_only=True), deadline)
    refused = {eid: r.error for eid, r in checks.items() if not r.ok}
    if refused:
        return {}, _summary(refused)
    log.info("loading weights %s (version %r) on %d engines", req.model_path, req.version, len(engines))
    return await _on_all(load_on, engines, req, deadline), ""


def _summary(errors: dict[str, str]) -> str:
    """Engines' errors, each message once with the engines that gave it: ``"decode-0, decode-1: why"``."""
    by_error: dict[str, list[str]] = {}
    for eid, why in sorted(errors.items()):
        by_error.setdefault(why, []).append(eid)
    return "; ".join(f"{', '.join(eids)}: {why}" for why, eids in by_error.items())


def _agreed(by_id: dict[str, WeightUpdateReply]) -> tuple[str, list[str]]:
    """The fingerprint most engines loaded (one, unless the files changed while they read them) and those
    engines; ``("", [])`` when none loaded anything."""
    fps = Counter(r.fingerprint for r in by_id.values() if r.ok)
    if not fps:
        return "", []
    fp = fps.most_common(1)[0][0]
    return fp, [eid for eid, r in by_id.items() if r.ok and r.fingerprint == fp]


async def _on_all(load_on, engines: dict[str, str], req, deadline: float) -> dict:
    """``req`` to every engine at once (engine id -> control address), each on a worker thread: engine id -> reply."""
    replies = await asyncio.gather(*(asyncio.to_thread(load_on, a, req, deadline) for a in engines.values()))
    return dict(zip(engines, replies))
