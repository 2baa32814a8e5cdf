"""OpenAI's (and vLLM's and SGLang's) request bodies, validated with errors that name the field: the fields chat and
completions share, each one's own, and the bodies of the routes that are not generations. A chat's messages and tools:
``dualpath.serving.chat_messages``; structured output: ``dualpath.serving.structured_formats``; reading a body:
``dualpath.serving.json_bodies``."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dualpath.core.sampling_params import MAX_BAD_WORDS, MAX_CACHE_SALT, MAX_CHOICES, MAX_LOGIT_BIAS, MAX_STOP_CHARS

from dualpath.serving.chat_messages import ChatRendering, Message, Tool
from dualpath.serving.structured_formats import (
    STRUCTURED_KINDS,
    ResponseFormat,
    asks_for,
    choice_list,
    pattern_text,
    schema_object,
)

MAX_PROMPTS = 256  # completions' batch form: each prompt is submitted as a request of its own
MAX_HTTP_STOPS = 4  # OpenAI's


# vLLM's extras that are not implemented, and the values that ask for nothing (accepted)
NEUTRAL = {"use_beam_search": (False,), "length_penalty": (1.0,), "logits_processors": (None, [])}


class Extension(BaseModel):
    """The ``dualpath`` request field: opt-in usage details, a per-request read-path mode, and the agent session the
    request is a turn of (``{"id", "next_turn_in_s", "ttl_s"}``: ``dualpath.core.sessions``; checked there, so an
    error names the field)."""

    model_config = ConfigDict(extra="forbid")
    usage: bool = False
    mode: Optional[Literal["dualpath", "pe", "de", "basic", "split"]] = None
    session: Optional[Any] = None


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None  # token id (as text) -> bias in [-100, 100]
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)  # vLLM's extra (over prompt and output tokens)
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # vLLM's extra
    min_tokens: int = Field(0, ge=0)  # vLLM's extra: end tokens and stop strings wait this many tokens
    stop_token_ids: Optional[list[int]] = None  # vLLM's extra: token ids that end the reply
    ignore_eos: bool = False  # vLLM's extra: generate max_tokens whatever the model says
    # vLLM's other extras that change the answer: these are honoured...
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None  # words the reply may not contain (``SamplingParams.bad_words``)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N", not by their text
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = None  # keep the prompt's last k tokens (-1: the model's context)
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=20)  # each prompt token's logprob and top-k (no stream)
    cache_salt: Optional[str] = Field(None, max_length=MAX_CACHE_SALT)  # vLLM's: stored KV only this salt's share
    priority: int = Field(0, ge=-(2**31), lt=2**31)  # vLLM's: lower waits less (--scheduling-policy priority)
    # ...these refused unless neutral (never ignored); spaces_between_special_tokens is ignored as vLLM does for
    # fast tokenizers (the only kind loaded here)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    logits_processors: Optional[list[Any]] = None
    return_token_ids: bool = False  # vLLM's extra: the prompt's token ids and each choice's (RL trainers train on them)
    dualpath: Optional[Extension] = None
    response_format: Optional[ResponseFormat] = None
    # vLLM's structured-output extras: JSON, regex, choice and (GBNF) grammars
    guided_json: Optional[Union[dict[str, Any], str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    structured_outputs: Optional[dict[str, Any]] = None

    @field_validator("n")
    @classmethod
    def _choices(cls, v):
        if not 1 <= v <= MAX_CHOICES:
            raise ValueError(f"n must be from 1 to {MAX_CHOICES}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_HTTP_STOPS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(
                f"stop takes up to {MAX_HTTP_STOPS} non-empty strings of up to {MAX_STOP_CHARS} characters"
            )
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if not v:
            return None
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes up to {MAX_LOGIT_BIAS} tokens")
        try:
            bias = {int(k): b for k, b in v.items()}
        except ValueError:
            raise ValueError("logit_bias keys must be token ids (integers as text)") from None
        if len(bias) != len(v) or any(t < 0 for t in bias):
            raise ValueError("logit_bias keys must be distinct token ids (>= 0)")
        if any(not -100.0 <= b <= 100.0 for b in bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        return v

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), b) for k, b in (self.logit_bias or {}).items())

    @field_validator("suffix", "functions", "function_call", check_fields=False)
    @classmethod
    def _unsupported(cls, v, info):
        """Fields that would change the answer, refused when set rather than ignored."""
        if v:
            hint = "; send tools and tool_choice" if info.field_name.startswith("function") else ""
            raise ValueError(f"{info.field_name} is not supported{hint}")
        return v

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, v):
        if v and (len(v) > MAX_BAD_WORDS // 2 or any(not w.strip() for w in v)):
            raise ValueError(f"bad_words takes up to {MAX_BAD_WORDS // 2} non-blank strings")
        return v

    @field_validator("use_beam_search", "length_penalty", "logits_processors", check_fields=False)
    @classmethod
    def _not_implemented(cls, v, info):
        if v not in NEUTRAL[info.field_name]:
            raise ValueError(f"{info.field_name} is not supported (only {NEUTRAL[info.field_name][0]!r})")
        return v

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, v):
        if v is not None and not v:
            raise ValueError("cache_salt must be a non-empty string if given")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keep(cls, v):
        if v is not None and not (v == -1 or v >= 1):
            raise ValueError("truncate_prompt_tokens is -1 (the model's context) or a count >= 1")
        return v

    @field_validator("guided_json")
    @classmethod
    def _schema_object(cls, v):
        return None if v is None else schema_object(v, "guided_json")

    @field_validator("guided_regex", "guided_grammar")
    @classmethod
    def _regex_text(cls, v, info):
        return pattern_text(v, info.field_name)

    @field_validator("guided_choice")
    @classmethod
    def _choice_list(cls, v):
        return choice_list(v, "guided_choice")

    @field_validator("structured_outputs")
    @classmethod
    def _known_kinds(cls, v):
        other = sorted(k for k, x in (v or {}).items() if asks_for(x) and k not in STRUCTURED_KINDS)
        if other:
            raise ValueError(
                f"structured_outputs {', '.join(other)} is not supported; {', '.join(STRUCTURED_KINDS)} are"
            )
        v = dict(v or {})
        if v.get("json_object") is not None and not isinstance(v["json_object"], bool):
            raise ValueError("structured_outputs json_object must be a boolean")
        if v.get("json") is not None:
            v["json"] = schema_object(v["json"], "structured_outputs json")
        v["regex"] = pattern_text(v.get("regex"), "structured_outputs regex")
        v["grammar"] = pattern_text(v.get("grammar"), "structured_outputs grammar")
        v["choice"] = choice_list(v.get("choice"), "structured_outputs choice")
        if sum(asks_for(v.get(k)) for k in STRUCTURED_KINDS) > 1:
            raise ValueError(f"structured_outputs takes one of {', '.join(STRUCTURED_KINDS)}")
        return v

    @model_validator(mode="after")
    def _whole(self):
        """vLLM's prompt_logprobs come with the whole reply, not streamed (completions' echo streams)."""
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs need stream false")
        return self

    @model_validator(mode="after")
    def _one_format(self):
        if len(self._formats()) > 1:
            raise ValueError(
                "give one of response_format, guided_json, guided_regex, guided_choice, "
                "guided_grammar and structured_outputs"
            )
        return self

    def _formats(self) -> list[tuple[str, str, Any]]:
        """Every structured-output ask in the body: (field, kind, what constrains it): "json_object" (None),
        "json_schema" (the schema), "regex" (the pattern), "choice" (the list of strings) or "grammar" (GBNF or
        Lark)."""
        out, fmt, so = [], self.response_format, self.structured_outputs or {}
        if fmt is not None and fmt.type == "structural_tag":
            out.append(
                ("response_format", fmt.type, ([s.model_dump(by_alias=True) for s in fmt.structures], fmt.triggers))
            )
        elif fmt is not None and fmt.type != "text":
            schema = (fmt.json_schema.schema_ or {"type": "object"}) if fmt.json_schema else None
            out.append(("response_format", fmt.type, schema))
        if self.guided_json is not None:
            out.append(("guided_json", "json_schema", self.guided_json))
        if self.guided_regex is not None:
            out.append(("guided_regex", "regex", self.guided_regex))
        if self.guided_choice is not None:
            out.append(("guided_choice", "choice", self.guided_choice))
        if self.guided_grammar is not None:
            out.append(("guided_grammar", "grammar", self.guided_grammar))
        if so.get("json") is not None:
            out.append(("structured_outputs", "json_schema", so["json"]))
        elif so.get("json_object"):
            out.append(("structured_outputs", "json_object", None))
        for kind in ("regex", "choice", "grammar"):
            if so.get(kind) is not None:
                out.append(("structured_outputs", kind, so[kind]))
        return out

    def sampling_fields(self) -> dict[str, Any]:
        """The ``SamplingParams`` fields this body sets as they are (token ids, lengths and JSON output are checked
        by the frontend against the tokenizer and the context)."""
        return dict(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop_list(),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_p=self.min_p,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            prompt_logprobs=self.asked_prompt_lps(),
            n=self.samples(),
            cache_salt=self.cache_salt or "",
            priority=self.priority,
        )

    def samples(self) -> int:
        """Choices sampled per prompt."""
        return self.n

    def asked_prompt_lps(self) -> Optional[int]:
        """How many alternatives the prompt's logprobs carry (None: not asked)."""
        return self.prompt_logprobs

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def structured(self) -> Optional[tuple[str, str, Any]]:
        """(the field that asked, its kind, what constrains it: see ``_formats``), or None (free text)."""
        return next(iter(self._formats()), None)


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")  # OpenAI's values


