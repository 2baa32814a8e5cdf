"""A request's prompts as token ids (on the worker threads: ``dualpath.serving.bounded``): a completion's texts
tokenized or its token lists checked, a chat rendered by its template (the server's, or with
``--trust-request-chat-template`` the request's own) and tokenized. Every text is bounded before it is tokenized and
every rendering in time; what a request gets wrong is a ``RequestError`` naming its field (or an ``ApiError``)."""

from __future__ import annotations

from dualpath.core.errors import CheckpointError, RequestError
from dualpath.core.tokenizer import Tokenizer
from dualpath.serving.bounded import CHARS_PER_TOKEN, RenderTimeout, within
from dualpath.serving.choices import ApiError, Prompt
from dualpath.serving.protocol import ChatRequest, CompletionRequest, TokenizeRequest


class Prompts:
    def __init__(self, front):
        self.front = front  # read when used: its ``cfg`` may be replaced (tests do)

    @property
    def cfg(self):
        return self.front.cfg

    @property
    def tokenizer(self):
        return self.front.tokenizer

    def prompts(self, req, kind: str) -> list[Prompt]:
        """The request's prompts as token ids (a chat's one, rendered; a completion's one or batch)."""
        try:
            if kind == "chat":
                return [Prompt(self._truncated(req, self.chat_ids(req)), None)]
            out = []
            for p in req.prompts():
                ids = self._prompt_ids(req, p)
                kept = self._truncated(req, ids)  # echo repeats a text prompt as sent, unless it was cut
                out.append(Prompt(kept, p if isinstance(p, str) and len(kept) == len(ids) else None))
            return out
        except RequestError as e:
            raise ApiError(400, str(e), param=e.field) from None

    def _prompt_ids(self, req: CompletionRequest, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.encode(prompt, "prompt", req.add_special_tokens)
        return self.known_ids(prompt, "prompt")

    def encode(self, text: str, field: str, add_special_tokens: bool) -> list[int]:
        """``text``'s token ids, if it is no longer than a prompt of the model's context can be (a longer one is
        refused before it is tokenized)."""
        most = CHARS_PER_TOKEN * self.cfg.max_model_len
        if len(text) > most:
            raise RequestError(
                f"{field}: {len(text)} characters, more than the {most} a prompt of the model's "
                f"context of {self.cfg.max_model_len} tokens may have ({CHARS_PER_TOKEN} a token)",
                field=field,
            )
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _truncated(self, req, ids: list[int]) -> list[int]:
        keep = req.truncate_prompt_tokens
        return ids[-(self.cfg.max_model_len if keep == -1 else keep) :] if keep else ids

    def known_ids(self, ids, field: str) -> list[int]:
        """``ids`` as a list, each a token of the vocabulary (else a 400 naming ``field``)."""
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"{field}: token ids must be in [0, {vocab})", param=field)
        return list(ids)

    def chat_ids(self, req: ChatRequest | TokenizeRequest) -> list[int]:
        """The chat rendered (within ``render_timeout_s``) and tokenized (``encode``'s bound), as
        ``Tokenizer.apply_chat_template`` does: the template writes the special tokens."""
        own = getattr(req, "chat_template", None)
        renderer = self._renderer(own)
        variables = {
            **_effort(req, renderer),
            **req.render_options(),
            **_documents(req, renderer),
            **self._tools(req),
        }  # chat_template_kwargs may set reasoning_effort too (vLLM's way for some)
        field = "chat_template" if own is not None else "messages"
        try:
            text = within(
                self.cfg.render_timeout_s, renderer.render_chat, [m.for_template() for m in req.messages], **variables
            )
        except RenderTimeout:
            raise RequestError(
                f"{field}: the chat template's rendering ran past {self.cfg.render_timeout_s:g} s", field=field
            ) from None
        return self.encode(text, field, False)

    def _renderer(self, template: str | None) -> Tokenizer:
        """The tokenizer that renders a chat: the server's, or with a request's own template (vLLM's
        ``--trust-request-chat-template``: a template runs in a Jinja sandbox, but can still spend the server's CPU).
        The most recent templates stay compiled (``Frontend.kept``)."""
        if template is None:
            return self.tokenizer
        if not self.cfg.trust_request_chat_template:
            raise RequestError(
                "a request's own chat_template is rendered only with --trust-request-chat-template",
                field="chat_template",
            )
        try:
            return self.front.kept.get(("template", template), lambda: self.tokenizer.with_chat_template(template))
        except CheckpointError as e:
            raise RequestError(str(e), field="chat_template") from None

    def _tools(self, req: ChatRequest | TokenizeRequest) -> dict:
        """The chat template's ``tools`` argument: the request's tools when the model may call them."""
        if not req.calls_tools():
            return {}
        if self.front.tool_markup is None:
            raise ApiError(
                400,
                "this model's chat template does not render tools, so its answers cannot be parsed "
                "for tool calls; send no tools, or tool_choice 'none'",
                param="tools",
            )
        return {"tools": [t.model_dump(exclude_none=True) for t in req.tools]}


def _effort(req, renderer: Tokenizer) -> dict:
    """OpenAI's ``reasoning_effort`` as the template's variable of that name (gpt-oss's, say); refused, as OpenAI
    refuses it for models that do not reason, where the template never reads it."""
    effort = getattr(req, "reasoning_effort", None)
    if effort is None:
        return {}
    if "reasoning_effort" not in (renderer.chat_template or ""):
        raise RequestError("this model's chat template takes no reasoning_effort", field="reasoning_effort")
    return {"reasoning_effort": effort}


def _documents(req, renderer: Tokenizer) -> dict:
    """The template's ``documents`` variable (vLLM's, for RAG templates such as Command R's); refused where the
    template would drop them unread."""
    docs = getattr(req, "documents", None)
    if not docs:
        return {}
    if "documents" not in (renderer.chat_template or ""):
        raise RequestError(
            "this model's chat template does not read documents; put them in a message", field="documents"
        )
    return {"documents": docs}
