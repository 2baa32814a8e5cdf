"""Per-request sampling parameters: plain, frozen, validated data that crosses process boundaries."""

from __future__ import annotations

import json
import math
import numbers
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path

from dualpath.core.errors import CheckpointError, RequestError
from dualpath.core.messages import changed_fields

MAX_LOGIT_BIAS = 1024  # entries per request: each is an index write on every step
MAX_CHOICES = 16  # n: every choice is a row of the decode batch
MAX_BAD_WORDS = 128  # token sequences per request (a step looks up the reply's tail once per distinct length)
MAX_BAD_WORD_TOKENS = 32
MAX_CACHE_SALT = 1024  # characters: the salt travels with the request to every engine
MAX_STOPS = 16  # stop strings per request: each is searched for in the reply's text as every token comes
MAX_STOP_CHARS = 256  # characters per stop string: a streamed reply holds back as much text (HTTP takes 4 of them)
ADAPTER_ID = re.compile(r"[0-9a-f]{64}")  # a LoRA adapter's identity (dualpath.core.lora.adapter_digest)
THINKING_MODES = ("", "optional", "open")  # json_thinking: none, the reply may open a block, the prompt opened one
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # vLLM's, + max_new_tokens


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token and when to stop.

    temperature 0 means greedy. top_k 0 or -1 and top_p 1.0 disable those filters. A seed makes sampling
    reproducible per request, whatever else runs in the same batch. ``ignore_eos`` forces exactly
    ``max_tokens`` tokens (used by rollout replays). ``logprobs`` asks for the chosen token's log-probability
    and that many top alternatives. ``json_object`` constrains the output to one JSON object (OpenAI's JSON mode),
    ``json_schema`` (a schema as JSON text) to one valid against that schema (llguidance's JSON Schema coverage:
    ``dualpath.core.structured``): it ends as the object closes, or at ``max_tokens`` unfinished. ``regex`` constrains it
    to text that matches the pattern in full (Rust ``regex`` syntax, ASCII classes): it ends when nothing more can
    match, or with the model's end token where the match may end or read on; ``grammar`` (GBNF or Lark) to a
    sentence of that grammar, ending likewise. ``json_prefix`` / ``json_suffix``:
    fixed text the constrained output starts / ends with around the object (a forced tool call's markup);
    ``json_trigger``: the output is free text instead, in which each ``json_prefix`` begins an object (then
    ``json_suffix``, then free text again): strict tool calls the model may or may not make. ``json_branches``:
    texts, one per alternative of the schema's top-level ``anyOf``, each written before an object of its
    alternative (a function's name before its arguments).
    ``json_thinking`` lets a reasoning model think before that output (unconstrained, up to ``</think>``): "open"
    when the prompt opened the ``<think>`` block, "optional" when the reply may open one itself; "" constrains from
    the first token.

    Logit adjustments, in the order they apply (vLLM's): ``logit_bias`` ((token id, bias in [-100, 100]) pairs)
    is added; before ``min_tokens`` tokens, EOS (unless ``ignore_eos``) and ``stop_token_ids`` cannot be sampled and
    stop strings do not end the reply (a structured reply's end tokens are held back only where its grammar allows
    another token, as under ``\\d+``; where only an end may follow, it ends);
    ``repetition_penalty`` divides the positive logits (multiplies the negative ones) of every token in the prompt
    or the output so far; ``frequency_penalty`` × the token's count in the output plus ``presence_penalty`` if it
    occurs there is subtracted (OpenAI's definition). Greedy decoding sees them too. After temperature, top-k and
    top-p (transformers' order), ``min_p`` drops tokens less likely than ``min_p`` × the most likely one.
    ``allowed_token_ids`` (empty: all) restricts every sampled token to that set, like a mask (not with JSON
    output; ``min_tokens`` then holds back only end tokens the set does not consist of). ``bad_words``: token
    sequences the reply may not contain: a sequence's last token cannot be sampled where the reply ends in the rest
    of it (a one-token sequence is never sampled; vLLM's rule, over the reply's tokens, not the prompt's; not with
    JSON output or ``allowed_token_ids``, whose tokens it could all ban).

    ``n`` choices are sampled from one prompt (parallel sampling): its KV is loaded or computed once, the choices
    share its full blocks and each samples with its own generator (a seeded request's choice i with ``seed + i``,
    so choice 0 is what the same request with ``n`` = 1 gives).

    ``prompt_logprobs`` asks for each prompt token's log-probability given the tokens before it, its rank and that
    many top alternatives: the whole prompt is computed (no cached KV is used for it).

    Text: ``skip_special_tokens`` leaves special tokens out of the text (their ids stay in the output);
    ``include_stop_str_in_output`` keeps the stop string that ended the reply at the end of its text.

    ``cache_salt`` (vLLM's): the request's stored KV is its salt's alone. Its block hashes chain from the salted
    fingerprint (``dualpath.core.geometry.chain_root``), so it hits only blocks stored by requests with the same salt,
    and they only its: tenants who cannot learn each other's salts cannot tell each other's prompts by their hits.
    The reply is the same with any salt. "" (the default): the store every unsalted request shares.

    ``adapter``: the identity of the LoRA adapter the request runs under (``dualpath.core.lora``: a frontend or ``LLM``
    turns an adapter's name into it); "" the base model. Engines without that adapter refuse the request, and its
    stored KV chains from the identity, so it is that adapter's alone.

    ``priority`` (vLLM's): where the request waits in the scheduler's queues, lower first, when the scheduler runs
    ``--scheduling-policy priority`` (otherwise one that is not 0 is refused). It orders who is handed to engines
    next, and one that finds no decode engine with room has less urgent generating replies handed back to make it
    (they go on later from where they were: ``dualpath.client``).

    ``num_resumed_tokens``: the prompt's last that many tokens are this reply's own, generated before, and the
    request continues it (a reply moved off a decode engine that died: ``dualpath.client``). They count toward
    ``max_tokens`` and ``min_tokens``, penalties and stop strings read them as reply, a structured reply's grammar
    has read them, and a seeded generator stands where their draws left it (one per sampled token), so the
    continuation is what the reply would have gone on to be. One choice, no prompt logprobs; a reply already
    ended is the caller's to know (engines only ever add to it).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    json_object: bool = False
    json_schema: str | None = None
    json_prefix: str = ""
    json_suffix: str = ""
    json_thinking: str = ""
    json_trigger: bool = False
    json_branches: tuple[str, ...] = ()
    regex: str | None = None
    grammar: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    n: int = 1
    num_resumed_tokens: int = 0
    cache_salt: str = ""
    priority: int = 0
    adapter: str = ""

    def __post_init__(self):
        _check_scalar_types(self)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", _token_ids(self.stop_token_ids, "stop_token_ids"))
        if not 1 <= self.n <= MAX_CHOICES:
            raise RequestError(f"n must be from 1 to {MAX_CHOICES}, got {self.n}", field="n")
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}", field="max_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            raise RequestError(f"temperature must be in [0, 100], got {self.temperature}", field="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}", field="top_p")
        if self.top_k < -1:
            raise RequestError(f"top_k must be -1, 0 or positive, got {self.top_k}", field="top_k")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= 20:
                raise RequestError(f"{name} must be in [0, 20], got {getattr(self, name)}", field=name)
        if (
            self.json_object + (self.json_schema is not None) + (self.regex is not None) + (self.grammar is not None)
            > 1
        ):
            raise RequestError(
                "json_object, json_schema, regex and grammar exclude each other", field="response_format"
            )
        if (self.json_prefix or self.json_suffix) and not self.structured:
            raise RequestError(
                "json_prefix and json_suffix need json_object, json_schema, regex or grammar", field="response_format"
            )
        if self.json_thinking not in THINKING_MODES or (self.json_thinking and not self.structured):
            raise RequestError(
                f"json_thinking is one of {THINKING_MODES} and needs json_object, json_schema, regex or grammar",
                field="response_format",
            )
        if self.json_trigger and not (self.json_prefix and (self.json_object or self.json_schema is not None)):
            raise RequestError("json_trigger needs json_prefix and json_object or json_schema", field="tools")
        if self.json_branches and self.json_schema is None:
            raise RequestError("json_branches need json_schema", field="tools")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop strings must be non-empty strings", field="stop")
        if len(self.stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise RequestError(
                f"stop takes up to {MAX_STOPS} strings of up to {MAX_STOP_CHARS} characters", field="stop"
            )
        if not 0 <= self.num_resumed_tokens < self.max_tokens:
            raise RequestError(
                f"num_resumed_tokens must be in [0, max_tokens), got {self.num_resumed_tokens}",
                field="num_resumed_tokens",
            )
        if not -(2**31) <= self.priority < 2**31:
            raise RequestError(f"priority must be a 32-bit integer, got {self.priority!r}", field="priority")
        if len(self.cache_salt) > MAX_CACHE_SALT:
            raise RequestError(
                f"cache_salt must be a string of at most {MAX_CACHE_SALT} characters", field="cache_salt"
            )
        if self.adapter and not ADAPTER_ID.fullmatch(self.adapter):
            raise RequestError(
                f"adapter must be a LoRA adapter's identity (64 hex digits), got {self.adapter!r}", field="model"
            )
        if self.num_resumed_tokens and (self.n > 1 or self.prompt_logprobs is not None):
            raise RequestError("a resumed reply is one choice without prompt logprobs", field="num_resumed_tokens")
        self._check_adjustments()

    def _check_adjustments(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise RequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}", field=name)
        if not (0.0 < self.repetition_penalty and math.isfinite(self.repetition_penalty)):
            raise RequestError(
                f"repetition_penalty must be positive, got {self.repetition_penalty}", field="repetition_penalty"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}", field="min_p")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}", field="min_tokens")
        pairs = dict(self.logit_bias).items()
        if not all(_is_number(t, numbers.Integral) and _is_number(b, numbers.Real) for t, b in pairs):
            raise RequestError("logit_bias maps integer token ids to numeric biases", field="logit_bias")
        bias = tuple(sorted((int(t), float(b)) for t, b in pairs))
        if len(bias) != len(self.logit_bias) or len(bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias takes up to {MAX_LOGIT_BIAS} distinct token ids", field="logit_bias")
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in bias):
            raise RequestError("logit_bias maps token ids (>= 0) to biases in [-100, 100]", field="logit_bias")
        object.__setattr__(self, "logit_bias", bias)
        allowed = _token_ids(self.allowed_token_ids, "allowed_token_ids")
        if len(set(allowed)) != len(allowed) or any(t < 0 for t in allowed):
            raise RequestError("allowed_token_ids must be distinct token ids (>= 0)", field="allowed_token_ids")
        if allowed and self.structured:
            raise RequestError("allowed_token_ids and JSON output exclude each other", field="allowed_token_ids")
        object.__setattr__(self, "allowed_token_ids", allowed)
        self._check_bad_words()

    def _check_bad_words(self) -> None:
        words = tuple(dict.fromkeys(_token_ids(w, "bad_words") for w in self.bad_words))
        if len(words) > MAX_BAD_WORDS or any(not 1 <= len(w) <= MAX_BAD_WORD_TOKENS for w in words):
            raise RequestError(
                f"bad_words takes up to {MAX_BAD_WORDS} words of 1 to {MAX_BAD_WORD_TOKENS} tokens", field="bad_words"
            )
        if any(t < 0 for w in words for t in w):
            raise RequestError("bad_words' token ids must be >= 0", field="bad_words")
        if words and (self.structured or self.allowed_token_ids):
            raise RequestError(
                "bad_words excludes JSON output and allowed_token_ids (it could ban all they allow)", field="bad_words"
            )
        object.__setattr__(self, "bad_words", words)

    @property
    def structured(self) -> bool:
        """Whether the output is constrained (JSON mode, a schema, a pattern or a grammar)."""
        return self.json_object or self.json_schema is not None or self.regex is not None or self.grammar is not None

    @property
    def penalized(self) -> bool:
        """Whether a repetition, frequency or presence penalty applies."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the request's earlier tokens or keeps state of its own (penalties, min_tokens, bad
        words: their index lives in the history)."""
        return self.penalized or bool(self.min_tokens) or bool(self.bad_words)

    @property
    def bad_word_context(self) -> int:
        """How many of the reply's last tokens the bad words are matched against."""
        return max((len(w) - 1 for w in self.bad_words), default=0)

    @property
    def max_new_tokens(self) -> int:
        """The most tokens still to generate (``max_tokens`` less those resumed)."""
        return self.max_tokens - self.num_resumed_tokens

    def split_resumed(self, tokens: list[int]) -> tuple[list[int], list[int]]:
        """``tokens`` (a request's whole token list) as (the prompt, the reply resumed)."""
        cut = len(tokens) - self.num_resumed_tokens
        return tokens[:cut], tokens[cut:]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        """JSON-ready, naming the fields that differ from their defaults (``from_dict`` fills the rest in): a
        request's wire form is as long as what its client set, and ``ParamsCache`` keys on few fields."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in changed_fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()})


class ParamsCache:
    """``SamplingParams.from_dict`` for a scheduler that decodes thousands of requests a second, most of them sent
    with one of a few parameter sets: each set is built and checked once (they are frozen, so one object serves
    every request naming it). A set with an unhashable value (``logit_bias``, a stop list of lists) is built each
    time; the cache is dropped whole at ``capacity`` sets, so callers with ever-new seeds cost one dict each."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._sets: dict[tuple, SamplingParams] = {}

    def get(self, d: dict) -> SamplingParams:
        # typed: True == 1 == 1.0 as dict keys, and max_tokens=True must be refused, not served as 1
        key = tuple((k, type(v), tuple(map(_typed, v)) if type(v) is list else v) for k, v in d.items())
        try:
            params = self._sets.get(key)
        except TypeError:  # an unhashable value
            return SamplingParams.from_dict(d)
        if params is None:
            params = SamplingParams.from_dict(d)
            if len(self._sets) >= self.capacity:
                self._sets.clear()
            self._sets[key] = params
        return params


def _typed(v) -> tuple:
    return type(v), v


def _is_number(v, kind: type) -> bool:
    """Whether ``v`` is a ``kind`` number (``numbers.Integral`` or ``numbers.Real``: numpy's count too) and no bool,
    which Python counts as an int: ``max_tokens=True`` is a caller's mistake, never 1."""
    return isinstance(v, kind) and not isinstance(v, bool)


def _token_ids(values, name: str) -> tuple[int, ...]:
    """Token ids as plain ints; a bool, a float or a string is none (``int()`` would read ``True`` as 1)."""
    if not all(_is_number(t, numbers.Integral) for t in values):
        raise RequestError(f"{name} must be integer token ids", field=name)
    return tuple(int(t) for t in values)


# Each scalar annotation: the values it takes and their kind in words. A bool is no number (Python counts it an int)
_KINDS = {
    int: (numbers.Integral, "an integer"),
    float: (numbers.Real, "a number"),
    bool: (bool, "a boolean"),
    str: (str, "a string"),
}


def _scalar_fields() -> dict[str, tuple[type, bool]]:
    """Each scalar field of ``SamplingParams``: (its type, whether None is allowed)."""
    out = {}
    for name, hint in typing.get_type_hints(SamplingParams).items():
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        base = next(a for a in args if a is not type(None))
        if base in _KINDS:
            out[name] = (base, type(None) in args)
    return out


SCALAR_FIELDS = _scalar_fields()


def _check_scalar_types(p: SamplingParams) -> None:
    """Refuse a scalar field holding another type (before any range check compares it), naming the field; keep
    each as its plain Python type (numpy's numbers become Python's, which serialize)."""
    for name, (base, optional) in SCALAR_FIELDS.items():
        v = getattr(p, name)
        if optional and v is None:
            continue
        accepted, kind = _KINDS[base]
        if isinstance(v, bool) != (base is bool) or not isinstance(v, accepted):
            raise RequestError(f"{name} must be {kind}{' or None' if optional else ''}, got {v!r}", field=name)
        object.__setattr__(p, name, base(v))


GREEDY = SamplingParams(temperature=0.0)


def model_defaults(where: str, model_dir: str | Path) -> dict:
    """The sampling a checkpoint's ``generation_config.json`` recommends (vLLM's ``--generation-config``): its
    temperature, top_p, top_k, min_p and repetition_penalty, and max_new_tokens as ``max_tokens``, for the fields a
    request leaves out. ``where``: "auto" (the model's directory; none there is no defaults), "vllm" (none: the
    server's own defaults), or a directory holding one."""
    if where == "vllm":
        return {}
    path = Path(model_dir if where == "auto" else where) / "generation_config.json"
    if not path.is_file():
        if where != "auto":
            raise CheckpointError(f"{path}: no generation_config.json there (--generation-config)")
        return {}
    try:
        data = json.loads(path.read_text())
        out = {k: data[k] for k in GENERATION_DEFAULTS if data.get(k) is not None}
        if data.get("max_new_tokens"):
            out["max_tokens"] = int(data["max_new_tokens"])
        fields = SamplingParams.__dataclass_fields__
        SamplingParams(**{k: v for k, v in out.items() if k in fields})  # values it would refuse: refused now
    except (ValueError, TypeError, AttributeError, RequestError) as e:
        raise CheckpointError(f"{path}: unusable sampling defaults ({e})") from None
    return out
