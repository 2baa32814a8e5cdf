"""A request's sampling for one of its prompts, as the ``SamplingParams`` the cluster runs (on the worker threads):
the context's room, the model's defaults for what the request leaves out, token ids checked against the vocabulary,
and structured output (JSON, schemas, patterns, grammars, forced and strict tool calls) compiled here, so that what
the engines could not run is the request's 400, never a failed generation. The ``SamplingParams`` built here is the
one that travels, as it is, to the client and the scheduler."""

from __future__ import annotations

import json

from dualpath.core import structured
from dualpath.core.errors import CheckpointError, RequestError
from dualpath.core.sampling_params import SamplingParams
from dualpath.core.structured import choice_pattern
from dualpath.serving.choices import ApiError, Prompt
from dualpath.serving.protocol import ChatRequest
from dualpath.serving.tool_json import structural_shape


class Samplings:
    def __init__(self, front):
        self.front = front  # read when used: its ``cfg`` may be replaced (tests do)

    def sampling(self, req, kind: str, prompt: Prompt) -> SamplingParams:
        max_tokens = self._max_tokens(req, kind, len(prompt.ids))
        fields = req.sampling_fields()
        defaults = self.front.defaults
        fields.update({k: v for k, v in defaults.items() if k in fields and k not in req.model_fields_set})
        known = self.front.prompts.known_ids
        try:
            self._needs_no_text(req, fields)
            return SamplingParams(
                max_tokens=max_tokens,
                logprobs=_logprobs(req, kind),
                **fields,
                stop_token_ids=known(req.stop_token_ids or (), "stop_token_ids"),
                logit_bias=self._known_bias(req.bias_pairs()),
                allowed_token_ids=known(req.allowed_token_ids or (), "allowed_token_ids"),
                bad_words=self._bad_word_ids(req.bad_words or ()),
                adapter=self.front.models.adapter_id(req.model),
                **self._structured(req, kind, self.front.splits.thinking(kind, prompt)),
            )
        except RequestError as e:
            raise ApiError(400, str(e), param=e.field) from None

    def _max_tokens(self, req, kind: str, n_prompt: int) -> int:
        """What the request asks for, if the context has room for it; else the room, up to the default."""
        cfg = self.front.cfg
        room = cfg.max_model_len - n_prompt
        if room < 1:
            raise ApiError(
                400,
                f"the prompt has {n_prompt} tokens; the model's context is {cfg.max_model_len}",
                param="messages" if kind == "chat" else "prompt",
                code="context_length_exceeded",
            )
        wanted = req.max_new() if kind == "chat" else req.max_tokens
        if wanted is not None and wanted > room:
            raise ApiError(
                400,
                f"prompt ({n_prompt} tokens) plus max_tokens ({wanted}) exceeds the model's context "
                f"of {cfg.max_model_len}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return wanted or min(room, self.front.defaults.get("max_tokens", cfg.default_max_tokens))

    def _needs_no_text(self, req, fields: dict) -> None:
        """Without a tokenizer (``--skip-tokenizer-init``) what needs text is refused (a RequestError), never
        silently ignored: stop strings, bad words, structured output."""
        tok = self.front.tokenizer
        if not tok.takes_text:
            tok.check_sampling(fields.get("stop"), req.structured() is not None)
            if req.bad_words:
                tok.refuse("bad_words", "bad_words")

    def _bad_word_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's reading of ``bad_words``: each word's tokens both as text begins with it and after a space (the two
        often differ: byte-level BPE folds the space into the word's first token)."""
        encode = self.front.tokenizer.encode
        return tuple(
            ids
            for w in words
            for text in (w.lstrip(), " " + w.lstrip())
            if (ids := tuple(encode(text, add_special_tokens=False)))
        )

    def _known_bias(self, pairs: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
        self.front.prompts.known_ids([t for t, _ in pairs], "logit_bias")
        return pairs

    def _structured(self, req, kind: str, thinking: str) -> dict:
        """The sampling fields of a JSON-mode, schema, regex, choice or grammar request, checked here (so an
        unsupported schema, pattern or checkpoint is a 400, not a failed generation): the engines need a tokenizer
        whose tokens' bytes are known. A reasoning model thinks first (``thinking``), constrained only after."""
        asked = req.structured()
        if asked is None:
            call = (self._forced_call(req) or self._strict_calls(req)) if kind == "chat" else {}
            return {**call, "json_thinking": thinking} if call else {}
        field, mode, what = asked
        if kind == "chat" and req.calls_tools() and mode != "structural_tag":  # a structural tag may hold the calls
            raise ApiError(
                400,
                f"{field} ({mode}) with tools is not supported: a tool call's markup is not what "
                "it constrains; send one or the other (or tool_choice 'none')",
                param=field,
            )
        try:
            self.front.tokenizer.token_bytes
            return {**self._constraint(mode, what), "json_thinking": thinking}
        except (CheckpointError, RequestError) as e:
            raise ApiError(400, str(e), param=field) from None

    def _constraint(self, mode: str, what) -> dict:
        """The sampling fields of one structured-output ask (``ChatRequest.structured``'s mode and what), once it
        compiles."""
        if mode == "json_object":
            return {"json_object": True}
        if mode in ("regex", "choice"):
            pattern = what if mode == "regex" else choice_pattern(what)
            self._compiles("regex", pattern)
            return {"regex": pattern}
        if mode == "grammar":
            self._compiles("grammar", what)
            return {"grammar": what}
        if mode == "structural_tag":
            shape = structural_shape(*what)
            self._compiles("schema", shape.schema)
            return shape.sampling(trigger=True)
        self._compiles("schema", what)
        return {"json_schema": json.dumps(what)}

    def _compiles(self, kind: str, what) -> None:
        """Compile what the engines will compile (its errors are the request's: a 400, not a failed generation).
        Agents send the same few schemas and patterns again and again: what compiled lately is not compiled again."""
        constraint = (
            structured.Constraint("json", json.dumps(what)) if kind == "schema" else structured.Constraint(kind, what)
        )

        def compiles() -> bool:  # kept as known to compile, not the compiled grammar (the engines compile their own)
            structured.check(constraint)
            return True

        self.front.kept.get((kind, what if kind != "schema" else json.dumps(what, sort_keys=True)), compiles)

    def _forced_call(self, req: ChatRequest) -> dict:
        """Sampling fields that make the reply one call to a tool (``tool_choice`` "required" or named): the
        template's call markup around a JSON object whose schema is the function's name and parameters."""
        functions = req.forced_functions()
        markup = self.front.tool_markup
        if not functions or markup is None:  # no markup: ``Prompts`` refuses the request (nothing to write calls in)
            return {}
        try:
            shape = markup.forced(functions)
        except RequestError as e:
            raise ApiError(400, str(e), param=e.field) from None
        named = "required" if req.tool_choice == "required" else "named"
        self._schema_compiles(shape.schema, f"tool_choice {named}")
        return shape.sampling()

    def _strict_calls(self, req: ChatRequest) -> dict:
        """Sampling fields that hold the calls a reply makes under ``tool_choice`` "auto" to the tools' schemas
        where a tool is ``strict`` (OpenAI's strict function calling): the text stays free, each call it begins is
        constrained (a tool that is not strict takes any object). Where the markup cannot recognise a call as it
        begins (Llama 3's, DeepSeek's) nothing is constrained: the calls are parsed as ever."""
        markup = self.front.tool_markup
        if not req.calls_tools() or req.forced_functions() or markup is None:
            return {}
        functions = [t.function.model_dump(exclude_none=True) for t in req.tools]
        if not any(f.get("strict") for f in functions):
            return {}
        shape = markup.triggered([f if f.get("strict") else {**f, "parameters": {"type": "object"}} for f in functions])
        if shape is None:
            return {}
        self._schema_compiles(shape.schema, "strict tools")
        return shape.sampling(trigger=True)

    def _schema_compiles(self, schema: dict, what: str) -> None:
        """A tool call's schema compiles (else a 400 on ``tools`` naming ``what`` asked for it)."""
        try:
            self.front.tokenizer.token_bytes
            self._compiles("schema", schema)
        except (CheckpointError, RequestError) as e:
            raise ApiError(400, f"{what}: {e}", param="tools") from None


def _logprobs(req, kind: str) -> int | None:
    """How many alternatives each sampled token's logprob carries (None: no logprobs)."""
    if kind == "chat":
        return (req.top_logprobs or 0) if req.logprobs else None
    # best_of ranks its candidates by their tokens' logprobs
    return req.logprobs if req.logprobs is not None or req.samples() == req.n else 0
