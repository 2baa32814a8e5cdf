"""Structured output in the engines: at every step, only tokens that keep the output a prefix of what the request's
constraint accepts (``dualpath.core.structured``: JSON, a schema, a pattern or a grammar, and the text around it) may be
sampled. llguidance does the work: its matcher reads the tokens a request takes and computes, per step, the mask of
the tokens that may come next (tens of microseconds on a 49K-token vocabulary: nothing is cached per state).

A mask is a bitmask on the host: ``int32[words]``, bit ``t % 32`` of word ``t // 32`` set where token ``t`` may come
next (llguidance's layout); the sampler unpacks a batch's masks on the device in one operation. The model's end
tokens are allowed where the answer may end and more could follow (``\\d+``); where nothing can follow (an object's
closing brace, a choice spelled out) the matcher stops and the guide is ``complete``: the reply ends without one.

Who calls it: an engine asks its ``GuideSource`` for one ``Guide`` per constrained request, passes ``guide.mask()``
to the sampler and ``advance``s it with every token the request takes (``Sequence.append``).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from dualpath.core.errors import DualPathError
from dualpath.core.structured import Constraint, check, compile

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

    from dualpath.core.sampling_params import SamplingParams
    from dualpath.core.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class GuideError(DualPathError):
    """A token the guide does not allow was appended (a bug: the sampler only draws allowed tokens)."""


def llg_tokenizer(
    token_bytes: Sequence[bytes | None],
    width: int,
    end_ids: Sequence[int] = (),
    encode: Callable[[str], list[int]] | None = None,
    names: Callable[[int], str | None] | None = None,
) -> "LLTokenizer":
    """llguidance's view of a vocabulary: ``token_bytes`` (``Tokenizer.token_bytes``: None for a special token) over
    ``width`` ids (the model's logits, which may outnumber the tokenizer's ids: those past it are special tokens
    that are never allowed). ``end_ids``: the model's end tokens (the first special token if none: a vocabulary
    needs one). ``encode`` tokenizes text where llguidance asks (by default one token per byte); ``names``: a special
    token's name (``<|im_end|>``: what a Lark grammar may name it by; by default ``<|dualpath_ID|>``)."""
    from llguidance import LLTokenizer

    class Wrapper:  # llguidance's TokenizerWrapper protocol
        is_tokenizer_wrapper = True

        def __init__(self):
            self.tokens = [t if t is not None else _name(i) for i, t in enumerate(token_bytes[:width])]
            self.tokens += [_name(i) for i in range(len(self.tokens), width)]
            self.special_token_ids = [i for i in range(width) if i >= len(token_bytes) or token_bytes[i] is None]
            ends = [t for t in end_ids if 0 <= t < width] or self.special_token_ids[:1]
            if not ends:
                raise DualPathError("structured output needs an end token in the model's vocabulary")
            self.eos_token_id, self.bos_token_id, self.ends = ends[0], None, ends

        def __call__(self, text) -> list[int]:
            if isinstance(text, bytes):
                text = text.decode("utf-8", "replace")
            return encode(text) if encode is not None else list(text.encode())

    def _name(i: int) -> bytes:
        name = names(i) if names is not None and i < len(token_bytes) else None
        return (name or f"<|dualpath_{i}|>").encode()

    wrapper = Wrapper()
    return LLTokenizer(wrapper, eos_token=wrapper.ends)


class Recent:
    """The ``size`` most recently used values, each built on first use (thread-safe): an engine keeps its compiled
    constraints in one (agents send the same few schemas again and again)."""

    def __init__(self, size: int = 32):
        self.size = size
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key, build: Callable[[], object]):
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
                return found
        found = build()  # outside the lock: a slow compile holds no other request up
        with self._lock:
            self._items[key] = found
            if len(self._items) > self.size:
                self._items.popitem(last=False)
        return found


