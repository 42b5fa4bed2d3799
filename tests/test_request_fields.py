"""No field that changes the output is silently ignored: OpenAI's, vLLM's and SGLang's output-changing fields
that are not served are refused by name (their no-op values accepted), `truncate_prompt_tokens` and completions'
`add_special_tokens` are honoured, fields known to change nothing pass, and a field nobody knows is logged and
counted — or refused by name with strict fields."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from cluster.launcher import start_tiers
from router.api.openai import UNSERVED, ChatCompletionRequest, CompletionRequest
from router.settings import RouterSettings
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from tests.tiers import TARGET, api_server, verifier_settings

BASE = {"model": TARGET, "prompt": "def fibonacci(n):", "max_tokens": 6, "temperature": 0}
CHANGES_OUTPUT = {"top_n_sigma": 1.0, "logits_processors": ["x"], "functions": [{"name": "f"}],
                  "function_call": "auto", "tools": [{"type": "function"}]}
# Every structured-output field, each asking for the same language: one or more "ab", then "!".
STRUCTURED = {"structured_outputs": {"regex": "(ab)+!"}, "guided_regex": "(ab)+!", "regex": "(ab)+!",
              "guided_grammar": 'start: ("ab")+ "!"', "ebnf": 'root ::= ("ab")+ "!"',
              "structured_outputs.grammar": {"grammar": 'start: ("ab")+ "!"'}}


@pytest.fixture(scope="module")
def servers():
    (verifier,) = start_tiers([("verifier", verifier_settings())])
    try:
        loose = RouterSettings(verifier=verifier.address, method="none", max_model_len=512)
        strict = loose.model_copy(update={"strict_fields": True})
        with api_server(loose) as (url, router), api_server(strict) as (strict_url, _):
            yield url, router, strict_url
    finally:
        verifier.stop()


@pytest.mark.parametrize("name", sorted(CHANGES_OUTPUT))
def test_an_unserved_field_is_refused_by_name(servers, name):
    r = httpx.post(servers[0] + "/v1/completions", json={**BASE, name: CHANGES_OUTPUT[name]})
    assert r.status_code == 400 and name in r.json()["error"]["message"]


def test_every_unserved_field_is_covered_and_its_no_op_passes(servers):
    assert set(CHANGES_OUTPUT) <= set(UNSERVED)
    for name, noop in UNSERVED.items():
        if name in CompletionRequest.model_fields:  # served by this body (echo): its own type and checks
            continue
        for body in ({**BASE, name: noop}, {**BASE, name: None}):
            CompletionRequest.model_validate(body)  # accepted: asks for nothing
    plain = httpx.post(servers[0] + "/v1/completions", json=BASE).json()["choices"][0]["text"]
    same = httpx.post(servers[0] + "/v1/completions", json={**BASE, "typical_p": 1.0, "bad_words": []}).json()
    assert same["choices"][0]["text"] == plain


def test_truncate_prompt_tokens_keeps_the_last_tokens(servers):
    tok = TextTokenizer.from_dir(resolve_model(TARGET))
    ids = tok.encode(BASE["prompt"])
    cut = httpx.post(servers[0] + "/v1/completions", json={**BASE, "truncate_prompt_tokens": 3}).json()
    by_ids = httpx.post(servers[0] + "/v1/completions", json={**BASE, "prompt": ids[-3:]}).json()
    assert cut["usage"]["prompt_tokens"] == 3 and cut["choices"][0]["text"] == by_ids["choices"][0]["text"]
    whole = httpx.post(servers[0] + "/v1/completions", json={**BASE, "truncate_prompt_tokens": -1}).json()
    assert whole["usage"]["prompt_tokens"] == len(ids)
    bad = httpx.post(servers[0] + "/v1/completions", json={**BASE, "truncate_prompt_tokens": 0})
    assert bad.status_code == 400 and "truncate_prompt_tokens" in bad.text


def test_allowed_token_ids_and_bad_words_are_honoured(servers):
    """The processors themselves are checked against a reference in tests/test_processors.py; here, the API."""
    tok = TextTokenizer.from_dir(resolve_model(TARGET))
    body = {**BASE, "max_tokens": 12, "logprobs": 0}
    plain = httpx.post(servers[0] + "/v1/completions", json=body).json()["choices"][0]
    allowed = sorted(set(range(40, 400)))
    kept = httpx.post(servers[0] + "/v1/completions", json={**body, "allowed_token_ids": allowed}).json()["choices"][0]
    ids = [tok.encode(t, add_special_tokens=False) for t in kept["logprobs"]["tokens"]]
    assert all(len(i) == 1 and i[0] in allowed for i in ids) and kept["text"] != plain["text"]
    k, word = next((k, t) for k, t in enumerate(plain["logprobs"]["tokens"]) if t.strip() == t and t)
    banned = httpx.post(servers[0] + "/v1/completions", json={**body, "bad_words": [word]}).json()["choices"][0]
    assert banned["logprobs"]["tokens"][:k] == plain["logprobs"]["tokens"][:k]  # the same until the word
    assert banned["logprobs"]["tokens"][k] != word
    too_many = httpx.post(servers[0] + "/v1/completions", json={**BASE, "allowed_token_ids": [10**6]})
    assert too_many.status_code == 400 and "allowed_token_ids" in too_many.text


def test_bad_words_are_tokenized_as_vllm_does():
    from router.api.admission import Admission

    tok = TextTokenizer.from_dir(resolve_model(TARGET))
    admit = Admission.__new__(Admission)
    admit.tokenizer = tok
    words = admit.bad_words(["  return", "x"])
    assert tuple(tok.encode("return", add_special_tokens=False)) in words
    assert all(w for w in words) and len(words) == len(set(words))


def test_add_special_tokens_is_the_bos_rule_of_text_prompts(servers):
    bare = httpx.post(servers[0] + "/v1/completions", json={**BASE, "add_special_tokens": False}).json()
    assert bare["usage"]["prompt_tokens"] == len(TextTokenizer.from_dir(resolve_model(TARGET)).encode(
        BASE["prompt"], add_special_tokens=False))
    with pytest.raises(ValueError, match="add_special_tokens"):
        ChatCompletionRequest.model_validate({"model": TARGET, "messages": [{"role": "user", "content": "x"}],
                                              "add_special_tokens": True})


def test_unknown_fields_are_counted_or_refused_and_no_op_fields_pass(servers):
    url, router, strict_url = servers
    body = {**BASE, "user": "u1", "metadata": {"k": "v"}, "store": False}
    assert httpx.post(url + "/v1/completions", json=body).status_code == 200
    assert httpx.post(strict_url + "/v1/completions", json=body).status_code == 200
    unknown = {**BASE, "frobnicate": 3}
    assert httpx.post(url + "/v1/completions", json=unknown).status_code == 200
    counted = router.metrics.ignored_fields.labels(router.model, "frobnicate")._value.get()
    assert counted == 1 and "dspark:ignored_request_fields_total" in httpx.get(url + "/metrics").text
    refused = httpx.post(strict_url + "/v1/chat/completions", json={
        "model": TARGET, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "frobnicate": 3})
    assert refused.status_code == 400 and "'frobnicate'" in refused.json()["error"]["message"]
    assert refused.json()["error"]["param"] == "frobnicate"


@pytest.mark.parametrize("name", sorted(STRUCTURED))
def test_every_structured_output_field_constrains_the_output(servers, name):
    field = name.split(".")[0]
    body = {**BASE, "max_tokens": 24, field: STRUCTURED[name]}
    r = httpx.post(servers[0] + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert re.fullmatch(r"(ab)+!", choice["text"]) if choice["finish_reason"] == "stop" else \
        re.fullmatch(r"(ab)*a?", choice["text"]), choice


def test_json_schema_and_choice_through_chat(servers):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    chat = {"model": TARGET, "messages": [{"role": "user", "content": "Give a number."}], "max_tokens": 24,
            "temperature": 0}
    for fmt in ({"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}},
                {"type": "json_object"}):
        out = httpx.post(servers[0] + "/v1/chat/completions", json={**chat, "response_format": fmt}).json()
        choice = out["choices"][0]
        if choice["finish_reason"] == "stop":
            value = json.loads(choice["message"]["content"])
            assert isinstance(value, dict) and (fmt["type"] == "json_object" or set(value) == {"n"})
    picked = httpx.post(servers[0] + "/v1/chat/completions",
                        json={**chat, "guided_choice": ["yes", "no"]}).json()["choices"][0]["message"]["content"]
    assert picked in ("yes", "no")


@pytest.mark.parametrize(("body", "message"), [
    ({"regex": "a+", "guided_regex": "b+"}, "guided_regex, regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice, structured_outputs.regex"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structural_tag"),
    ({"response_format": {"type": "json_schema"}}, "needs its json_schema"),
    ({"regex": "(unclosed"}, "regex"),
    ({"json_schema": '{"type": "object", "properties": '}, "json_schema"),
])
def test_a_bad_or_doubled_constraint_is_refused_by_name(servers, body, message):
    r = httpx.post(servers[0] + "/v1/completions", json={**BASE, **body})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_the_openai_sdks_parse_gets_its_pydantic_model_back(servers):
    """`client.chat.completions.parse(response_format=<pydantic model>)`, unmodified: the SDK sends a strict JSON
    schema; the output is an instance of the model (or cut by max_tokens, which the SDK reports)."""
    import openai
    import pydantic

    class Answer(pydantic.BaseModel):  # bounded, so a toy model's answer ends inside max_tokens
        word: str = pydantic.Field(max_length=8)
        count: int = pydantic.Field(ge=0, le=99)

    client = openai.OpenAI(base_url=servers[0] + "/v1", api_key="none")
    done = 0
    for question in ("Count the letters of a word.", "Name a word and its length.", "Say a word."):
        try:
            out = client.chat.completions.parse(model=TARGET, messages=[{"role": "user", "content": question}],
                                                response_format=Answer, max_tokens=64, temperature=0)
        except openai.LengthFinishReasonError:
            continue  # cut inside the object: an honest finish_reason length
        assert isinstance(out.choices[0].message.parsed, Answer)
        done += 1
    assert done, "no answer finished inside 64 tokens"


def test_typical_p_is_honoured(servers):
    """typical_p near 0 keeps one token a step (the most typical): seeds no longer matter; at 1, they do."""
    body = {**BASE, "temperature": 1.0, "max_tokens": 12}
    texts = {typical: {httpx.post(servers[0] + "/v1/completions", json={**body, "seed": seed, "typical_p": typical})
                       .json()["choices"][0]["text"] for seed in range(4)} for typical in (1e-6, 1.0)}
    assert len(texts[1e-6]) == 1 and len(texts[1.0]) > 1


# The request fields of OpenAI's, vLLM's and SGLang's completions and chat schemas as of 2026-12 (their API
# references and protocol files), each of which must be honoured (a field of our body), refused by name
# (UNSERVED) or known to change nothing (NO_OP_FIELDS): none may fall through to "unknown".
OPENAI_CHAT = {"messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias",
               "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities", "n",
               "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key", "reasoning_effort",
               "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
               "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
               "web_search_options"}
OPENAI_COMPLETIONS = {"model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
                      "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
                      "temperature", "top_p", "user"}
VLLM = {"use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
        "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
        "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
        "bad_words", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
        "guided_decoding_backend", "guided_whitespace_pattern", "priority", "request_id", "logits_processors",
        "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs",
        "add_special_tokens", "response_format", "echo", "add_generation_prompt", "continue_final_message",
        "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "documents", "top_n_sigma", "typical_p"}
SGLANG = {"regex", "json_schema", "ebnf", "lora_path", "rid", "session_params", "separate_reasoning",
          "stream_reasoning", "return_hidden_states", "min_tokens", "top_k", "min_p", "repetition_penalty",
          "stop_token_ids", "no_stop_trim", "ignore_eos", "skip_special_tokens", "custom_logit_processor",
          "custom_params", "chat_template_kwargs", "continue_final_message", "bootstrap_host", "bootstrap_port",
          "bootstrap_room", "data_parallel_rank", "reasoning_effort", "stream_interval"}


@pytest.mark.parametrize(("body", "fields"), [(ChatCompletionRequest, OPENAI_CHAT | VLLM | SGLANG),
                                              (CompletionRequest, OPENAI_COMPLETIONS | VLLM | SGLANG)])
def test_every_field_of_the_three_schemas_is_honoured_refused_or_a_no_op(body, fields):
    from router.api.openai import NO_OP_FIELDS

    declared = set(body.model_fields)
    assert sorted(fields - declared - set(UNSERVED) - NO_OP_FIELDS) == []
    for name in sorted(set(UNSERVED) - declared):  # refused by name unless asking for nothing
        with pytest.raises(ValueError, match=name):
            body.model_validate({"model": TARGET, "messages": [{"role": "user", "content": "hi"}], "prompt": "x",
                                 name: "something"})
