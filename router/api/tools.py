"""Tool calls (OpenAI `tools`, `tool_choice`, `parallel_tool_calls`): the prompt that offers the tools, the grammar
that enforces a call, and the parser that reads calls back, per model family.

A family is how a model writes a call. Read from the model's chat template: Hermes / Qwen (`<tool_call>{"name": …,
"arguments": …}</tool_call>`), Llama 3's JSON (`{"name": …, "parameters": …}`, `<|python_tag|>` optional); a
model whose template knows no tools (dspark's own targets, Gemma 3) gets the plain-JSON default: the reply is one
call object, or a list of them. The tools are offered in a system turn written here, in the family's words.

`tool_choice`: `none` (no tools offered, nothing parsed), `auto` (offered; a reply that is a call is parsed as
one, else it is content), `required` and a named function (offered and enforced: a grammar built from the tools'
JSON schemas masks every verified row — services/grammar.py — so the reply is a call, exact under speculation).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints

from router.api.structured import StrictBody
from services.grammar import JSON_LAYOUT
from services.types import Grammar, GrammarKind

MAX_PARALLEL = 8  # calls a forced reply may hold (twice the tools offered, at most this)
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class FunctionDef(StrictBody):
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictBody):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(StrictBody):
    name: Name


class ToolChoiceFunction(StrictBody):
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(StrictBody):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCall(StrictBody):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ToolFields(BaseModel):
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool = True

    def tool_mode(self) -> str:
        """none | auto | required | the named function's name (OpenAI's default: auto when tools are given)."""
        if not self.tools:
            if self.tool_choice not in (None, "none", "auto"):
                raise ValueError("tool_choice needs tools")
            return "none"
        choice = self.tool_choice or "auto"
        if isinstance(choice, ToolChoiceFunction):
            if choice.function.name not in {t.function.name for t in self.tools}:
                raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
            return choice.function.name
        return choice


@dataclass(frozen=True, slots=True)
class Family:
    name: str  # hermes | llama3_json | json
    args_key: str  # "arguments" (Hermes, plain JSON) or "parameters" (Llama 3)


FAMILIES = {"hermes": Family("hermes", "arguments"), "llama3_json": Family("llama3_json", "parameters"),
            "json": Family("json", "arguments")}


@dataclass(frozen=True, slots=True)
class ToolUse:
    """What one chat request's tools ask of the prompt, the sampling and the response."""

    tools: list[Tool]
    family: Family
    mode: str  # auto | required | a function's name
    parallel: bool

    def offer(self, turns: list[dict[str, str]]) -> list[dict[str, str]]:
        """The conversation with the tools offered in its system turn (merged into the first one if any)."""
        text = system_turn(self.tools, self.family, self.parallel)
        if turns and turns[0]["role"] == "system":
            return [{"role": "system", "content": f"{turns[0]['content']}\n\n{text}"}, *turns[1:]]
        return [{"role": "system", "content": text}, *turns]

    def grammar(self) -> Grammar | None:
        return grammar(self.tools, self.mode, self.family, self.parallel)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return parse(text, self.tools, self.family)


def family_of(chat_template: str | None) -> Family:
    """The model's own way of writing a call, from its chat template; plain JSON when it has none."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return FAMILIES["hermes"]
    if "<|python_tag|>" in template or "ipython" in template:
        return FAMILIES["llama3_json"]
    return FAMILIES["json"]


def _call_schema(tool: Tool, family: Family) -> dict:
    params = tool.function.parameters or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, family.args_key: params},
            "required": ["name", family.args_key], "additionalProperties": False}


def system_turn(tools: list[Tool], family: Family, parallel: bool) -> str:
    """The system turn that offers the tools, in the family's words."""
    listed = json.dumps([t.model_dump(exclude_none=True) for t in tools])
    shape = f'{{"name": <function name>, "{family.args_key}": <arguments object>}}'
    if family.name == "hermes":
        how = f"To call a function, reply with <tool_call>{shape}</tool_call>"
        how += " (one block per call)." if parallel else "."
    else:
        how = f"To call a function, reply with only the JSON object {shape}"
        how += ", or a JSON list of such objects for several calls." if parallel and family.name == "json" else "."
    return f"You may call these functions: {listed}\n{how}"


def grammar(tools: list[Tool], mode: str, family: Family, parallel: bool) -> Grammar | None:
    """`required` or a named function: the reply is a call (a list of calls when parallel), masked by a grammar."""
    if mode in ("none", "auto"):
        return None
    chosen = [t for t in tools if mode == "required" or t.function.name == mode]
    one = {"anyOf": [_call_schema(t, family) for t in chosen], "x-guidance": JSON_LAYOUT}
    most = min(MAX_PARALLEL, 2 * len(chosen)) if parallel and mode == "required" else 1  # a loop cannot run on
    if family.name == "hermes":
        lark = f"start: block{' block?' * (most - 1)}\nblock: \"<tool_call>\" call \"</tool_call>\"\n" \
               f"call: %json {json.dumps(one)}"
        return Grammar(GrammarKind.GRAMMAR, lark)
    if most > 1 and family.name == "json":
        return Grammar(GrammarKind.JSON_SCHEMA, json.dumps({"type": "array", "items": one, "minItems": 1,
                                                            "maxItems": most, "x-guidance": JSON_LAYOUT}))
    return Grammar(GrammarKind.JSON_SCHEMA, json.dumps(one))


def parse(text: str, tools: list[Tool], family: Family) -> tuple[str | None, list[ToolCall]]:
    """A reply → (content, calls). A call must name one of the tools; text that is no call stays content."""
    names = {t.function.name for t in tools}
    found: list[dict] = []
    content: str | None = text
    if family.name == "hermes":
        blocks = re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, flags=re.DOTALL)
        found = [obj for obj in (_json(b) for b in blocks) if isinstance(obj, dict)]
        if found:
            content = text[: text.index("<tool_call>")].strip() or None
    else:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        obj = _json(body)
        if obj is None and family.name == "llama3_json" and ";" in body:
            obj = [_json(part) for part in body.split(";")]
        candidates = obj if isinstance(obj, list) else [obj]
        if candidates and all(isinstance(c, dict) and c.get("name") in names for c in candidates):
            found, content = candidates, None
    calls = []
    for obj in found:
        if obj.get("name") not in names:
            continue
        args = obj.get(family.args_key, obj.get("arguments", {}))
        calls.append(ToolCall(id=f"call_{secrets.token_hex(12)}",
                              function=CalledFunction(name=obj["name"], arguments=json.dumps(args))))
    if not calls:
        return text, []
    return content, calls


def written_calls(calls: list[ToolCall], family: Family) -> str:
    """The calls an assistant turn made, as the model writes them (so a conversation reads as it was generated)."""
    objs = [{"name": c.function.name, family.args_key: _json(c.function.arguments) or {}} for c in calls]
    if family.name == "hermes":
        return "".join(f"<tool_call>{json.dumps(o)}</tool_call>" for o in objs)
    if family.name == "llama3_json":
        return "; ".join(json.dumps(o) for o in objs)
    return json.dumps(objs[0] if len(objs) == 1 else objs)


def tool_result(text: str, family: Family) -> str:
    """A `tool` message's content, given to the model as a user turn."""
    return f"<tool_response>{text}</tool_response>" if family.name == "hermes" else f"Function result: {text}"


def _json(text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return None
