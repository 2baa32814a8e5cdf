"""What load balancers, operators and RL frameworks ask a server about itself: ``/health`` (the scheduler has every
engine it needs; vLLM's ``/ping`` is the same, SageMaker's check), SGLang's ``/health_generate`` (one token through
the whole cluster: scheduler, prefill engine, decode engine, stream), ``/get_model_info``, ``/get_server_info`` and
``/get_weight_version``, and vLLM's ``/version``.

``/health`` proves the scheduler sees its engines; ``/health_generate`` proves they compute: a wedged engine loop
leaves the first answering while the second times out. It costs nothing on a busy server: a token that any request
receives while the probe waits answers it (SGLang's rule), and concurrent probes share one generation.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import asdict
from functools import cached_property
from pathlib import Path

from fastapi.responses import JSONResponse

import dualpath
from dualpath.core.errors import DualPathError
from dualpath.core.sampling_params import SamplingParams
from dualpath.serving.auth import SECRETS
from dualpath.serving.choices import ApiError

PROBE_PROMPT = "ping"  # one or two tokens: less than a block, so it neither reads nor writes the KV store
POLL_S = 0.2  # how often a waiting probe looks for other requests' tokens


class Probes:
    """The frontend's self-reports; ``front`` is the ``Frontend`` (its client, tokenizer, config and the time of the
    last token any generation received, ``last_token_at``)."""

    def __init__(self, front):
        self.front = front
        self._probe: asyncio.Future | None = None  # the /health_generate generation in flight (shared)

    async def stats(self) -> dict:
        """The scheduler's ``stats`` (a 503 ``ApiError`` when it does not answer)."""
        return await ask_scheduler(self.front.client.stats)

    async def health(self) -> JSONResponse:
        """200 while the scheduler has an engine of each role; else 503 naming what is missing."""
        try:
            stats = await self.stats()
        except ApiError as e:
            return JSONResponse({"status": "unavailable", "missing": [str(e)]}, 503)
        if stats.get("ready", False):
            return JSONResponse({"status": "ok"}, 200)
        return JSONResponse({"status": "unavailable", "missing": stats.get("missing", [])}, 503)

    async def health_generate(self) -> JSONResponse:
        """200 once a token came back (the probe's own, or any request's since the probe began); 503 when the
        scheduler lacks engines, is paused for a weight update, or no token came within the timeout."""
        since = time.perf_counter()
        try:
            stats = await self.stats()
        except ApiError as e:
            return _unhealthy(str(e), since)
        if not stats.get("ready", False):
            return _unhealthy("; ".join(stats.get("missing", [])) or "the scheduler lacks engines", since)
        if stats.get("paused", False) or stats.get("held", False):
            why = "the model's weights are being updated" if stats.get("paused") else "/pause (POST /resume goes on)"
            return _unhealthy(f"generation is paused: {why}", since)
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._one_token())
            self._probe.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if unawaited
        probe, timeout = self._probe, self.front.cfg.health_generate_timeout_s
        late = f"no token within {timeout:g} s"
        while not probe.done() and self.front.last_token_at <= since:
            left = since + timeout - time.perf_counter()
            if left <= 0:
                return _unhealthy(late, since)
            await asyncio.wait({probe}, timeout=min(POLL_S, left))
        failed = probe.exception() if probe.done() and not probe.cancelled() else None
        if isinstance(failed, asyncio.TimeoutError):  # a shared probe begun earlier ran out first
            return _unhealthy(late, since)
        if failed is not None:
            return _unhealthy(f"the probe's generation failed: {failed}", since)
        return JSONResponse({"status": "ok", "seconds": round(time.perf_counter() - since, 4)})

    async def _one_token(self) -> None:
        """A greedy one-token generation, cancelled if it has not ended within the timeout (no probe outlives it)."""
        tok = self.front.tokenizer  # (without a tokenizer, --skip-tokenizer-init, the probe's prompt is token 0)
        ids = (tok.encode(PROBE_PROMPT, add_special_tokens=True) if tok.takes_text else []) or [0]
        sampling = SamplingParams(max_tokens=1, temperature=0.0)
        handle = await asyncio.to_thread(self.front.client.start, ids, sampling, f"health-{uuid.uuid4().hex}")
        try:
            await asyncio.wait_for(asyncio.to_thread(_first_token, handle), self.front.cfg.health_generate_timeout_s)
        finally:
            handle.cancel()  # nothing once it ended; else its engines drop it and the thread above returns

    @cached_property
    def _hf_config(self) -> dict:
        try:
            return json.loads((Path(self.front.cfg.model_dir) / "config.json").read_text())
        except (OSError, ValueError):
            return {}

    async def model_info(self) -> dict:
        """SGLang's ``/get_model_info``; ``model_path`` follows ``/update_weights_from_disk``."""
        stats = await self.stats()
        cfg = self.front.cfg
        return {
            "model_path": stats.get("weights_path") or cfg.model_dir,
            "tokenizer_path": cfg.model_dir,
            "served_model_name": cfg.model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": stats.get("weights_version", ""),
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": self._hf_config.get("model_type"),
            "architectures": self._hf_config.get("architectures"),
            "max_model_len": cfg.max_model_len,
        }

    async def server_info(self) -> dict:
        """SGLang's ``/get_server_info``: this frontend's settings (the API key only as whether one is set), the
        version, and the scheduler's state (``dualpath status`` shows the same)."""
        settings = {k: v for k, v in asdict(self.front.cfg).items() if k not in (*SECRETS, "chat_template")}
        settings["api_key_set"] = bool(self.front.auth.inference_keys)
        settings["admin_api_key_set"] = bool(self.front.cfg.admin_api_key)
        settings["chat_template_set"] = self.front.cfg.chat_template is not None
        return {
            **settings,
            "version": dualpath.__version__,
            "requests_in_flight": self.front.in_flight,
            "internal_states": [await self.stats()],
        }

    async def weight_version(self) -> dict:
        stats = await self.stats()
        return {"weight_version": stats.get("weights_version", ""), "fingerprint": stats.get("fingerprint", "")}

    @staticmethod
    def version() -> dict:
        return {"version": dualpath.__version__}


async def ask_scheduler(call, *args):
    """``call(*args)``, a blocking ``ClusterClient`` call, on a worker thread; a 503 when the scheduler does not
    answer."""
    try:
        return await asyncio.to_thread(call, *args)
    except DualPathError as e:
        raise ApiError(503, f"the scheduler did not answer: {e}", "server_error") from None


def _first_token(handle) -> None:
    """Until the handle's first token or end (closing its events there lets go of the request)."""
    events = handle.events()
    try:
        for ev in events:
            if ev.token_id >= 0 or ev.finish_reason:
                return
        raise DualPathError("the probe's stream ended without a token")
    finally:
        events.close()


def _unhealthy(why: str, since: float) -> JSONResponse:
    return JSONResponse({"status": "unavailable", "error": why, "seconds": round(time.perf_counter() - since, 4)}, 503)
