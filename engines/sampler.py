"""Next-token choice for a batch of requests with per-request parameters and generators."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from dualpath.core.errors import RequestError
from dualpath.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the ``logprobs`` most likely tokens and their log-probabilities
    rank: int = 0  # 1 + the tokens more likely than this one (prompt logprobs; 0: not computed)


class TokenHistory:
    """What the penalties, ``min_tokens`` and bad words read of one request: its prompt's distinct token ids (kept
    only for ``repetition_penalty``), how often each id has been generated, and the reply's last tokens (as many as
    its longest bad word less one). Built once and grown a token at a time (O(1): a step never rescans a long prompt
    or converts the output again). Its owner (a sequence, or the prefill engine for a first token) calls ``add`` for
    every token the request generates, in order."""

    __slots__ = ("prompt", "n", "tail", "bad_words", "_slot", "_ids", "_counts")

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams, output_ids: Sequence[int] = ()):
        self.prompt = (
            torch.tensor(sorted(set(prompt_ids)), dtype=torch.long) if params.repetition_penalty != 1.0 else None
        )
        self.n = 0
        self.tail: deque[int] = deque(maxlen=params.bad_word_context)
        self.bad_words = BadWords(params.bad_words) if params.bad_words else None
        self._slot: dict[int, int] = {}  # token id -> its index in _ids / _counts
        self._ids = np.zeros(16, dtype=np.int64)
        self._counts = np.zeros(16, dtype=np.float32)
        for t in output_ids:
            self.add(t)

    @classmethod
    def of(
        cls, prompt_ids: Sequence[int], params: SamplingParams, output_ids: Sequence[int] = ()
    ) -> "TokenHistory | None":
        """A request's history, or None when its sampling reads none."""
        return cls(prompt_ids, params, output_ids) if params.needs_history else None

    def add(self, token: int) -> None:
        k = self._slot.setdefault(token, len(self._slot))
        if k == len(self._ids):
            self._ids, self._counts = np.resize(self._ids, 2 * k), np.resize(self._counts, 2 * k)
            self._counts[k:] = 0
        self._ids[k] = token
        self._counts[k] += 1
        self.n += 1
        self.tail.append(token)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The distinct generated ids and how often each came (int64, float32): views, valid until the next
        ``add``."""
        k = len(self._slot)
        return torch.from_numpy(self._ids[:k]), torch.from_numpy(self._counts[:k])


def check_token_ids(params: SamplingParams, vocab_size: int, prompt: Sequence[int] = ()) -> None:
    """Refuse token ids a request names that the model's logits do not have (the engines call it on admission).
    The prompt's too: on CUDA an embedding lookup past the table is a device-side assert, which ends the process
    for every request, not only this one."""
    if len(prompt) and (min(prompt) < 0 or max(prompt) >= vocab_size):
        raise RequestError(f"prompt: token ids must be in [0, {vocab_size})", field="prompt")
    for field, ids in (
        ("logit_bias", [t for t, _ in params.logit_bias]),
        ("stop_token_ids", params.stop_token_ids),
        ("allowed_token_ids", params.allowed_token_ids),
        ("bad_words", [t for w in params.bad_words for t in w]),
    ):
        if any(t >= vocab_size for t in ids):
            raise RequestError(
                f"{field}: token ids must be below the model's vocabulary size {vocab_size}", field=field
            )


def make_generator(params: SamplingParams, choice: int = 0) -> torch.Generator | None:
    """A per-choice generator, so a seeded request makes the same draws whatever it is batched with (choice
    ``i`` from ``seed + i``; the same tokens as far as the logits are the same: see ``sample``). On the host
    whatever the engine's device: a token costs one number from it, drawn without touching the device, and a seed
    gives the same tokens on every device (for the same logits). A resumed reply's seeded generator skips the draws
    its resumed tokens took (``SamplingParams.num_resumed_tokens``)."""
    if params.greedy:
        return None
    g = torch.Generator()
    if params.seed is None:
        g.seed()
        return g
    g.manual_seed(params.seed + choice)
    for _ in range(params.num_resumed_tokens):  # one at a time, as ``sample`` draws them
        torch.rand(1, generator=g)
    return g


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    masks: Sequence[torch.Tensor | None] | None = None,
    histories: Sequence[TokenHistory | None] | None = None,
    eos_ids: Sequence[int] = (),
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Pick one token per row of ``logits`` ``[B, vocab]`` (float32). Logprobs, when asked, are those of the model's
    distribution before adjustments, temperature, filtering and masks (as OpenAI-compatible servers report them).
    ``masks``: per row None, or the tokens it may take (structured output; never none): a ``[vocab]`` boolean tensor,
    or a bitmask ``int32[ceil(vocab / 32)]`` on the host (``dualpath.engines.guided``: bit ``t % 32`` of word ``t // 32``), which
    are unpacked here, all rows in one copy to the device and one operation; ``allowed_token_ids`` rows get theirs
    here. ``histories``: per row the request's ``TokenHistory``
    (needed where ``params.needs_history``); ``eos_ids``: the model's end tokens, which ``min_tokens`` holds back.

    The whole batch is one pass on the device and one copy of the answers to the host (a row at a time would be
    a dozen kernels and a wait per sampled row: on a GPU, longer than the decode step). A sampled row draws one
    uniform number from its own generator and takes the token where it falls in the row's filtered distribution
    (inverse CDF), so a seeded request samples the same tokens whatever it is batched with, for the same logits.
    The logits themselves move in the last float bits with the batch (a matmul's summation order depends on its
    row count, on CPU BLAS and GPU kernels alike): a draw that falls within that much of a step of the CDF, about
    one sampled token in a few thousand with the tiny test models, can then take the neighbouring token."""
    b, dev = logits.shape[0], logits.device
    raw = logits
    masks = _unpacked(masks, logits)
    logits = _masked(adjusted(logits, params, histories, eos_ids, masks), _restricted(masks, params, logits))
    tokens = logits.argmax(-1)
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if drawn:
        rows = torch.tensor(drawn).to(dev, non_blocking=True) if len(drawn) < b else None
        sub = logits if rows is None else logits.index_select(0, rows)
        knobs = torch.tensor(
            [
                [
                    params[i].temperature,
                    params[i].top_k,
                    params[i].top_p,
                    params[i].min_p,
                    float(torch.rand(1, generator=generators[i])),
                ]
                for i in drawn
            ],
            dtype=torch.float64,
        ).to(dev, non_blocking=True)  # one copy; float64 keeps the draw
        k_max = min(max([params[i].top_k for i in drawn] + [0]), logits.shape[-1])  # top_k <= 0: off
        top_p = knobs[:, 2].float() if any(params[i].top_p < 1.0 for i in drawn) else None
        min_p = knobs[:, 3].float() if any(params[i].min_p > 0.0 for i in drawn) else None
        probs = filtered_probs(sub / knobs[:, :1].float(), knobs[:, 1], top_p, k_max, min_p)
        picked = _draw(probs, knobs[:, 4].float())
        tokens = picked if rows is None else tokens.index_copy(0, rows, picked)
    asked = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not asked:
        return tokens.tolist(), [None] * b
    return _with_logprobs(raw, tokens, params, asked)


