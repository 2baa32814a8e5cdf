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


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A per-request generator, so a seeded request samples the same tokens whatever it is batched with. On the
    host whatever the engine's device: a token costs one number from it, drawn without touching the device, and a
    seed gives the same tokens on every device (for the same logits)."""
    if params.greedy:
        return None
    g = torch.Generator()
    if params.seed is not None:
        g.manual_seed(params.seed)
    else:
        g.seed()
    return g


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
           masks: Sequence[torch.Tensor | None] | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
    """Pick one token per row of ``logits`` ``[B, vocab]`` (float32). Logprobs, when asked, are those of the model's
    distribution before temperature, filtering and masks (as OpenAI-compatible servers report them). ``masks``:
    per row None or a ``[vocab]`` boolean tensor of the tokens it may take (structured output; never all False).

    The whole batch is one pass on the device and one copy of the answers to the host (a row at a time would be
    a dozen kernels and a wait per sampled row: on a GPU, longer than the decode step). A sampled row draws one
    uniform number from its own generator and takes the token where it falls in the row's filtered distribution
    (inverse CDF), so a seeded request samples the same tokens whatever it is batched with."""
    b, dev = logits.shape[0], logits.device
    raw, logits = logits, _masked(logits, masks)
    tokens = logits.argmax(-1)
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if drawn:
        rows = torch.tensor(drawn).to(dev, non_blocking=True) if len(drawn) < b else None
        sub = logits if rows is None else logits.index_select(0, rows)
        knobs = torch.tensor([[params[i].temperature, params[i].top_k, params[i].top_p,
                               float(torch.rand(1, generator=generators[i]))] for i in drawn],
                             dtype=torch.float64).to(dev, non_blocking=True)  # one copy; float64 keeps the draw
        k_max = min(max([params[i].top_k for i in drawn] + [0]), logits.shape[-1])  # top_k <= 0: off
        top_p = knobs[:, 2].float() if any(params[i].top_p < 1.0 for i in drawn) else None
        picked = _draw(filtered_probs(sub / knobs[:, :1].float(), knobs[:, 1], top_p, k_max), knobs[:, 3].float())
        tokens = picked if rows is None else tokens.index_copy(0, rows, picked)
    asked = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not asked:
        return tokens.tolist(), [None] * b
    return _with_logprobs(raw, tokens, params, asked)


def _masked(logits: torch.Tensor, masks: Sequence[torch.Tensor | None] | None) -> torch.Tensor:
    """``logits`` with the tokens a row may not take at -inf (a new tensor; the rows without a mask unchanged)."""
    some = next((m for m in masks or () if m is not None), None)
    if some is None:
        return logits
    every = some.new_ones(()).expand_as(some)
    allowed = torch.stack([every if m is None else m for m in masks])
    return torch.where(allowed, logits, float("-inf"))


def filtered_probs(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None,
                   k_max: int) -> torch.Tensor:
    """Probabilities of rows of temperature-scaled logits with top-k then top-p applied: dropped tokens 0, the rest
    renormalized, in vocabulary order. Top-k (rows with ``top_k`` > 0; ``k_max``: the largest, 0 if none) keeps
    every token at least as likely as the k-th, ties included; top-p (``None``: no row uses it) then drops a token
    when the tokens strictly more likely already cover ``top_p`` of the top-k distribution. A row's answer does not
    depend on the other rows (the batch decides only which steps run, and a step a row does not use leaves it
    exactly as it was)."""
    if k_max:
        k = top_k.long().clamp(1, k_max)
        kth = scaled.topk(k_max, dim=-1).values.gather(1, (k - 1)[:, None])
        floor = torch.where((top_k > 0)[:, None], kth, torch.full_like(kth, float("-inf")))
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))  # a sort of mostly -inf is also cheaper
    if top_p is not None:
        ordered, order = scaled.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        drop = (probs.cumsum(-1) - probs) > top_p[:, None]
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), float("-inf"))
    return scaled.softmax(-1)


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token where ``u`` (one uniform number per row) falls in each row's cumulative distribution, in
    vocabulary order."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    # the first position whose cumulative probability exceeds the point (right=True): where the CDF steps up, never
    # a zero-probability token; the point stays below the total (the CDF's own float sum)
    point = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, point, right=True)[:, 0]


def _with_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams],
                   asked: list[int]) -> tuple[list[int], list[TokenLogprob | None]]:
    """Tokens and, for the ``asked`` rows, the chosen token's log-probability and the top alternatives: one copy
    to the host for all of it."""
    rows = torch.tensor(asked).to(logits.device, non_blocking=True)
    lp = logits.index_select(0, rows).log_softmax(-1)
    chosen = lp.gather(1, tokens.index_select(0, rows)[:, None])[:, 0]
    k = max(params[i].logprobs for i in asked)
    top = lp.topk(k, dim=-1) if k else None
    parts = [tokens.double(), chosen.double()]
    if top is not None:
        parts += [top.indices.double().reshape(-1), top.values.double().reshape(-1)]
    flat = torch.cat(parts).tolist()  # token ids are exact in float64
    b, r = len(params), len(asked)
    ids = [int(t) for t in flat[:b]]
    out: list[TokenLogprob | None] = [None] * b
    for j, i in enumerate(asked):
        n = params[i].logprobs
        idx = flat[b + r + j * k: b + r + j * k + n]
        vals = flat[b + r + r * k + j * k: b + r + r * k + j * k + n]
        out[i] = TokenLogprob(ids[i], flat[b + j], tuple((int(t), v) for t, v in zip(idx, vals)))
    return ids, out
