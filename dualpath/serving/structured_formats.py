"""Structured output as requests ask for it: OpenAI's ``response_format`` (``json_object``, ``json_schema``) and
vLLM's ``structural_tag``, and the checks every structured-output field's value passes (a schema, a pattern, a list
of choices) before the frontend compiles it (``dualpath.serving.sampling``)."""

from __future__ import annotations

import json
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class StructuralTag(BaseModel):
    model_config = ConfigDict(extra="ignore")
    begin: str
    schema_: dict[str, Any] = Field(alias="schema")
    end: str


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``json_object`` constrains the reply to one JSON object (JSON mode),
    ``json_schema`` to one valid against ``json_schema.schema`` (structured outputs, compiled by llguidance:
    ``dualpath.core.structured``; what it cannot enforce is a 400). Enforced whatever ``strict`` says. vLLM's
    ``structural_tag``: free text in which a ``trigger`` begins one of the ``structures`` (its ``begin`` text, an
    object of its ``schema``, its ``end``), then free text again."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: Optional[JsonSchemaFormat] = None
    structures: Optional[list[StructuralTag]] = None
    triggers: Optional[list[str]] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object (name, schema)")
        if self.type == "structural_tag" and not (self.structures and self.triggers):
            raise ValueError("type 'structural_tag' needs structures and triggers")
        return self


def schema_object(v, field: str) -> dict:
    """A JSON schema given as an object or as its JSON text (vLLM takes both)."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            raise ValueError(f"{field} must be a JSON schema (an object, or its JSON text)") from None
    if not isinstance(v, dict):
        raise ValueError(f"{field} must be a JSON schema object")
    return v


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")  # vLLM's structured_outputs kinds taken here


def pattern_text(v, field: str) -> Optional[str]:
    """A regular expression or a grammar (compiled, and its errors named, where the request's sampling is built)."""
    if v is not None and not isinstance(v, str):
        raise ValueError(f"{field} must be a string")
    return v


def asks_for(v) -> bool:
    """Whether a structured_outputs entry asks for something: neither None nor False (0, though == False, is not)."""
    return v is not None and v is not False


def choice_list(v, field: str) -> Optional[list[str]]:
    if v is not None and (not isinstance(v, list) or not v or not all(isinstance(c, str) for c in v)):
        raise ValueError(f"{field} must be a non-empty list of strings")
    return v
