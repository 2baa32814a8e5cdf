"""vLLM's native endpoints: ``/tokenize`` (a prompt's token ids, or a chat's as the chat endpoint renders it) and
``/detokenize``."""

from __future__ import annotations

from fastapi import APIRouter, Request

from dualpath.core.errors import RequestError
from dualpath.serving.bounded import off_loop
from dualpath.serving.choices import ApiError
from dualpath.serving.protocol import DetokenizeRequest, TokenizeRequest
from dualpath.serving.routes.utility import answered_body


def router(front) -> APIRouter:
    r = APIRouter()

    async def tokenized(req: TokenizeRequest) -> dict:
        def ids() -> list[int]:
            try:
                if req.messages is not None:
                    return front.prompts.chat_ids(req)
                return front.prompts.encode(req.prompt, "prompt", req.add_special_tokens)
            except RequestError as e:
                raise ApiError(400, str(e), param=e.field) from None

        got = await off_loop(ids)
        return {"count": len(got), "max_model_len": front.cfg.max_model_len, "tokens": got}

    async def detokenized(req: DetokenizeRequest) -> dict:
        if not front.tokenizer.takes_text:  # (its empty text would read as an answer)
            raise ApiError(400, front.tokenizer.refusal("/detokenize"), param="tokens")
        if len(req.tokens) > front.cfg.max_model_len:
            raise ApiError(400, f"tokens: at most the model's context of {front.cfg.max_model_len}", param="tokens")
        ids = front.prompts.known_ids(req.tokens, "tokens")
        return {"prompt": await off_loop(front.tokenizer.decode, ids)}

    @r.post("/tokenize")
    async def tokenize(request: Request):
        return await answered_body(front, request, "tokenize", TokenizeRequest, tokenized)

    @r.post("/detokenize")
    async def detokenize(request: Request):
        return await answered_body(front, request, "detokenize", DetokenizeRequest, detokenized)

    return r
