"""SGLang's native ``POST /generate`` (``dualpath.serving.native``): the shared pipeline
(``dualpath.serving.pipeline``) with the body read into the completions endpoint's own request, answered in
SGLang's shape, and errors naming SGLang's fields."""

from __future__ import annotations

from fastapi import APIRouter

from dualpath.serving.native import Answers, GenerateRequest, as_completion, given_rids, served_model, sglang_name
from dualpath.serving.pipeline import GenerationCall, Job, generation_router
from dualpath.serving.json_bodies import parse
from dualpath.serving.protocol import CompletionRequest
from dualpath.serving.streaming import sse


class GenerateCall(GenerationCall):
    endpoint, kind = "generate", "completions"

    def __init__(self, front):
        self.front = front
        self.gen: GenerateRequest | None = None  # the body as sent (once read)

    async def read(self, body: bytes, owner: str) -> CompletionRequest:
        self.gen = parse(GenerateRequest, body)
        return as_completion(self.gen, served_model(self.gen, self.front.cfg.model_name, self.front.models.adapters))

    def streams(self, req) -> bool:
        return self.gen.stream

    def rids(self, n_prompts: int) -> list[str]:
        return given_rids(self.gen, n_prompts)

    def stream(self, job: Job):
        return sse(Answers(self.front.tokenizer, self.gen, job).bodies())

    async def answer(self, job: Job, got) -> dict | list:
        """One prompt with ``n`` 1: its object; else a list, prompt after prompt, a prompt's choices together."""
        answers, gen = Answers(self.front.tokenizer, self.gen, job), self.gen
        single = job.req.n == 1 and (isinstance(gen.text, str) or isinstance((gen.input_ids or [[]])[0], int))
        outs = [answers.one(i, "".join(t), lp, ids, o) for i, (t, lp, ids, o) in enumerate(zip(*got))]
        return outs[0] if single else outs

    def param(self, name: str | None) -> str | None:
        return sglang_name(name, self.gen)


def router(front) -> APIRouter:
    return generation_router(front, "/generate", lambda: GenerateCall(front))