def adjusted(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory | None] | None,
    eos_ids: Sequence[int] = (),
    masks: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """``logits`` after each row's logit bias, ``min_tokens`` ban, bad words, repetition penalty, then frequency and
    presence penalties (``SamplingParams`` defines them); a new tensor where any row has one, else ``logits`` itself.
    Each is one indexed operation over every row's listed tokens, so the cost grows with the tokens named, not the
    vocabulary.
    A row with a mask (structured output) is banned from its end tokens only where its mask allows another token (a
    pattern that may end or read on): where only an end may follow, its grammar ends it. Nor is a row whose
    ``allowed_token_ids`` are all end tokens banned (it would have nothing left)."""
    add_, rep, pen, held = _Entries(), _Entries(), _Entries(), []
    for i, p in enumerate(params):
        h = histories[i] if histories is not None else None
        if p.needs_history and h is None:
            raise ValueError("penalties and min_tokens need the row's TokenHistory")
        if p.logit_bias:
            add_.add(i, torch.tensor([t for t, _ in p.logit_bias]), torch.tensor([b for _, b in p.logit_bias]))
        if p.min_tokens and h.n < p.min_tokens:
            banned = torch.tensor(
                sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))), dtype=torch.long
            )
            if masks is not None and masks[i] is not None:
                held.append((i, banned))
            elif not p.allowed_token_ids or set(p.allowed_token_ids) - set(banned.tolist()):
                add_.add(i, banned, float("-inf"))
        if p.bad_words and (ends := h.bad_words.banned(h.tail)):
            add_.add(i, torch.tensor(ends), float("-inf"))
        if p.penalized:
            ids, counts = h.tensors()
            if p.repetition_penalty != 1.0:
                rep.add(i, torch.cat([h.prompt, ids]), p.repetition_penalty)
            if p.frequency_penalty or p.presence_penalty:
                pen.add(i, ids, counts, p.frequency_penalty, p.presence_penalty)
    if not (add_ or rep or pen or held):
        return logits
    logits = logits.clone(memory_format=torch.contiguous_format)
    for i, banned in held:  # decided on the device (no wait): banned where the mask allows something else
        banned = banned.to(logits.device, non_blocking=True)
        others = masks[i].index_fill(0, banned, False).any()
        logits[i, banned] = torch.where(others, float("-inf"), logits[i, banned])
    flat, width = logits.view(-1), logits.shape[-1]  # flat indices: index_select / index_add_ beat 2-D indexing
    if add_:
        at, (v,) = add_.on(logits.device, width)
        flat.index_add_(0, at, v)
    if rep:  # a token may be listed twice (prompt and output): both copies carry the same value
        at, (f,) = rep.on(logits.device, width)
        old = flat.index_select(0, at)
        flat.index_copy_(0, at, torch.where(old > 0, old / f, old * f))
    if pen:  # the output's distinct tokens, each listed once: value = -(count * frequency + presence)
        at, (c, f, pr) = pen.on(logits.device, width)
        flat.index_add_(0, at, -(c * f + pr))
    return logits