class ChatRequest(_Common, ChatRendering):
    messages: list[Message] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    functions: Optional[list[Any]] = None  # the deprecated form of tools
    function_call: Optional[Any] = None
    modalities: Optional[list[str]] = None
    echo: Literal[False] = False  # vLLM's chat extras, refused when set: the last message echoed, and special ...
    add_special_tokens: Literal[False] = False  # ... tokens added to the rendered chat
    documents: Optional[list[dict[str, Any]]] = None  # a RAG template's documents (its ``documents`` variable)
    reasoning_effort: Optional[Literal[REASONING_EFFORTS]] = None  # OpenAI's: the template's ``reasoning_effort``
    chat_template: Optional[str] = None  # a template of the request's own (--trust-request-chat-template)

    @field_validator("modalities")
    @classmethod
    def _text_out(cls, v):
        if v and set(v) != {"text"}:
            raise ValueError("only text output is supported")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, v, info):
        tools = info.data.get("tools")
        if v is not None and not tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(v, dict):
            name = (v.get("function") or {}).get("name") if v.get("type") == "function" else None
            if name not in {t.function.name for t in tools}:
                raise ValueError(
                    "a named tool_choice is {'type': 'function', 'function': {'name': ...}} with the "
                    "name of one of the request's tools"
                )
        return v

    def max_new(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens

    def calls_tools(self) -> bool:
        """Whether the model is offered the tools (``tool_choice`` "none" withholds them)."""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_names(self) -> frozenset[str]:
        return frozenset(t.function.name for t in self.tools or ())

    def forced_functions(self) -> list[dict]:
        """The functions one of which the reply must call (``tool_choice`` "required" or named), else []."""
        if self.tool_choice == "required":
            chosen = self.tools
        elif isinstance(self.tool_choice, dict):
            chosen = [t for t in self.tools if t.function.name == self.tool_choice["function"]["name"]]
        else:
            return []
        return [t.function.model_dump(exclude_none=True) for t in chosen]


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int = Field(16, ge=1)
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False  # the prompt before the completion (and, with logprobs, its tokens' logprobs)
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    add_special_tokens: bool = True  # vLLM's extra: the tokenizer's BOS etc. around a text prompt (honoured)

    def asked_prompt_lps(self) -> Optional[int]:
        """The prompt's logprobs: vLLM's prompt_logprobs, or echo's (as many alternatives as logprobs)."""
        echoed = self.logprobs if self.echo and self.logprobs is not None else None
        return max((k for k in (self.prompt_logprobs, echoed) if k is not None), default=None)

    @field_validator("best_of")
    @classmethod
    def _candidates(cls, v, info):
        if v is None:
            return v
        n = info.data.get("n", 1)
        if not n <= v <= MAX_CHOICES:
            raise ValueError(f"best_of must be from n ({n}) to {MAX_CHOICES}")
        if v > n and info.data.get("stream"):
            raise ValueError("best_of > n needs stream false (the best are chosen once every candidate is done)")
        return v

    def samples(self) -> int:
        """Choices sampled per prompt: ``best_of`` candidates, of which the ``n`` best are returned."""
        return self.best_of or self.n

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        batch = _prompt_batch(v)
        if len(batch) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        if any(not p for p in batch):
            raise ValueError("the prompt is empty")
        return v

    def prompts(self) -> list[Union[str, list[int]]]:
        """The request's prompts (OpenAI's batch form: a list of texts or of token lists; else one)."""
        return _prompt_batch(self.prompt)


def _prompt_batch(v) -> list:
    """A completions prompt as a list of prompts: a list of texts or of token lists is a batch, anything else one."""
    return list(v) if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]


