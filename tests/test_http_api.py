"""The OpenAI-compatible HTTP API over the tiered system (tier processes, real HTTP, the openai client)."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from protos.dspark.v1 import dspark_pb2 as pb
from protos.dspark.v1 import dspark_pb2_grpc as rpc
from protos.serving import channel
from router.settings import RouterSettings
from services.chat_template import render
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from tests.tiers import TARGET, api_server, plain_greedy, tier_pair

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def tiers():
    with tier_pair() as addresses:
        yield addresses


@pytest.fixture(scope="module")
def api(tiers):
    settings = RouterSettings(verifier=tiers[0], drafter=tiers[1], api_key=[KEY], max_model_len=512)
    with api_server(settings) as (url, router):
        yield url, router


@pytest.fixture(scope="module")
def client(api):
    return openai.OpenAI(base_url=api[0] + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    return TextTokenizer.from_dir(resolve_model(TARGET))


def _loads(tiers) -> tuple[pb.LoadReply, pb.DrafterLoadReply]:
    async def run():
        async with channel(tiers[0]) as v, channel(tiers[1]) as d:
            return await rpc.VerifierStub(v).Load(pb.LoadRequest()), await rpc.DrafterStub(d).Load(pb.LoadRequest())
    return asyncio.run(run())


def test_completions_through_the_openai_client_equal_plain_greedy(client, tokenizer):
    prompt = "def fibonacci(n):"
    out = client.completions.create(model=TARGET, prompt=prompt, max_tokens=40, temperature=0)
    expected = plain_greedy([tokenizer.encode(prompt)], [40])[0]
    assert out.choices[0].text == tokenizer.decode(expected)
    assert out.usage.completion_tokens == len(expected) and out.usage.prompt_tokens == len(tokenizer.encode(prompt))
    stream = client.completions.create(model=TARGET, prompt=prompt, max_tokens=40, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == out.choices[0].text


def test_chat_streaming_with_usage_matches_non_streaming(client, tokenizer):
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    full = client.chat.completions.create(model=TARGET, messages=messages, max_tokens=30, temperature=0,
                                          extra_body={"speculative": {"method": "eagle3", "gamma": 5}})
    chunks = list(client.chat.completions.create(model=TARGET, messages=messages, max_tokens=30, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    expected = plain_greedy([tokenizer.encode(render(messages, add_generation_prompt=True))], [30])[0]
    assert full.choices[0].message.content == tokenizer.decode(expected)
    assert len(chunks) < len(expected)  # one chunk per cycle: accepted drafts arrive together


@pytest.mark.parametrize("body, param", [
    ({"model": "gpt-4", "prompt": "x"}, "model"),
    ({"model": TARGET, "prompt": "x", "temperature": 5}, "temperature"),
    ({"model": TARGET, "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": TARGET, "prompt": "x", "max_tokens": 2000}, "max_tokens"),
    ({"model": TARGET, "prompt": "x", "n": 65}, "n"),
    ({"model": TARGET, "prompt": ["x"] * 9, "n": 8}, "n"),
    ({"model": TARGET, "prompt": "x", "n": 3, "best_of": 2}, None),
    ({"model": TARGET, "prompt": "x", "best_of": 2, "stream": True}, None),
    ({"model": TARGET, "prompt": "x", "logprobs": 21}, "logprobs"),
    ({"model": TARGET, "prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"model": TARGET, "prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"model": TARGET, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, None),
    ({"model": TARGET, "prompt": [1, 10**7]}, "prompt"),
    ({"model": TARGET, "prompt": "x", "speculative": {"method": "medusa"}}, None),
    ({"model": TARGET, "prompt": "x", "speculative": {"gamma": 99}}, None),
    ({"model": TARGET, "messages": []}, "messages"),
])
def test_bad_input_is_an_openai_shaped_400_and_changes_nothing(api, tiers, body, param):
    before = _loads(tiers)[0].steps
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(api[0] + path, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] == "BadRequestError"
    if param is not None:
        assert error["param"] == param
    assert _loads(tiers)[0].steps == before


def test_api_key_is_required_on_v1_but_not_on_probes(api):
    url = api[0]
    assert httpx.get(url + "/v1/models").status_code == 401
    wrong = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    ok = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "abc-123"})
    assert ok.json()["data"][0]["id"] == TARGET and ok.headers["x-request-id"] == "abc-123"
    assert httpx.get(url + "/health").json()["tiers"] == {"verifier": True, "drafter": True}
    metrics = httpx.get(url + "/metrics").text
    assert "dspark:spec_decode_num_accepted_tokens_per_pos_total" in metrics and "time_to_first_token" in metrics


def test_client_disconnect_frees_kv_slot_and_draft_context(api, tiers):
    url, router = api
    finished = router.metrics.requests.labels(TARGET, "length")._value.get()
    body = {"model": TARGET, "prompt": "import os\n", "max_tokens": 480, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()  # keep the iterator: dropping it closes the response
        next(lines)
        deadline = time.monotonic() + 10  # the first token precedes the drafter's context: wait for both
        while time.monotonic() < deadline and not (_loads(tiers)[0].running and _loads(tiers)[1].contexts):
            time.sleep(0.05)
        load, dload = _loads(tiers)
        assert load.running == 1 and dload.contexts == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (_loads(tiers)[0].running or _loads(tiers)[1].contexts):
        time.sleep(0.1)
    load, dload = _loads(tiers)
    assert load.running == 0 and load.kv_used == 0 and dload.contexts == 0
    assert router.metrics.requests.labels(TARGET, "length")._value.get() == finished  # it did not just finish


def test_a_full_queue_answers_429_with_retry_after(tiers):
    settings = RouterSettings(verifier=tiers[0], drafter=tiers[1], max_running=1, max_queue=0, max_model_len=512)
    body = {"model": TARGET, "prompt": "import os\n", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with api_server(settings) as (url, _), httpx.stream("POST", url + "/v1/completions", json=body) as first:
        lines = first.iter_lines()
        next(lines)
        second = httpx.post(url + "/v1/completions", json={**body, "stream": False})
        assert second.status_code == 429 and second.headers["retry-after"] == "1"
        assert second.json()["error"]["type"] == "RateLimitError"


def test_health_is_503_when_a_tier_is_down(tiers):
    settings = RouterSettings(verifier=tiers[0], drafter="127.0.0.1:9", max_model_len=512)
    with api_server(settings) as (url, _):
        r = httpx.get(url + "/health")
    assert r.status_code == 503 and r.json()["tiers"] == {"verifier": True, "drafter": False}


def test_what_benchmark_clients_send_is_understood(api, client, tokenizer):
    """Chat content as text parts and the developer role (vLLM's chat benchmark, guidellm), a tool message, a
    stream without keep-alive comments (SGLang's bench_serving parses them as JSON), and vLLM's model card."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 30?"}]
    as_string = client.chat.completions.create(model=TARGET, messages=messages, max_tokens=12, temperature=0)
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "What is 12 + 30?"}]}]
    as_parts = client.chat.completions.create(model=TARGET, messages=parts, max_tokens=12, temperature=0)
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content
    tool = [*messages, {"role": "assistant", "content": "42"}, {"role": "tool", "content": "checked: 42"}]
    assert client.chat.completions.create(model=TARGET, messages=tool, max_tokens=4).choices[0].message.content
    url, headers = api[0], {"Authorization": f"Bearer {KEY}"}
    card = httpx.get(url + "/v1/models", headers=headers).json()["data"][0]
    assert card["root"] == TARGET and card["parent"] is None and card["max_model_len"] == 512


