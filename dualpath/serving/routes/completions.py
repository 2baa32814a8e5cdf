"""OpenAI's (legacy) completions, ``POST /v1/completions``: the shared pipeline (``dualpath.serving.pipeline``) with
a text or token-id prompt, or OpenAI's batch of them (each submitted as a request of its own), ``echo`` and
``best_of``."""

from __future__ import annotations

from fastapi import APIRouter

from dualpath.serving.pipeline import OpenAICall, generation_router


def router(front) -> APIRouter:
    return generation_router(front, "/v1/completions", lambda: OpenAICall(front, "completions"))
