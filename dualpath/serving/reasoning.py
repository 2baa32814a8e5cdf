"""A reasoning model's thinking, split from its answer (vLLM's ``--reasoning-parser``; DeepSeek's API field
``reasoning_content``).

Reasoning models (DeepSeek-R1 and V3.1's thinking mode, Qwen3, QwQ) write their thinking between ``<think>`` and
``</think>`` before the answer. Their chat templates differ in who writes ``<think>``: R1's and V3.1's generation
prompt ends with it (the reply starts inside the thinking and only ``</think>`` appears), Qwen3's model writes it
itself, and a template's non-thinking mode closes an empty block in the prompt. So the reply starts in thinking when
the rendered prompt ends inside an open ``<think>`` block, or when the reply itself begins with ``<think>``; the
thinking ends at the first ``</think>``. Tool calls and the answer are parsed from what follows only: a call the
model merely considered while thinking is not made. Structured output (JSON, forced calls) is constrained only
after the thinking (``SamplingParams.json_thinking``), so its replies split the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.core.structured import THINK_CLOSE as CLOSE
from dualpath.core.structured import THINK_OPEN as OPEN
from dualpath.serving.tool_json import partial_tag


def knows_thinking(chat_template: str | None) -> bool:
    """Whether a chat template is a reasoning model's (it writes think blocks)."""
    return bool(chat_template) and OPEN in chat_template and CLOSE in chat_template


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside an open ``<think>`` block (the generation prompt opened it)."""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


@dataclass
class ReasoningSplitter:
    """Fed a reply's text as it streams, returns (reasoning, answer) deltas that can be shown at once; text that may
    be the start of ``<think>``/``</think>`` waits for the next delta (or ``finish``)."""

    thinking: bool  # the reply starts inside a think block (the prompt opened it)
    _text: str = ""
    _done: int = 0  # characters of _text already returned
    _decided: bool = False  # whether the reply's start (a <think> of its own, or not) is known
    _after_close: bool = False  # </think> was read and the answer's first visible character not yet returned
    _fed: int = 0  # deltas fed (a generation feeds one per token)
    _fed_at_close: int = -1  # deltas fed when </think> was read
    _thought: bool = False  # whether the reply was ever thinking

    def feed(self, delta: str) -> tuple[str, str]:
        self._text += delta
        self._fed += 1
        return self._split(final=False)

    @property
    def tokens(self) -> int:
        """Deltas fed before the answer began (the thinking's tokens and its closing tag's): usage's
        ``reasoning_tokens``."""
        if not self._thought:
            return 0
        return self._fed_at_close if self._fed_at_close >= 0 else self._fed

    def finish(self) -> tuple[str, str]:
        return self._split(final=True)

    def _split(self, final: bool) -> tuple[str, str]:
        reasoning = ""
        if not self._decided:
            head = self._text.lstrip()
            if not final and OPEN.startswith(head):
                return "", ""  # the reply may yet open a block of its own
            self._decided = True
            if head.startswith(OPEN):
                self.thinking, self._done = True, len(self._text) - len(head) + len(OPEN)
        if self.thinking:
            self._thought = True
            end = self._text.find(CLOSE, self._done)
            if end < 0:
                keep = len(self._text) if final else len(self._text) - partial_tag(self._text, CLOSE)
                reasoning, self._done = self._text[self._done : max(keep, self._done)], max(keep, self._done)
                return reasoning, ""
            reasoning, self._done, self.thinking = self._text[self._done : end], end + len(CLOSE), False
            self._after_close, self._fed_at_close = True, self._fed
        answer, self._done = self._text[self._done :], len(self._text)
        if self._after_close:  # the blank lines after </think> are not the answer's
            answer = answer.lstrip()
            self._after_close = not answer
        return reasoning, answer