class BadWords:
    """A request's bad words indexed for a step's check: the tokens banned outright (one-token words), and per
    prefix (a word less its last token) the tokens it bans next, so a step costs a lookup per distinct prefix length,
    not a comparison per word (128 words over 64 rows: 4.3 ms a step compared one by one)."""

    __slots__ = ("always", "after", "lengths")

    def __init__(self, words: tuple[tuple[int, ...], ...]):
        self.always = sorted({w[0] for w in words if len(w) == 1})
        self.after: dict[tuple[int, ...], list[int]] = {}
        for w in words:
            if len(w) > 1:
                self.after.setdefault(w[:-1], []).append(w[-1])
        self.lengths = sorted({len(p) for p in self.after})

    def banned(self, tail: Sequence[int]) -> list[int]:
        """The last tokens of the words whose other tokens the reply ends in (``tail``: its last tokens, as many as
        the longest word less one)."""
        out, tail = list(self.always), tuple(tail)
        for k in self.lengths:
            if k > len(tail):
                break
            out += self.after.get(tail[len(tail) - k :], ())
        return out


class _Entries:
    """Per-row token lists with one number per token or per row (each given as a tensor of the tokens' values or as
    one float), gathered on the host, expanded and moved to the device in one copy."""

    def __init__(self):
        self.rows: list[int] = []
        self.toks: list[torch.Tensor] = []
        self.values: list[tuple] = []

    def __bool__(self) -> bool:
        return bool(self.rows)

    def add(self, row: int, tokens: torch.Tensor, *values: float | torch.Tensor) -> None:
        self.rows.append(row)
        self.toks.append(tokens)
        self.values.append(values)

    def on(self, device: torch.device, width: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(row * width + token for each listed token, [each value column])."""
        lens = torch.tensor([len(t) for t in self.toks])
        cols = [
            torch.cat([v if torch.is_tensor(v) else torch.full((n,), v) for v, n in zip(col, lens.tolist())])
            if any(torch.is_tensor(v) for v in col)
            else torch.tensor(col, dtype=torch.float64).repeat_interleave(lens)
            for col in zip(*self.values)
        ]
        at = torch.tensor(self.rows).repeat_interleave(lens) * width + torch.cat(self.toks)
        n = len(at)
        flat = torch.cat([at.double()] + [c.double() for c in cols]).to(device, non_blocking=True)  # exact < 2**53
        return flat[:n].long(), [flat[(1 + j) * n : (2 + j) * n].float() for j in range(len(cols))]


def _restricted(
    masks: Sequence[torch.Tensor | None] | None, params: Sequence[SamplingParams], logits: torch.Tensor
) -> Sequence[torch.Tensor | None] | None:
    """``masks`` with each ``allowed_token_ids`` row's set as its mask (those rows have no other: SamplingParams
    refuses the pair), built in one copy for all of them."""
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
    if not rows:
        return masks
    entries = _Entries()
    for j, i in enumerate(rows):
        entries.add(j, torch.tensor(params[i].allowed_token_ids, dtype=torch.long))
    at, _ = entries.on(logits.device, logits.shape[-1])
    allowed = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool, device=logits.device)
    allowed.view(-1)[at] = True
    out = list(masks) if masks is not None else [None] * len(params)
    for j, i in enumerate(rows):
        out[i] = allowed[j]
    return out


def _unpacked(
    masks: Sequence[torch.Tensor | None] | None, logits: torch.Tensor
) -> Sequence[torch.Tensor | None] | None:
    """``masks`` with each bitmask row (``int32``) as a ``[vocab]`` boolean row on the logits' device: the bitmasks
    stacked on the host, moved in one copy and unpacked in one operation (bits past the logits dropped, logits past
    the bits not allowed)."""
    rows = [i for i, m in enumerate(masks or ()) if m is not None and m.dtype == torch.int32]
    if not rows:
        return masks
    packed = torch.stack([masks[i] for i in rows]).to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (packed.unsqueeze(-1) >> shifts).bitwise_and_(1).bool().view(len(rows), -1)
    width = logits.shape[-1]
    if bits.shape[1] < width:
        bits = torch.cat([bits, bits.new_zeros(len(rows), width - bits.shape[1])], 1)
    out = list(masks)
    for j, i in enumerate(rows):
        out[i] = bits[j, :width]
    return out


def _masked(logits: torch.Tensor, masks: Sequence[torch.Tensor | None] | None) -> torch.Tensor:
    """``logits`` with the tokens a row may not take at -inf (a new tensor; the rows without a mask unchanged)."""
    some = next((m for m in masks or () if m is not None), None)
    if some is None:
        return logits
    every = some.new_ones(()).expand_as(some)
    allowed = torch.stack([every if m is None else m for m in masks])
    return torch.where(allowed, logits, float("-inf"))


def filtered_probs(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None, k_max: int, min_p: torch.Tensor | None = None
) -> torch.Tensor:
    """Probabilities of rows of temperature-scaled logits with top-k, top-p then min-p applied: dropped tokens 0,
    the rest renormalized, in vocabulary order. Top-k (rows with ``top_k`` > 0; ``k_max``: the largest, 0 if none)
    keeps every token at least as likely as the k-th, ties included; top-p (``None``: no row uses it) then drops a
    token when the tokens strictly more likely already cover ``top_p`` of the top-k distribution; min-p (``None``:
    no row uses it) drops tokens less likely than ``min_p`` times the most likely one. A row's answer does not
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
    if min_p is not None:  # p < min_p * p_max  <=>  logit < max logit + log(min_p); log(0) = -inf keeps all
        floor = scaled.amax(-1, keepdim=True) + min_p[:, None].log()
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
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


