"""Tokenizer of a checkpoint: ``tokenizer.json`` through the ``tokenizers`` library, chat templates through a
sandboxed Jinja environment (as Hugging Face renders them), and incremental detokenization for streaming.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from dualpath.core.errors import CheckpointError, RequestError


def _token_str(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


MAX_TEMPLATE_PRODUCT = 1 << 20  # items (characters, list entries) one ``*`` in a chat template may make
MAX_TEMPLATE_POWER_DIGITS = 1000  # digits one ``**`` in a chat template may make


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's sandbox with ``*`` and ``**`` bounded: ``{{ 'x' * 10**10 }}`` is one 10 GB allocation, and a render
    on a worker thread cannot be interrupted by its time limit (a request's own template may be rendered, with
    ``--trust-request-chat-template``)."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator, left, right):
        if operator == "*" and _product_size(left, right) > MAX_TEMPLATE_PRODUCT:
            raise SecurityError(f"a chat template's * would make more than {MAX_TEMPLATE_PRODUCT} items")
        if operator == "**" and _power_digits(left, right) > MAX_TEMPLATE_POWER_DIGITS:
            raise SecurityError(f"a chat template's ** would make more than {MAX_TEMPLATE_POWER_DIGITS} digits")
        return super().call_binop(context, operator, left, right)


def _product_size(left, right) -> int:
    """How many items ``left * right`` makes when it repeats a sequence (0 for numbers)."""
    for seq, n in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
            return len(seq) * max(n, 0)
    return 0


def _power_digits(base, exp) -> float:
    if not isinstance(base, (int, float)) or not isinstance(exp, (int, float)) or abs(base) <= 1:
        return 0
    return float(exp) * math.log10(abs(base))


class Tokenizer:
    """Encode, decode and render chat prompts exactly as the checkpoint's Hugging Face tokenizer would."""

    takes_text = True  # (``TokenIdsOnly``, its stand-in without a tokenizer, takes token ids alone)

    def __init__(self, model_dir: str | Path):
        path = Path(model_dir)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise CheckpointError(
                f"{path}: no tokenizer.json (to serve token ids alone: skip_tokenizer_init=True, --skip-tokenizer-init)"
            )
        self._tok = HFTokenizer.from_file(str(tok_file))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.chat_template = self._find_template(path, cfg)

    @staticmethod
    def _find_template(path: Path, cfg: dict) -> str | None:
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text()
        tpl = cfg.get("chat_template")
        if isinstance(tpl, list):  # named templates: take the default one
            tpl = next((t["template"] for t in tpl if t.get("name") == "default"), tpl[0]["template"] if tpl else None)
        return tpl

    def with_chat_template(self, template: str) -> "Tokenizer":
        """This tokenizer rendering chats with ``template`` instead of the checkpoint's (``--chat-template``); a
        template that does not parse raises CheckpointError."""
        other = copy.copy(self)
        other.chat_template = template
        other.__dict__.pop("_template", None)
        try:
            other._template
        except jinja2.exceptions.TemplateError as e:
            raise CheckpointError(f"chat template: {e}") from None
        return other

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def eos_token_id(self) -> int | None:
        return self._tok.token_to_id(self.eos_token) if self.eos_token else None

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # (encode_batch lets go of Python's lock while it works: a long text on a worker thread stalls no other)
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @cached_property
    def token_bytes(self) -> tuple[bytes | None, ...]:
        """The bytes each token id adds to the output (None: a special token, which adds no text), for masks over
        the vocabulary (structured output). Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2) and SentencePiece with
        byte fallback (Llama 2, Mistral) are understood; other tokenizers raise CheckpointError."""
        kind = _decoder_kind(json.loads(self._tok.to_str()).get("decoder"))
        if kind is None:
            raise CheckpointError(
                "structured output needs a byte-level BPE or SentencePiece (byte fallback) "
                "tokenizer; this checkpoint's tokenizer is neither"
            )
        added = self._tok.get_added_tokens_decoder()
        out: list[bytes | None] = []
        for i in range(self.vocab_size):
            tok = added.get(i)
            if tok is not None:
                out.append(None if tok.special else tok.content.encode())
                continue
            piece = self._tok.id_to_token(i)
            out.append(None if piece is None else _piece_bytes(piece, kind))
        return tuple(out)

    @cached_property
    def _template(self) -> jinja2.Template:
        env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    def render_chat(
        self, messages: Sequence[dict], add_generation_prompt: bool = True, continue_final: bool = False, **kwargs
    ) -> str:
        """The chat as the template renders it. ``continue_final``: cut right after the last message's content, so
        the model continues it (Hugging Face's ``continue_final_message``); ``kwargs``: more template variables."""
        if not self.chat_template:
            raise RequestError("this model has no chat template; use the completions API", field="messages")
        if "developer" not in self.chat_template:  # OpenAI's newer name for the system role, unknown to the template
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        try:
            text = self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
            # a template is code run over the request's messages: whatever it trips on is the request's error
            raise RequestError(f"chat template rejected the messages: {e}", field="messages") from None
        return _open_final(text, messages) if continue_final else text

    def apply_chat_template(
        self, messages: Sequence[dict], add_generation_prompt: bool = True, continue_final: bool = False, **kwargs
    ) -> list[int]:
        """Token ids of the rendered chat; the template supplies special tokens itself."""
        return self.encode(
            self.render_chat(messages, add_generation_prompt, continue_final, **kwargs), add_special_tokens=False
        )


SKIPPED = "the tokenizer is not loaded (skip_tokenizer_init, --skip-tokenizer-init)"


