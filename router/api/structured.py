"""The structured-output fields of OpenAI, vLLM and SGLang, read into one `Grammar` (services/grammar.py compiles
it on the verifier, where each verified row is masked by it).

  OpenAI   response_format: {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema",
           "strict", "description"}}
  vLLM     structured_outputs: {"json", "regex", "choice", "grammar", "json_object"}; the older guided_json,
           guided_regex, guided_choice, guided_grammar
  SGLang   regex, json_schema (a JSON string), ebnf

One constraint a request: two are refused by name, as vLLM refuses them. `structured_outputs` fields this server
does not read (structural_tag, whitespace_pattern, …) are refused by name, not dropped.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from services.types import MAX_GRAMMAR_CHARS, Grammar, GrammarKind

GrammarText = Annotated[str, StringConstraints(min_length=1, max_length=MAX_GRAMMAR_CHARS)]
Choices = Annotated[list[Annotated[str, StringConstraints(min_length=1)]], Field(min_length=1, max_length=1024)]


class StrictBody(BaseModel):
    """A nested request object of the API: strict types, unknown keys refused by name."""

    model_config = ConfigDict(strict=True, extra="forbid")


class JsonSchemaFormat(StrictBody):
    name: str = Field(max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(StrictBody):
    json_: dict[str, Any] | GrammarText | None = Field(None, alias="json")
    regex: GrammarText | None = None
    choice: Choices | None = None
    grammar: GrammarText | None = None
    json_object: bool | None = None


class StructuredFields(BaseModel):
    """The request fields, mixed into the completions and chat bodies."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | GrammarText | None = None
    guided_regex: GrammarText | None = None
    guided_choice: Choices | None = None
    guided_grammar: GrammarText | None = None
    regex: GrammarText | None = None  # SGLang
    json_schema: GrammarText | None = None  # SGLang: the schema as a JSON string
    ebnf: GrammarText | None = None  # SGLang

    def grammar(self) -> Grammar | None:
        """The one constraint the request asks for; two or more → ValueError naming them."""
        found: dict[str, Grammar] = {}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found["response_format"] = _schema({"type": "object"})
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise ValueError("response_format json_schema needs its json_schema (name and schema)")
            found["response_format"] = _schema(fmt.json_schema.schema_ or {"type": "object"})
        so = self.structured_outputs
        if so is not None:
            picks = {name: value for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                                     ("grammar", so.grammar)) if value is not None}
            if so.json_object:
                picks["json_object"] = {"type": "object"}
            for name, value in picks.items():
                found[f"structured_outputs.{name}"] = _kind(name, value)
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar"), ("regex", "regex"), ("json_schema", "json"),
                           ("ebnf", "grammar")):
            value = getattr(self, name)
            if value is not None:
                found[name] = _kind(kind, value)
        if len(found) > 1:
            raise ValueError(f"one structured-output constraint a request, got {', '.join(sorted(found))}")
        return next(iter(found.values()), None)


def _kind(kind: str, value) -> Grammar:
    if kind in ("json", "json_object"):
        return _schema(value)
    if kind == "choice":
        return Grammar(GrammarKind.CHOICE, json.dumps(value))
    return Grammar(GrammarKind.REGEX if kind == "regex" else GrammarKind.GRAMMAR, value)


def _schema(schema: dict | str) -> Grammar:
    text = schema if isinstance(schema, str) else json.dumps(schema)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"a JSON schema of at most {MAX_GRAMMAR_CHARS} characters")
    return Grammar(GrammarKind.JSON_SCHEMA, text)