def _with_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams], asked: list[int]
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Tokens and, for the ``asked`` rows, the chosen token's log-probability and the top alternatives: one copy
    to the host for all of it."""
    rows = torch.tensor(asked).to(logits.device, non_blocking=True)
    k = max(params[i].logprobs for i in asked)
    parts = _logprob_parts(logits.index_select(0, rows), tokens.index_select(0, rows), k, rank=False)
    flat = torch.cat([tokens.double()] + parts).tolist()  # token ids are exact in float64
    b = len(params)
    ids = [int(t) for t in flat[:b]]
    out: list[TokenLogprob | None] = [None] * b
    read = _read_logprobs(flat[b:], [ids[i] for i in asked], k, [params[i].logprobs for i in asked], rank=False)
    for i, lp in zip(asked, read):
        out[i] = lp
    return ids, out


def prompt_logprobs(
    logits_of, hidden: torch.Tensor, next_ids: Sequence[int], k: int, rows_per_pass: int = 256
) -> list[TokenLogprob]:
    """Each prompt position's log-probability of the token that follows it, its rank and the ``k`` most likely
    tokens, from the final hidden states ``[n, hidden]`` (``logits_of``: the model's ``compute_logits``). A few
    hundred rows at a time: a whole prompt's logits would be prompt length x vocabulary floats."""
    out: list[TokenLogprob] = []
    for r0 in range(0, len(next_ids), rows_per_pass):
        ids = list(next_ids[r0 : r0 + rows_per_pass])
        chosen = torch.tensor(ids, dtype=torch.long).to(hidden.device, non_blocking=True)
        parts = _logprob_parts(logits_of(hidden[r0 : r0 + len(ids)]), chosen, k, rank=True)
        out += _read_logprobs(torch.cat(parts).tolist(), ids, k, [k] * len(ids), rank=True)
    return out


def extend_prompt_logprobs(
    done: list[TokenLogprob], prompt_ids: Sequence[int], start: int, hidden: torch.Tensor, logits_of, k: int
) -> None:
    """Append to ``done`` (the logprobs of prompt tokens 1..len(done)) what one forward chunk adds: ``hidden`` holds
    the final hidden states of positions ``start``, ``start + 1``, ... (position p gives token p + 1's logprob).
    Positions already covered (a recompute after preemption) are skipped; a chunk past a gap (positions never
    computed here, e.g. KV loaded from storage) is an error, never a list with holes; a chunk past the prompt (a
    decode step) adds nothing."""
    p1 = min(start + len(hidden), len(prompt_ids) - 1)
    if start >= p1 or len(done) >= p1:
        return
    if start > len(done):
        raise RuntimeError(f"prompt logprobs from position {start}, but only {len(done)} computed before it")
    p0 = len(done)
    done += prompt_logprobs(logits_of, hidden[p0 - start : p1 - start], prompt_ids[p0 + 1 : p1 + 1], k)


def _logprob_parts(logits: torch.Tensor, chosen: torch.Tensor, k: int, rank: bool) -> list[torch.Tensor]:
    """float64 pieces for one copy to the host: each row's chosen log-probability, [its rank: 1 + the tokens
    strictly more likely], then the ``k`` top ids and log-probabilities (row-major)."""
    lp = logits.log_softmax(-1)
    at = lp.gather(1, chosen[:, None])
    parts = [at[:, 0]] + ([(lp > at).sum(-1) + 1] if rank else [])
    if k:
        top = lp.topk(k, dim=-1)
        parts += [top.indices.reshape(-1), top.values.reshape(-1)]
    return [x.double() for x in parts]


def _read_logprobs(flat: list[float], ids: list[int], k: int, ns: list[int], rank: bool) -> list[TokenLogprob]:
    """``TokenLogprob`` per row from ``_logprob_parts``' numbers; row j keeps its ``ns[j]`` top entries."""
    r = len(ids)
    tops = flat[r * (2 if rank else 1) :]
    return [
        TokenLogprob(
            ids[j],
            flat[j],
            tuple(
                (int(t), v) for t, v in zip(tops[j * k : j * k + ns[j]], tops[r * k + j * k : r * k + j * k + ns[j]])
            ),
            int(flat[r + j]) if rank else 0,
        )
        for j in range(r)
    ]
