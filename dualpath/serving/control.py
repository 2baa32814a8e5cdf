"""Pausing generation and flushing the KV store, for RL trainers, operators and benchmarks: vLLM's ``POST /pause``
(``mode`` abort or wait), ``POST /resume`` and ``GET /is_paused``; SGLang's ``POST /pause_generation`` (mode abort)
and ``POST /continue_generation``.

The scheduler holds the cluster (``SchedulerCore.hold``): it hands no request sent from then on to an engine until
resumed; they are accepted and wait in its queue (nothing accepted is lost). ``abort`` ends every request in
flight at once, this frontend's and every other's, queued or generating: each choice answers with what it
generated and finish reason ``abort`` (a trainer's partial rollouts). ``wait`` lets every request sent before the
pause run to its end, queued ones too, and returns when they have (a trainer awaits its rollouts, then updates).
A weight update while paused (``/update_weights_from_disk``) loads the weights and leaves the cluster paused.
vLLM's ``keep`` and SGLang's ``retract`` and ``in_place`` freeze requests on the engines, which these cannot: a 400
says so. ``clear_cache`` needs nothing: stored KV is keyed by the weights' fingerprint, so no block of old weights
can hit new ones.

SGLang's ``/flush_cache`` and vLLM's ``/reset_prefix_cache`` empty the prefix cache, which here is the KV store:
every stored block of the served weights is removed (a benchmark's cold start), refused while requests run.
"""

from __future__ import annotations

from dualpath.core.messages import HoldReply
from dualpath.serving.choices import ApiError
from dualpath.serving.probes import ask_scheduler
from dualpath.serving.protocol import PauseGenerationRequest

PAUSE_WAIT_S = 600.0  # how long mode "wait" waits by default for the requests sent before the pause to end
MAX_WAIT_S = 86400.0
FROZEN = "freezes requests on the engines, which they cannot; 'abort' ends them now, 'wait' lets them finish"


class Control:
    def __init__(self, front):
        self.front = front

    async def _hold(self, on: bool, abort: bool = False, wait_s: float = 0.0) -> HoldReply:
        return await ask_scheduler(self.front.client.hold, on, abort, wait_s)

    async def pause(
        self, mode: str = "abort", wait_for_inflight_requests: bool = False, timeout: float = PAUSE_WAIT_S
    ) -> dict:
        """vLLM's: ``wait_for_inflight_requests`` (deprecated there) means mode "wait"; ``timeout`` bounds that
        wait (a 504 once it runs out, the cluster staying paused)."""
        mode = "wait" if wait_for_inflight_requests else mode
        if mode not in ("abort", "wait"):
            raise ApiError(
                400,
                f"mode {mode!r} {FROZEN}" if mode == "keep" else f"mode must be 'abort' or 'wait', not {mode!r}",
                param="mode",
            )
        if not 0 < timeout <= MAX_WAIT_S:
            raise ApiError(400, f"timeout must be a number of seconds in (0, {MAX_WAIT_S:g}]", param="timeout")
        reply = await self._hold(True, mode == "abort", timeout if mode == "wait" else 0.0)
        if not reply.drained and mode == "wait":
            raise ApiError(
                504,
                f"requests sent before the pause still ran after {timeout:g} s; generation stays "
                "paused (POST /resume goes on, /pause?mode=abort ends them)",
                "server_error",
            )
        return {"status": "paused", "num_aborted_requests": reply.aborted}

    async def pause_generation(self, req: PauseGenerationRequest) -> dict:
        if req.mode != "abort":
            raise ApiError(400, f"mode {req.mode!r} {FROZEN.split(';')[0]}; only 'abort' is taken", param="mode")
        return await self.pause("abort")

    async def resume(self) -> dict:
        await self._hold(False)
        return {"status": "resumed"}

    async def flush_cache(self) -> dict:
        """SGLang's ``/flush_cache``, vLLM's ``/reset_prefix_cache``: the KV store forgets the served weights'
        blocks (``ClusterClient.flush_cache``); a 400 while requests run, as SGLang's."""
        ack = await ask_scheduler(self.front.client.flush_cache)
        if not ack.ok:
            raise ApiError(400, f"cache not flushed: {ack.error}")
        return {"success": True, "message": "cache flushed: every stored KV block of the served weights is removed"}

    async def is_paused(self) -> dict:
        return {"is_paused": bool((await self.front.probes.stats()).get("held", False))}
