"""A chat as requests send it: its messages (text parts, an assistant turn's tool calls, a tool's answer), the tools
it offers, and how it is rendered into a prompt (vLLM's rendering options)."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dualpath.serving.tools import template_arguments


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON, as the model wrote it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant turn's calls
    tool_call_id: Optional[str] = None  # a tool turn: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v):
        for part in v if isinstance(v, list) else ():
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported (text only)")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (Hugging Face's convention): text content, and a call's
        arguments as an object."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            out["name"] = self.name
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": template_arguments(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        return out


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class ChatRendering(BaseModel):
    """How a chat is rendered into a prompt (vLLM's extras): ``continue_final_message`` leaves the last message open
    for the model to continue (an assistant reply's start, say), which implies no generation prompt;
    ``chat_template_kwargs`` are extra variables for the template (e.g. Qwen3's ``enable_thinking``)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_reserved(cls, v):
        taken = sorted(
            set(v or ())
            & {"messages", "tools", "documents", "add_generation_prompt", "continue_final", "bos_token", "eos_token"}
        )
        if taken:
            raise ValueError(f"{', '.join(taken)} cannot be set here")
        return v

    @model_validator(mode="after")
    def _open_or_prompted(self):
        if (
            self.continue_final_message
            and self.add_generation_prompt
            and "add_generation_prompt" in self.model_fields_set
        ):
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self

    def render_options(self) -> dict[str, Any]:
        """``Tokenizer.apply_chat_template``'s keyword arguments for this chat."""
        return {
            "add_generation_prompt": self.add_generation_prompt and not self.continue_final_message,
            "continue_final": self.continue_final_message,
            **(self.chat_template_kwargs or {}),
        }