@pytest.mark.parametrize(("extra", "field"), [
    ({"prompt_logprobs": 2}, "prompt_logprobs"), ({"suffix": "x"}, "suffix"),
])
def test_sampling_fields_not_served_are_refused_by_name_and_their_noop_values_accepted(api, extra, field):
    url, headers = api[0], {"Authorization": f"Bearer {KEY}"}
    body = {"model": TARGET, "prompt": "import os\n", "max_tokens": 4, **extra}
    bad = httpx.post(url + "/v1/completions", json=body, headers=headers)
    assert bad.status_code == 400 and field in bad.json()["error"]["message"]
    noop = {"prompt_logprobs": None, "suffix": None}[field]
    assert httpx.post(url + "/v1/completions", json={**body, field: noop}, headers=headers).status_code == 200


def test_a_content_part_that_is_not_text_is_refused(api):
    url, headers = api[0], {"Authorization": f"Bearer {KEY}"}
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    bad = httpx.post(url + "/v1/chat/completions", json={"model": TARGET, "messages": image}, headers=headers)
    assert bad.status_code == 400 and "image_url" in bad.json()["error"]["message"]


def test_keepalive_comments_are_off_by_default_and_come_when_configured(tiers):
    """SGLang's bench_serving, vLLM's older benchmark_serving and llmperf parse `: ping` as JSON."""
    assert RouterSettings().sse_keepalive_s == 0
    body = {"model": TARGET, "prompt": "import os\n", "max_tokens": 48, "ignore_eos": True, "stream": True}
    seen = {}
    for interval in (0.0, 0.01):
        settings = RouterSettings(verifier=tiers[0], drafter=tiers[1], max_model_len=512, sse_keepalive_s=interval)
        with api_server(settings) as (url, _), httpx.stream("POST", url + "/v1/completions", json=body) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        seen[interval] = sum(line.startswith(":") for line in lines)
    assert seen[0.0] == 0 and seen[0.01] > 0


