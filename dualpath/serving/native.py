"""SGLang's native ``POST /generate``, the endpoint RL rollout frameworks drive (with ``/update_weights_from_disk``).

A request is read into the completions endpoint's own request (so every check, default and limit is the same)
and answered in SGLang's shape: per choice ``text``, ``output_ids`` and ``meta_info`` (``id``, ``finish_reason`` as
``{"type": "stop", "matched": token id or stop string}`` or ``{"type": "length", "length": n}``, ``prompt_tokens``,
``completion_tokens``, ``cached_tokens``, ``e2e_latency``, and with ``return_logprob`` ``output_token_logprobs``
``[[logprob, token id, text or None], ...]`` and ``output_top_logprobs``). One prompt and ``n`` 1 gives one
object; a batch or ``n`` > 1 a list, prompt after prompt, a prompt's choices together. Streamed, each event carries
a choice's whole text and ids so far (SGLang's default, cumulative) and its ``index``; ``[DONE]`` ends the stream.
The route, on the shared pipeline: ``dualpath.serving.routes.sglang``.
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from dualpath.core.errors import RequestError
from dualpath.serving.choices import Outcome, PromptLogprobs, merge
from dualpath.serving.json_bodies import parse
from dualpath.serving.protocol import CompletionRequest

# SGLang's sampling_params keys -> the completions request's fields (those not listed are named alike)
RENAMED = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "no_stop_trim": "include_stop_str_in_output",
    "sampling_seed": "seed",
    "json_schema": "guided_json",
    "regex": "guided_regex",
    "ebnf": "guided_grammar",
}
ALIKE = {
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "n",
    "logit_bias",
}
IGNORED = {"spaces_between_special_tokens"}  # what fast tokenizers do anyway (as on the completions endpoint)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    rid: Optional[Union[str, list[str]]] = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(0, ge=0, le=20)
    return_text_in_logprobs: bool = False
    stream: bool = False
    priority: Optional[int] = None  # SGLang's: higher first (its default order), so the completion's is its negation
    lora_path: Optional[Union[str, list[str]]] = None  # SGLang's: a served LoRA adapter's name (one for every prompt)


def served_model(req: GenerateRequest, base: str, adapters: dict[str, str]) -> str:
    """The model a request runs on: the base, or the served LoRA adapter its ``lora_path`` names."""
    names = [req.lora_path] if isinstance(req.lora_path, str) else req.lora_path or [None]
    if any(n != names[0] for n in names):
        raise RequestError("lora_path: one adapter for every prompt (a list must repeat one)", field="lora_path")
    if names[0] is not None and names[0] not in adapters:
        known = ", ".join(repr(n) for n in adapters) or "none (--lora-modules)"
        raise RequestError(f"lora_path: no LoRA adapter {names[0]!r} is served; served: {known}", field="lora_path")
    return names[0] or base


def as_completion(req: GenerateRequest, model: str) -> CompletionRequest:
    """The completions request that asks for the same (``RequestError`` naming SGLang's field otherwise)."""
    if (req.text is None) == (req.input_ids is None) or req.input_ids == []:
        raise RequestError("give either text or input_ids (not empty)", field="text")
    n_prompts = (
        len(req.text)
        if isinstance(req.text, list)
        else len(req.input_ids)
        if req.input_ids and isinstance(req.input_ids[0], list)
        else 1
    )
    if isinstance(req.rid, list) and len(req.rid) != n_prompts:
        raise RequestError(f"rid: {len(req.rid)} ids for {n_prompts} prompts", field="rid")
    if req.logprob_start_len < -1:
        raise RequestError(
            "logprob_start_len: -1 (the output's logprobs only) or a prompt position", field="logprob_start_len"
        )
    sp = req.sampling_params or {}
    if isinstance(sp, list):
        if any(x != sp[0] for x in sp) or not sp:
            raise RequestError(
                "sampling_params: one set for every prompt (a list must repeat one)", field="sampling_params"
            )
        sp = sp[0]
    unknown = sorted(set(sp) - set(RENAMED) - ALIKE - IGNORED)
    if unknown:
        raise RequestError(f"sampling_params: not supported: {', '.join(unknown)}", field="sampling_params")
    fields = {RENAMED.get(k, k): v for k, v in sp.items() if k not in IGNORED}
    fields.setdefault("max_tokens", 128)  # SGLang's default
    if fields.get("top_k") == -1:
        fields["top_k"] = 0
    if isinstance(fields.get("guided_json"), str):
        try:
            fields["guided_json"] = json.loads(fields["guided_json"])
        except ValueError as e:
            raise RequestError(f"sampling_params.json_schema: not JSON ({e})", field="sampling_params") from None
    body = {
        "model": model,
        "prompt": req.text if req.text is not None else req.input_ids,
        **fields,
        "logprobs": req.top_logprobs_num if req.return_logprob else None,
        "prompt_logprobs": req.top_logprobs_num if req.return_logprob and req.logprob_start_len >= 0 else None,
        "priority": -(req.priority or 0),
    }
    try:
        # through JSON text again: a schema given as text (json_schema) is checked for lone surrogates as a body is
        return parse(CompletionRequest, json.dumps(body).encode())
    except RequestError as e:
        name = sglang_name(e.field, req)
        raise RequestError(f"{name}: {str(e).split(': ', 1)[-1]}", field=name) from None


def sglang_name(field: str | None, req: GenerateRequest | None) -> str | None:
    """SGLang's name of a completions request's field (what an error names)."""
    if field == "prompt":
        return "input_ids" if req is not None and req.input_ids is not None else "text"
    if field in ("logprobs", "prompt_logprobs"):
        return "top_logprobs_num"
    back = {v: k for k, v in RENAMED.items()}
    name = back.get(field, field)
    return f"sampling_params.{name}" if name in ALIKE or name in RENAMED else field


def _rids(req: GenerateRequest, n_prompts: int) -> list[str | None]:
    return req.rid if isinstance(req.rid, list) else [req.rid] * n_prompts


def given_rids(req: GenerateRequest, n_prompts: int) -> list[str]:
    """What ``/abort_request`` names each prompt's request by ("": the X-Request-Id)."""
    return [r or "" for r in _rids(req, n_prompts)]


class Answers:
    """SGLang's objects of one request's choices (``job``: ``dualpath.serving.pipeline.Job``)."""

    def __init__(self, tokenizer, req: GenerateRequest, job):
        self.tok, self.req, self.job = tokenizer, req, job
        self.comp, self.prompts, self.samplings, self.start = job.req, job.prompts, job.samplings, job.started
        self.rids = [r or f"gen-{self.start:.6f}-{i}" for i, r in enumerate(_rids(req, len(job.prompts)))]

    def one(self, i: int, text: str, lps: list, ids: list[int], outcome: Outcome | None) -> dict:
        p = i // self.comp.n
        meta = {
            "id": self.rids[p] if self.comp.n == 1 else f"{self.rids[p]}-{i % self.comp.n}",
            "prompt_tokens": len(self.prompts[p].ids),
            "completion_tokens": len(ids),
            "e2e_latency": round(time.perf_counter() - self.start, 6),
            "finish_reason": self._finish(outcome, ids, text, self.samplings[p]) if outcome else None,
        }
        if outcome is not None:
            meta["cached_tokens"] = outcome.cached_tokens
        if self.req.return_logprob:
            meta["output_token_logprobs"] = [[lp["logprob"], lp["token_id"], self._text(lp["token_id"])] for lp in lps]
            meta["output_top_logprobs"] = [[[v, t, self._text(t)] for t, v in lp["top"]] for lp in lps]
        if outcome is not None and outcome.prompt_logprobs is not None:  # logprob_start_len >= 0
            first = {"token_id": self.prompts[p].ids[0], "logprob": None, "top": ()}  # nothing precedes it
            given = ([first] + outcome.prompt_logprobs)[self.req.logprob_start_len :]
            meta["input_token_logprobs"] = [[lp["logprob"], lp["token_id"], self._text(lp["token_id"])] for lp in given]
            meta["input_top_logprobs"] = [
                [[v, t, self._text(t)] for t, v in lp["top"][: self.req.top_logprobs_num]]
                if lp["logprob"] is not None
                else None
                for lp in given
            ]
        return {"text": text, "output_ids": list(ids), "meta_info": meta, "index": i}

    def _text(self, token: int) -> str | None:
        return self.tok.decode([token], skip_special_tokens=False) if self.req.return_text_in_logprobs else None

    def _finish(self, outcome: Outcome, ids: list[int], text: str, sampling) -> dict:
        """SGLang's finish reason: the length, or what matched: a stop string (the text stopped short of the
        tokens' own) or the last token (an end or stop token)."""
        if outcome.finish_reason == "length":
            return {"type": "length", "length": len(ids)}
        if outcome.finish_reason == "abort":
            return {"type": "abort", "message": "aborted (/abort_request, or a weight update's abort_all_requests)"}
        whole = self.tok.decode(ids, skip_special_tokens=sampling.skip_special_tokens)
        for s in sampling.stop:
            if s in whole[max(0, len(text) - len(s)) :]:
                return {"type": "stop", "matched": s}
        return {"type": "stop", "matched": ids[-1] if ids else None}

    async def bodies(self):
        """The streamed objects: each choice's whole text and ids so far, as its tokens come (SGLang's default,
        cumulative). It closes the choices' generations when it ends."""
        gens = self.job.gens
        texts, ids, lps = [""] * len(gens), [[] for _ in gens], [[] for _ in gens]
        try:
            async for i, item in merge(gens):
                if isinstance(item, PromptLogprobs):
                    continue
                if isinstance(item, Outcome):
                    yield self.one(i, texts[i], lps[i], ids[i], item)
                    continue
                delta, tokens, lp = item
                texts[i] += delta
                ids[i] += tokens
                if lp:
                    lps[i].append(lp)
                if delta or tokens:
                    yield self.one(i, texts[i], lps[i], ids[i], None)
        finally:
            for g in gens:
                await g.aclose()
