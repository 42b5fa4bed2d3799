"""Tool calls: the family parsers on recorded replies, the grammar that enforces `required` and a named function
(through a real verifier, router and HTTP API), OpenAI's response and streaming shapes as the openai SDK reads
them, and a call → tool message → answer round trip."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from cluster.launcher import start_tiers
from router.api.tools import FAMILIES, Tool, family_of, parse
from router.settings import RouterSettings
from tests.tiers import TARGET, api_server, verifier_settings

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 16},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                                "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [Tool.model_validate(WEATHER), Tool.model_validate(TIME)]
ASK = [{"role": "user", "content": "What is the weather in Paris for two days?"}]


@pytest.mark.parametrize(("family", "text", "content", "calls"), [
    ("hermes", 'Let me look.<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>', "Let me look.",
     [("get_time", {"zone": "UTC"})]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\n<tool_call>'
     '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}</tool_call>', None,
     [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "days": 1})]),
    ("hermes", "No tools needed: it is sunny.", "No tools needed: it is sunny.", []),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', None,
     [("get_time", {"zone": "CET"})]),
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "CET"}}; {"name": "get_time", "parameters": '
     '{"zone": "UTC"}}', None, [("get_time", {"zone": "CET"}), ("get_time", {"zone": "UTC"})]),
    ("json", '{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}', None,
     [("get_weather", {"city": "Rome", "days": 2})]),
    ("json", '[{"name": "get_time", "arguments": {"zone": "UTC"}}]', None, [("get_time", {"zone": "UTC"})]),
    ("json", '{"name": "launch_rocket", "arguments": {}}', '{"name": "launch_rocket", "arguments": {}}', []),
    ("json", "It is 12:00.", "It is 12:00.", []),
])
def test_each_family_reads_calls_from_recorded_replies(family, text, content, calls):
    got_content, got = parse(text, TOOLS, FAMILIES[family])
    assert got_content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") and c.type == "function" for c in got)


def test_the_family_comes_from_the_chat_template():
    assert family_of("{% if tools %}<tool_call>{{ t }}</tool_call>{% endif %}").name == "hermes"
    assert family_of("<|start_header_id|>ipython<|end_header_id|>").name == "llama3_json"
    assert family_of(None).name == family_of("<|user|>\n{{ m }}").name == "json"


@pytest.fixture(scope="module")
def url():
    (verifier,) = start_tiers([("verifier", verifier_settings())])
    try:
        with api_server(RouterSettings(verifier=verifier.address, method="none", max_model_len=512)) as (u, _):
            yield u
    finally:
        verifier.stop()


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none")


def _checked(call, schema_of):
    args = json.loads(call.function.arguments)
    params = schema_of[call.function.name]["parameters"]
    assert set(args) == set(params["required"])
    return args


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_calls_are_enforced_and_shaped_as_openai(url, stream):
    schema_of = {t["function"]["name"]: t["function"] for t in (WEATHER, TIME)}
    client = _client(url)
    for choice, names in (("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
        kw = dict(model=TARGET, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=64,
                  temperature=0, parallel_tool_calls=False)
        if stream:
            with client.chat.completions.stream(**kw) as events:
                for _ in events:
                    pass
                done = events.get_final_completion()
        else:
            done = client.chat.completions.create(**kw)
        message, finish = done.choices[0].message, done.choices[0].finish_reason
        assert finish == "tool_calls" and message.tool_calls, message
        assert all(c.function.name in names for c in message.tool_calls)
        for call in message.tool_calls:
            _checked(call, schema_of)


def test_a_call_then_its_result_then_an_answer(url):
    client = _client(url)
    first = client.chat.completions.create(model=TARGET, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           max_tokens=64, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "clear", "high": 21})}]
    answer = client.chat.completions.create(model=TARGET, messages=history, tools=[WEATHER], tool_choice="none",
                                            max_tokens=12, temperature=0)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content
    auto = client.chat.completions.create(model=TARGET, messages=history, tools=[WEATHER], max_tokens=12,
                                          temperature=0)  # auto: a reply that is not a call is content
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(("body", "message"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "one of them"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"messages": [{"role": "tool", "content": None}]}, "needs content"),
])
def test_bad_tool_requests_are_refused_by_name(url, body, message):
    r = httpx.post(url + "/v1/chat/completions", json={"model": TARGET, "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "json"])
def test_the_forcing_grammar_of_each_family_takes_its_calls_and_nothing_else(family):
    import llguidance

    from router.api.tools import MAX_PARALLEL, grammar
    from services.grammar import GrammarTokenizer, compile_grammar
    from services.registry import resolve_model
    from services.tokenizer import TextTokenizer

    model_dir = resolve_model("dspark-target-v2")
    tok, lltok = TextTokenizer.from_dir(model_dir), GrammarTokenizer(model_dir, 8192).lltok
    fam = FAMILIES[family]
    one = json.dumps({"name": "get_time", fam.args_key: {"zone": "UTC"}})

    def accepts(g, text: str) -> bool:
        m = llguidance.LLMatcher(lltok, compile_grammar(g))
        return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()

    forced = grammar(TOOLS, "get_time", fam, parallel=True)  # a named function: exactly one call of it
    reply = f"<tool_call>{one}</tool_call>" if family == "hermes" else one
    assert accepts(forced, reply)
    assert not accepts(forced, reply.replace("get_time", "get_weather"))
    if family != "llama3_json":
        many = grammar(TOOLS, "required", fam, parallel=True)
        n = min(MAX_PARALLEL, 2 * len(TOOLS))
        calls = [f"<tool_call>{one}</tool_call>"] * n if family == "hermes" else None
        text = "".join(calls) if calls else json.dumps([json.loads(one)] * n)
        assert accepts(many, text)
        too_many = "".join(calls + calls[:1]) if calls else json.dumps([json.loads(one)] * (n + 1))
        assert not accepts(many, too_many)