class TokenizeRequest(ChatRendering):
    """``/tokenize`` (vLLM's): the ids of a prompt, or of a chat as the completions endpoint would render it."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[Message]] = None
    tools: Optional[list[Tool]] = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self

    def calls_tools(self) -> bool:
        return bool(self.tools)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    tokens: list[int]


class UpdateWeightsRequest(BaseModel):
    """``/update_weights_from_disk`` (SGLang's): new weights for the served model from a checkpoint directory that
    every engine's node can read."""

    model_config = ConfigDict(extra="forbid")
    model_path: str = Field(min_length=1)
    weight_version: Optional[str] = None
    abort_all_requests: bool = False
    timeout: float = Field(default=600.0, gt=0, le=86400)


class LoadLoraRequest(BaseModel):
    """``/v1/load_lora_adapter`` (vLLM's; SGLang's ``/load_lora_adapter`` takes the same): serve the PEFT adapter at
    ``lora_path``, which every engine's node can read, as the model ``lora_name``."""

    model_config = ConfigDict(extra="ignore")  # vLLM's load_inplace and SGLang's pinned: nothing to do here
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1)


class AbortRequest(BaseModel):
    """``/abort_request`` (SGLang's): end the requests sent with ``rid`` (``/generate``'s), or every one."""

    model_config = ConfigDict(extra="forbid")
    rid: str = ""
    abort_all: bool = False


class PauseGenerationRequest(BaseModel):
    """``/pause_generation`` (SGLang's). Only ``abort`` is taken: its ``retract`` and ``in_place`` keep requests on
    the engines frozen, which these engines cannot (a 400 says so)."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["abort", "retract", "in_place"] = "abort"