class Guide:
    """One request's place in its constraint: an llguidance matcher of its own, over a vocabulary of ``width`` ids
    whose end tokens are ``end_ids``."""

    def __init__(self, matcher: "LLMatcher", width: int, end_ids: Sequence[int]):
        self._matcher, self._words = matcher, (width + 31) // 32
        self._ends = frozenset(end_ids)
        words = [0] * self._words
        for t in self._ends:
            words[t // 32] |= 1 << (t % 32)
        self._end_mask = torch.tensor([w - (1 << 32) if w >> 31 else w for w in words], dtype=torch.int32)

    def mask(self) -> torch.Tensor:
        """Which tokens may come next: an ``int32[words]`` bitmask on the host (a new tensor). A matcher that failed
        (a grammar past llguidance's per-step limits) allows only the end tokens: the reply ends there."""
        out = torch.empty(self._words, dtype=torch.int32)
        self._matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * out.element_size())
        if self._matcher.is_error() or not out.any():
            log.warning(
                "structured output: the grammar failed mid-reply (%s); ending it",
                self._matcher.get_error()[:200] or "no token allowed",
            )
            return self._end_mask.clone()
        return out

    def advance(self, token: int) -> None:
        """Read the token the request took; a token the constraint does not allow raises GuideError."""
        if token in self._ends and self._matcher.is_stopped():
            return  # the end token a stopped (or failed) matcher's mask allowed
        if not self._matcher.consume_token(token):
            raise GuideError(f"token {token} cannot continue the structured output: {self._matcher.get_error()[:200]}")

    @property
    def complete(self) -> bool:
        """Whether nothing may follow (the answer closed, an end token was read, or the matcher failed)."""
        return self._matcher.is_stopped()


class GuideSource:
    """An engine's guides. llguidance's view of the vocabulary is built on the first constrained request (a
    tokenizer load and a pass over its tokens, ~0.4 s for 49K tokens), so engines that never see one pay nothing;
    an engine loop checks ``ready`` and has ``warm`` run on a helper thread first, so that pass never stalls the
    requests it is running. Compiled constraints are kept for the ``schemas`` most recent ones (each guide a copy of
    its constraint's matcher)."""

    def __init__(
        self, tokenizer: Callable[[], "Tokenizer"], width: int, end_ids: Sequence[int] = (), schemas: int = 32
    ):
        self._tokenizer, self._width, self._end_ids = tokenizer, width, tuple(end_ids)
        self._vocab: "LLTokenizer | None" = None
        self._error: Exception | None = None  # the vocabulary pass failed: every guide_for raises it
        self._compiled = Recent(schemas)
        self._lock = threading.Lock()

    def ready(self, params: "SamplingParams") -> bool:
        """Whether ``guide_for(params)`` needs no vocabulary pass first (it answers at once, or raises why the
        pass failed)."""
        return not params.structured or self._vocab is not None or self._error is not None

    def warm(self) -> None:
        """Build llguidance's view of the vocabulary (once; callers wait for a pass in progress). Raises what
        ``guide_for`` would; a failed pass is not tried again."""
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._vocab is None:
                try:
                    tok = self._tokenizer()
                    ends = self._end_ids or ((tok.eos_token_id,) if tok.eos_token_id is not None else ())
                    self._vocab = llg_tokenizer(
                        tok.token_bytes,
                        self._width,
                        ends,
                        lambda text: tok.encode(text, add_special_tokens=False),
                        tok.id_to_token,
                    )
                    self._end_ids = tuple(self._vocab.eos_tokens)  # the ones it chose, where none were given
                except Exception as e:
                    self._error = e
                    raise

    def guide_for(self, params: "SamplingParams", read: Sequence[int] = ()) -> Guide | None:
        """A guide for ``params``' structured output (None if it has none) that has read the tokens ``read`` (a
        resumed reply's own: ``Sequence.resumed``); a constraint that does not compile raises GrammarError, a token
        it refuses GuideError."""
        constraint = Constraint.of(params)
        if constraint is None:
            return None
        self.warm()
        template = self._compiled.get(constraint, lambda: self._compile(constraint))
        guide = Guide(template.deep_copy(), self._width, self._end_ids)
        for token in read:
            guide.advance(token)
        return guide

    def _compile(self, constraint: Constraint) -> "LLMatcher":
        """A matcher of a checked ``constraint``. The check runs here too, not only in the frontend: the offline
        ``LLM`` has none, and a grammar llguidance never comes back from would otherwise leave a thread here that
        spins and takes memory (~8 MB/s) for the life of the engine."""
        check(constraint)
        return compile(constraint, self._vocab)
