"""Logprobs in each API's form: the chat's (``content`` entries with each token's own ``bytes``), the legacy
completions form (tokens, token_logprobs, top_logprobs, text_offset) and vLLM's ``prompt_logprobs``. A logprob
arrives from the engines as ``{"token_id", "logprob", "top": [(token id, logprob), ...]}`` (and a prompt token's
``rank``)."""

from __future__ import annotations

from functools import cached_property

from dualpath.core.errors import CheckpointError
from dualpath.serving.choices import ApiError


def wants_logprobs(req, kind: str) -> bool:
    """Whether the reply carries its tokens' logprobs (a chat's ``logprobs: true``; a completion's count, 0 too)."""
    return bool((kind == "chat" and req.logprobs) or (kind == "completions" and req.logprobs is not None))


def check_prompt_logprobs(prompt: list[int], lps: list | None) -> None:
    """The engines gave a logprob for every prompt token but the first (else a 500)."""
    if lps is None or len(lps) != len(prompt) - 1:
        raise ApiError(500, "the engines returned no prompt logprobs for the whole prompt", "server_error")


class LogprobForms:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _name(self, token_id: int, as_id: bool) -> str:
        """A token as logprobs name it: its text, or (vLLM's ``return_tokens_as_token_ids``) ``token_id:N``, which
        names tokens whose text is not whole UTF-8 and tokens that share a text."""
        return f"token_id:{token_id}" if as_id else self._text(token_id)

    @cached_property
    def _raw_tokens(self) -> tuple[bytes | None, ...] | None:
        """Each token's own bytes (once, ~0.5 s for a 49K vocabulary); None where the tokenizer's are not known."""
        try:
            return self.tokenizer.token_bytes
        except CheckpointError:
            return None

    def _chat_entry(self, tid: int, lp: float | None, as_ids: bool) -> dict:
        # OpenAI's ``bytes`` are the token's own, so a character split across tokens joins whole again (each part's
        # text alone is a replacement character); the text's for special tokens or unknown tokenizers
        text, raw = self._text(tid), self._raw_tokens
        own = raw[tid] if raw is not None and tid < len(raw) else None
        return {
            "token": f"token_id:{tid}" if as_ids else text,
            "logprob": lp,
            "bytes": list(own if own is not None else text.encode()),
        }

    def chat(self, lps: list, as_ids: bool = False) -> dict:
        content = [
            {
                **self._chat_entry(lp["token_id"], lp["logprob"], as_ids),
                "top_logprobs": [self._chat_entry(t, v, as_ids) for t, v in lp["top"]],
            }
            for lp in lps
            if lp
        ]
        return {"content": content, "refusal": None}

    def completion(self, lps: list, offset0: int = 0, as_ids: bool = False) -> tuple[dict, int]:
        """The legacy form, and where the tokens' text ends; ``text_offset``: each token's place in the choice's
        text, from ``offset0`` (where the tokens' text begins: after an echoed prompt, or after a stream's earlier
        chunks)."""
        tokens, token_lps, tops, offsets, pos = [], [], [], [], offset0
        for lp in lps:
            if not lp:
                continue
            tokens.append(self._name(lp["token_id"], as_ids))
            token_lps.append(lp["logprob"])
            tops.append({self._name(t, as_ids): v for t, v in lp["top"]})
            offsets.append(pos)
            pos += len(self._text(lp["token_id"]))
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, pos

    def prompt(self, prompt: list[int], lps: list | None, k: int) -> list:
        """vLLM's ``prompt_logprobs``: None for the first token, then per token {id: {logprob, rank, decoded_token}}
        for the token itself and its ``k`` most likely alternatives (ranked 1..k)."""
        check_prompt_logprobs(prompt, lps)

        def entry(t, v, rank):
            return {"logprob": v, "rank": rank, "decoded_token": self._text(t)}

        out = [None]
        for lp in lps:
            d = {str(t): entry(t, v, r + 1) for r, (t, v) in enumerate(lp["top"][:k])}
            d[str(lp["token_id"])] = entry(lp["token_id"], lp["logprob"], lp["rank"])
            out.append(d)
        return out
