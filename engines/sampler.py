"""Next-token choice for a batch of requests with per-request parameters and generators."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from dualpath.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the ``logprobs`` most likely tokens and their log-probabilities


def make_generator(params: SamplingParams, device: str | torch.device = "cpu") -> torch.Generator | None:
    """A per-request generator, so a seeded request samples the same tokens whatever it is batched with."""
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    if params.seed is not None:
        g.manual_seed(params.seed)
    else:
        g.seed()
    return g


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens strictly more likely already cover top_p.
        drop = (probs.cumsum(-1) - probs) > top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> tuple[list[int], list[TokenLogprob | None]]:
    """Pick one token per row of ``logits`` ``[B, vocab]`` (float32). Logprobs, when asked, are those of the model's
    distribution before temperature and filtering (as OpenAI-compatible servers report them)."""
    greedy = logits.argmax(-1).tolist()
    tokens, logprobs = [], []
    for i, p in enumerate(params):
        if p.greedy:
            tok = greedy[i]
        else:
            row = _filter(logits[i] / p.temperature, p.top_k, p.top_p)
            tok = int(torch.multinomial(row.softmax(-1), 1, generator=generators[i]).item())
        tokens.append(tok)
        logprobs.append(_logprob(logits[i], tok, p.logprobs) if p.logprobs is not None else None)
    return tokens, logprobs


def _logprob(row: torch.Tensor, token: int, k: int) -> TokenLogprob:
    lp = row.log_softmax(-1)
    top = torch.topk(lp, k) if k else None
    pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
    return TokenLogprob(token, float(lp[token]), pairs)
