"""OpenAI's chat completions, ``POST /v1/chat/completions``: the shared pipeline (``dualpath.serving.pipeline``)
with a chat's prompt (rendered by the chat template) and reply (thinking and tool calls split out)."""

from __future__ import annotations

from fastapi import APIRouter

from dualpath.serving.pipeline import OpenAICall, generation_router


def router(front) -> APIRouter:
    return generation_router(front, "/v1/chat/completions", lambda: OpenAICall(front, "chat"))