class TokenIdsOnly:
    """The tokenizer's stand-in where it is not loaded (vLLM's ``skip_tokenizer_init``: RL trainers and benchmarks
    send token ids): prompts are token ids and replies are token ids with empty text. Whatever needs text (a text
    prompt, a chat, stop strings, bad words, structured output) raises an error that names the flag; nothing is
    silently ignored. ``vocab_size`` is the model's (token ids are checked against it)."""

    takes_text = False
    chat_template = bos_token = eos_token = eos_token_id = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    @classmethod
    def for_checkpoint(cls, model_dir: str | Path) -> "TokenIdsOnly":
        """From the checkpoint's ``config.json`` (its ``vocab_size``), which every checkpoint has."""
        cfg_file = Path(model_dir) / "config.json"
        try:
            cfg = json.loads(cfg_file.read_text())
            return cls(int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{cfg_file}: no vocab_size to check token ids against ({e})") from None

    @staticmethod
    def refusal(what: str) -> str:
        """Why a request that needs text (``what``: it, in words) is refused."""
        return f"{what} cannot be served: {SKIPPED}, so prompts must be token ids and replies come as token ids"

    def refuse(self, what: str, field: str | None = None):
        raise RequestError(self.refusal(what), field=field)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.refuse("a text prompt", "prompt")

    def render_chat(self, messages: Sequence[dict], *args, **kwargs) -> str:
        self.refuse("a chat (its template renders text)", "messages")

    def apply_chat_template(self, messages: Sequence[dict], *args, **kwargs) -> list[int]:
        self.refuse("a chat (its template renders text)", "messages")

    def check_sampling(self, stop, structured: bool) -> None:
        """Refuse what a request asks that needs text: stop strings (matched in the reply's text) and structured
        output (masks over the tokens' bytes)."""
        if stop:
            self.refuse("stop strings", "stop")
        if structured:
            self.refuse("structured output", "response_format")

    def with_chat_template(self, template: str) -> "TokenIdsOnly":
        raise CheckpointError(f"a chat template cannot be used: {SKIPPED}")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""  # (vLLM's outputs without a tokenizer: the token ids, empty text)

    def id_to_token(self, token_id: int) -> str | None:
        return None

    def token_to_id(self, token: str) -> int | None:
        return None

    @property
    def token_bytes(self):
        raise CheckpointError(f"structured output cannot be served: {SKIPPED}")


def load_tokenizer(model_dir: str | Path, skip_tokenizer_init: bool = False) -> Tokenizer | TokenIdsOnly:
    """The checkpoint's tokenizer, or with ``skip_tokenizer_init`` its token-ids-only stand-in (no tokenizer files
    are read: a checkpoint without them serves token ids)."""
    return TokenIdsOnly.for_checkpoint(model_dir) if skip_tokenizer_init else Tokenizer(model_dir)


TEMPLATES_DIR = Path(__file__).parents[1] / "templates"  # the chat templates shipped with the package (package data)


def shipped_templates() -> dict[str, Path]:
    """The shipped chat templates by name (a file's stem: ``tool_hermes`` for ``templates/tool_hermes.jinja``)."""
    return {f.stem: f for f in sorted(TEMPLATES_DIR.glob("*.jinja"))}


def load_chat_template(spec: str) -> str:
    """``--chat-template``'s value: the text of the file it names (vLLM's rule), else of the shipped template of that
    name (``shipped_templates``: a file of the same name wins), else the template itself, which must then look like
    one (Jinja's ``{{`` or ``{%``)."""
    try:
        named = Path(spec).is_file()
    except OSError:  # a template too long to be a path
        named = False
    shipped = shipped_templates().get(spec) if not named else None
    if named or shipped is not None:
        try:
            return (shipped or Path(spec)).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"--chat-template: cannot read {spec}: {e}") from None
    if "{{" in spec or "{%" in spec:
        return spec
    raise CheckpointError(
        f"--chat-template: {spec!r} is neither a file nor a Jinja template, nor the name of a "
        f"shipped one ({', '.join(shipped_templates())})"
    )


def _decoder_kind(decoder: dict | None) -> str | None:
    """The tokenizer's kind: "byte_level", "sentencepiece" (U+2581 for spaces, ``<0xNN>`` byte tokens) or None."""
    if not decoder:
        return None
    parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    types = {d.get("type") for d in parts}
    if "ByteLevel" in types:
        return "byte_level"
    if types & {"ByteFallback", "Metaspace"}:
        return "sentencepiece"
    return None


@functools.lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-ins for the 256 byte values, inverted (character -> byte)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _piece_bytes(piece: str, kind: str) -> bytes | None:
    if kind == "byte_level":
        alphabet = _byte_level_alphabet()
        return bytes(alphabet[c] for c in piece) if all(c in alphabet for c in piece) else None
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode()


def _open_final(text: str, messages: Sequence[dict]) -> str:
    """``text`` cut after the last occurrence of the final message's content (what follows closes the message)."""
    final = str(messages[-1].get("content") or "").strip() if messages else ""
    at = text.rfind(final) if final else -1
    if at < 0:
        raise RequestError(
            "continue_final_message needs a final message with text the template renders", field="messages"
        )
    return text[: at + len(final)]


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding from the start each time.

    A delta is held back while it ends in an incomplete UTF-8 sequence (decoded as U+FFFD), so multi-byte
    characters split across tokens are never emitted broken. ``skip_special_tokens`` False writes special tokens'
    text too.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_tail: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_tail[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end is emitted as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int:
    """Index in ``text`` where the earliest stop string begins, searching from ``start``; -1 if none."""
    hits = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else -1


def stop_cut(text: str, stops: Sequence[str], at: int, include: bool) -> int:
    """Where a reply whose earliest stop string begins at ``at`` ends: there, or after that stop string when it is
    kept (``include_stop_str_in_output``; the longest of the stops that begin there)."""
    return at + max(len(s) for s in stops if text.startswith(s, at)) if include else at