def test_vllm_and_sglang_side_routes(api, client, tokenizer):
    """/tokenize and /detokenize (vLLM's shapes, the server's BOS included), /server_info (SGLang's mean
    acceptance length), the speculative counters under vLLM's names; all behind the API key."""
    url, headers = api[0], {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(url + "/tokenize", json={"prompt": "x"}).status_code == 401
    out = httpx.post(url + "/tokenize", json={"model": TARGET, "prompt": "def main():"}, headers=headers).json()
    assert out["tokens"] == tokenizer.encode("def main():") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 512
    bare = httpx.post(url + "/tokenize", json={"prompt": "def main():", "add_special_tokens": False},
                      headers=headers).json()
    assert bare["tokens"] == out["tokens"][1:] and out["tokens"][0] == tokenizer.bos_token_id
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, headers=headers)
    assert chat.json()["tokens"] == tokenizer.encode(render([{"role": "user", "content": "hi"}], True))
    text = httpx.post(url + "/detokenize", json={"tokens": bare["tokens"]}, headers=headers).json()["prompt"]
    assert text == "def main():"
    assert httpx.post(url + "/detokenize", json={"tokens": [10**6]}, headers=headers).status_code == 400
    for prompt in ("def fibonacci(n):", "import os\n\n"):
        client.completions.create(model=TARGET, prompt=prompt, max_tokens=32, temperature=0,
                                  extra_body={"speculative": {"policy": "fixed", "gamma": 4}})
    info = httpx.get(url + "/server_info", headers=headers).json()
    assert info["speculative_algorithm"] == "dspark" and info["avg_spec_accept_length"] > 1
    metrics = httpx.get(url + "/metrics").text
    assert "vllm:spec_decode_num_accepted_tokens_total" in metrics and "vllm:spec_decode_num_drafts_total" in metrics


def test_sixteen_stop_strings_are_served(client):
    stops = [f"zq{i}" for i in range(15)] + ["\n"]
    out = client.completions.create(model=TARGET, prompt="import os\n", max_tokens=40, temperature=0, stop=stops)
    assert "\n" not in out.choices[0].text


def test_a_batch_of_prompts_answers_one_choice_per_prompt_in_order(client, api, tokenizer):
    """lm-eval's local-completions sends `prompt` as a list; token-id batches too. Streaming a batch: a 400."""
    texts = ["def fibonacci(n):", "import os\n", "class Stack:"]
    out = client.completions.create(model=TARGET, prompt=texts, max_tokens=12, temperature=0)
    expected = plain_greedy([tokenizer.encode(t) for t in texts], [12] * 3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [tokenizer.decode(e) for e in expected]
    assert out.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in texts)
    assert out.usage.completion_tokens == sum(len(e) for e in expected)
    ids = client.completions.create(model=TARGET, prompt=[tokenizer.encode(t) for t in texts[:2]], max_tokens=12,
                                    temperature=0)
    assert [c.text for c in ids.choices] == [c.text for c in out.choices[:2]]
    url, headers = api[0], {"Authorization": f"Bearer {KEY}"}
    stream = client.completions.create(model=TARGET, prompt=texts, max_tokens=12, temperature=0, stream=True)
    streamed = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in out.choices]
    too_long = httpx.post(url + "/v1/completions", headers=headers,
                          json={"model": TARGET, "prompt": ["x", "y " * 600], "max_tokens": 4})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
