"""A request's generation state inside one engine: tokens so far, sampling state and stop conditions."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from dualpath.core.sampling_params import SamplingParams
from dualpath.engines.guided import Guide
from dualpath.engines.sampler import TokenHistory, TokenLogprob
from dualpath.engines.spec import PromptLookup


def choice_id(request_id: str, index: int) -> str:
    """The seq_id of a request's choice ``index`` (choice 0 is the request itself)."""
    return f"{request_id}#{index}" if index else request_id


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end of sequence, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"


@dataclass
class Sequence:
    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    finish_reason: FinishReason | None = None
    stop_text: str | None = None  # the stop string that ended it, if any
    guide: Guide | None = None  # structured output: which tokens may come next
    history: TokenHistory | None = None  # what penalties and min_tokens read (built here when they are asked)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens 1.. (when asked)
    index: int = 0  # which of the request's choices (``params.n``) this is
    group: str = ""  # the request's id (its choice 0's seq_id)
    forks: list[Sequence] = field(default_factory=list)  # choices 1.. waiting for this one's prompt KV
    lookup: PromptLookup | None = None  # speculative decoding's view of the tokens (built on first use)

    def __post_init__(self):
        self.group = self.group or self.seq_id
        if self.history is None:
            self.history = TokenHistory.of(self.prompt_ids, self.params, self.output_ids)

    @classmethod
    def choices(cls, seq_id: str, tokens: list[int], params: SamplingParams, generators: list) -> "Sequence":
        """Choice 0 of a request whose token list is ``tokens``, carrying choices 1.. as ``forks``: an engine
        computes the tokens once, then forks them (``generators[i]``: choice i's). A resumed reply's own tokens
        (``SamplingParams.num_resumed_tokens``, at the list's end) start its output; their logprobs are None."""
        prompt_ids, resumed = params.split_resumed(tokens)
        first = cls(seq_id, prompt_ids, params, generators[0], list(resumed), [None] * len(resumed))
        first.forks = [
            cls(choice_id(seq_id, i), prompt_ids, params, generators[i], index=i, group=seq_id)
            for i in range(1, len(generators))
        ]
        return first

    def drafts(self, k: int, min_n: int, max_n: int) -> list[int]:
        """Up to ``k`` speculative tokens by prompt lookup over the sequence's tokens so far."""
        if self.lookup is None:
            self.lookup = PromptLookup(self.token_ids)
        elif self.lookup.n < self.num_tokens:
            self.lookup.extend(self.output_ids[self.lookup.n - len(self.prompt_ids) :])
        return self.lookup.propose(k, min_n, max_n)

    @property
    def resumed(self) -> list[int]:
        """The output tokens this engine was given, not generated (``SamplingParams.num_resumed_tokens``)."""
        return self.output_ids[: self.params.num_resumed_tokens]

    def mask(self) -> torch.Tensor | None:
        return self.guide.mask() if self.guide is not None else None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, logprob: TokenLogprob | None, eos_ids: tuple[int, ...], max_len: int) -> None:
        """Record a sampled token and decide whether it ends the sequence (token-level conditions only; a guided
        sequence ends as its JSON completes)."""
        if self.guide is not None:
            self.guide.advance(token)
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        if self.history is not None:
            self.history.add(token)
        p = self.params
        if (
            token in p.stop_token_ids
            or (not p.ignore_eos and token in eos_ids)
            or (self.guide is not None and self.guide.complete)
        ):
            self.finish_reason = FinishReason.STOP
        elif len(self.output_ids) >= p.max_tokens or self.num_tokens >= max_len:
            self.finish_reason = FinishReason.LENGTH
