"""Text read through a structured-output constraint as the engines' matcher reads a reply (llguidance, over its
tokenizer of one token per byte): the tests' view of what a constraint accepts."""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from dualpath.core.sampling_params import SamplingParams
from dualpath.core.structured import Constraint, compile
from dualpath.engines.guided import Guide, llg_tokenizer
from dualpath.engines.sampler import _unpacked


@dataclass(frozen=True)
class Read:
    """Where a text left the constraint: ``may_end`` the reply may end here (the model's end token is allowed, or
    nothing can follow), ``complete`` nothing can follow."""

    may_end: bool
    complete: bool
    forced: bytes = b""  # the bytes that must come next (llguidance then offers their canonical tokens only)


@contextmanager
def time_limit(seconds: float):
    """``check``'s time limit set to ``seconds`` (fuzz tests: a grammar llguidance loops on costs that much)."""
    from dualpath.core import structured

    before, structured.COMPILE_SECONDS = structured.COMPILE_SECONDS, seconds
    try:
        yield
    finally:
        structured.COMPILE_SECONDS = before


def constraint(what) -> Constraint:
    """A Constraint as it is, or a SamplingParams' one."""
    return Constraint.of(what) if isinstance(what, SamplingParams) else what


def schema(
    s=None,
    prefix: str = "",
    suffix: str = "",
    thinking: str = "",
    trigger: bool = False,
    branches: tuple[str, ...] = (),
) -> Constraint:
    """A JSON answer's constraint (``s`` a schema; None: any object)."""
    return Constraint("json", None if s is None else json.dumps(s), prefix, suffix, thinking, trigger, branches)


def read(what, data: bytes | str) -> Read | None:
    """``data`` read whole from the start, or None where a byte of it is refused."""
    matcher = compile(constraint(what))
    for b in data.encode() if isinstance(data, str) else data:
        if not matcher.consume_token(b):
            return None
    return Read(matcher.is_accepting(), matcher.is_stopped())


def accepts(what, data: bytes | str) -> bool:
    """Whether ``data`` is a whole reply the constraint accepts."""
    r = read(what, data)
    return r is not None and r.may_end


def completes(what, data: bytes | str) -> bool:
    """Whether ``data`` is a whole reply after which nothing may follow (a JSON answer's close)."""
    r = read(what, data)
    return r is not None and r.complete


def along(what, data: bytes | str) -> list[Read]:
    """Where each prefix of ``data`` (from the empty one) left the constraint, as far as its bytes are read."""
    matcher = compile(constraint(what))
    out = [Read(matcher.is_accepting(), matcher.is_stopped())]
    for b in data.encode() if isinstance(data, str) else data:
        if not matcher.consume_token(b):
            break
        out.append(Read(matcher.is_accepting(), matcher.is_stopped()))
    return out


def walk(what, data: bytes | str) -> tuple[int, Read]:
    """How many bytes of ``data`` are read before one is refused (all of them: ``len(data)``), and where that
    left the constraint."""
    matcher = compile(constraint(what))
    data = data.encode() if isinstance(data, str) else data
    n = 0
    while n < len(data) and matcher.consume_token(data[n]):
        n += 1
    if matcher.is_error():  # a refused byte leaves llguidance's matcher failed: read the prefix again
        return n, read(what, data[:n])
    return n, Read(matcher.is_accepting(), matcher.is_stopped())


def masks_along(what, data: bytes, vocab) -> list[tuple[list[bool], Read]]:
    """At each byte boundary of ``data`` (read whole), which of ``vocab``'s tokens (bytes, or None for a special
    token) the constraint reads from there, checked a token at a time, and where the text so far left it."""
    matcher, out = compile(constraint(what)), []
    for i in range(len(data) + 1):
        row = []
        for t in vocab:
            n = matcher.try_consume_tokens(list(t)) if t else 0  # as far as it reads, then back
            matcher.rollback(n)
            row.append(bool(t) and n == len(t))
        out.append((row, Read(matcher.is_accepting(), matcher.is_stopped(), matcher.compute_ff_bytes())))
        if i < len(data):
            assert matcher.consume_token(data[i]), (data, i)
    return out


def fullmatches(what, texts) -> list[bool]:
    """Whether each of ``texts`` is a whole reply the constraint accepts (one matcher, read and rolled back)."""
    matcher, out = compile(constraint(what)), []
    for text in texts:
        data = list(text.encode() if isinstance(text, str) else text)
        n = matcher.try_consume_tokens(data)
        out.append(n == len(data) and matcher.is_accepting())
        matcher.rollback(n)
    return out


# --- the engines' guides over a toy vocabulary -----------------------------------------------------------------
def toy_guide(what, vocab: list, width: int, end_ids=()) -> Guide:
    """An engine's guide over a toy vocabulary (bytes per id; None: a special token)."""
    tok = llg_tokenizer(vocab, width, end_ids)
    return Guide(compile(constraint(what), tok), width, tok.eos_tokens)


def allowed(guide: Guide, width: int) -> torch.Tensor:
    """A guide's mask as the sampler sees it: ``[width]`` booleans."""
    return _unpacked([guide.mask()], torch.zeros(1, width))[0]


def check_masks_along(what, vocab: list, doc: bytes, width: int, end: int | None = None) -> int:
    """The engines' masks (a guide over ``vocab``, fed ``doc``'s tokens: one a byte) against reading every token
    from each state: equal at every state, the end token (``end``) allowed exactly where the reply may end; where
    the next bytes are forced (a property's name), the mask offers the tokens of their canonical tokenization
    (llguidance's choice: a model sees the tokens it was trained on), a part of what reads them. Returns how many
    states it checked."""
    guide = toy_guide(what, vocab, width, [end] if end is not None else ())
    if end is None:  # llg_tokenizer's end token: the first special one
        end = next(i for i in range(width) if i >= len(vocab) or vocab[i] is None)
    ids = {t: i for i, t in enumerate(vocab) if t is not None}
    states = masks_along(what, doc, vocab)
    for i, (row, r) in enumerate(states):
        want = torch.tensor(row + [False] * (width - len(vocab)))
        want[end] = r.may_end
        got = allowed(guide, width)
        if r.complete:  # nothing but an end may follow
            assert guide.complete and all(t >= len(vocab) or vocab[t] is None for t in got.nonzero().flatten().tolist())
        elif r.forced:
            assert got.any() and not (got & ~want).any(), doc[:i]
        else:
            assert torch.equal(got, want), (doc[:i], (got != want).nonzero().flatten().tolist())
        if i < len(doc):
            guide.advance(ids[doc[i : i + 1]])
    return len(states)
