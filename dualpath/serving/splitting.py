"""How a chat reply splits as it is answered: a reasoning model's thinking from its answer
(``dualpath.serving.reasoning``), and the answer's text from its tool calls (``dualpath.serving.tools``). A
completion's text never splits. The same splitters serve a whole reply and a streamed one."""

from __future__ import annotations

from dualpath.serving.choices import Prompt
from dualpath.serving.reasoning import ReasoningSplitter, prompt_opens_thinking
from dualpath.serving.tools import ToolCallSplitter


class Splitting:
    def __init__(self, front):
        self.front = front

    def thinking(self, kind: str, prompt: Prompt) -> str:
        """How a reasoning model's chat reply starts: "open" inside the think block its prompt opened, "optional"
        with a block it may open itself; "" for other models' replies (``SamplingParams.json_thinking``)."""
        if kind != "chat" or not self.front.reasons:
            return ""
        tail = self.front.tokenizer.decode(prompt.ids[-16:], skip_special_tokens=False)  # the generation prompt
        return "open" if prompt_opens_thinking(tail) else "optional"

    def reasoner(self, kind: str, prompt: Prompt) -> ReasoningSplitter | None:
        """The splitter of a reasoning model's chat reply into thinking and answer (None for other models). A
        constrained reply (JSON output, a forced call) is constrained only after the thinking, so it splits too."""
        thinking = self.thinking(kind, prompt)
        return ReasoningSplitter(thinking == "open") if thinking else None

    def splitter(self, req, kind: str) -> ToolCallSplitter | None:
        """The tool-call parser of a chat request that offers tools (None otherwise)."""
        if kind != "chat" or not req.calls_tools():
            return None
        params = {t.function.name: t.function.parameters or {} for t in req.tools}
        return ToolCallSplitter(self.front.tool_markup.for_tools(params), req.tool_names(), req.parallel_tool_calls)
