"""Logprobs, echo and the logits processors through the HTTP API (tier processes serving DSpark, the openai client):
each equals in-process plain decoding with the same parameters."""

from __future__ import annotations

import openai
import pytest

from in_process.generation import GenerationRequest, InProcessRouter
from router.settings import RouterSettings
from services.chat_template import render
from services.loader import load_model
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from services.types import SamplingParams
from tests.tiers import TARGET, api_server, tier_pair
from verifier_worker.engine import Engine, EngineConfig

KEY = "sk-test-key"
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def client():
    with tier_pair() as (verifier, drafter):
        settings = RouterSettings(verifier=verifier, drafter=drafter, api_key=[KEY], max_model_len=512)
        with api_server(settings) as (url, _):
            yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    return TextTokenizer.from_dir(resolve_model(TARGET))


@pytest.fixture(scope="module")
def plain(tokenizer):
    """In-process plain decoding (fp32, no drafter) with the given parameters → its GenerationResult."""
    engine = Engine(load_model(resolve_model(TARGET), "float32", "cpu"), EngineConfig(num_slots=2, max_len=512))

    def run(prompt_ids: list[int], **params):
        req = GenerationRequest("p", prompt_ids, SamplingParams(**params), stop_token_ids=tokenizer.eos_token_ids)
        return InProcessRouter(engine).generate([req])[0]
    return run


def test_completion_logprobs_equal_plain_decoding_streamed_or_not(client, tokenizer, plain):
    ref = plain(tokenizer.encode(PROMPT), max_tokens=24, logprobs=3)
    out = client.completions.create(model=TARGET, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(ref.logprobs.logprobs, abs=1e-5)
    assert lp.tokens == [tokenizer.decode([t]) for t in ref.token_ids]
    assert all(len(top) >= 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    stream = client.completions.create(model=TARGET, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=3,
                                       stream=True)
    streamed = [v for c in stream if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(client, tokenizer, plain):
    """lm-eval's loglikelihood: max_tokens 1, logprobs 1, echo true; the prompt's first token has no logprob."""
    ids = tokenizer.encode(PROMPT)
    ref = plain(ids, max_tokens=1, logprobs=1, prompt_logprobs=1)
    out = client.completions.create(model=TARGET, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True)
    choice = choice_ = out.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice_.logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:-1] == pytest.approx(ref.prompt_logprobs.logprobs, abs=1e-5)
    assert lp.token_logprobs[-1] == pytest.approx(ref.logprobs.logprobs[0], abs=1e-5)
    no_logprobs = client.completions.create(model=TARGET, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert no_logprobs.choices[0].text.startswith(PROMPT) and no_logprobs.choices[0].logprobs is None


def test_chat_logprobs_and_top_logprobs(client, tokenizer, plain):
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    ref = plain(tokenizer.encode(render(messages, add_generation_prompt=True)), max_tokens=16, logprobs=2)
    out = client.chat.completions.create(model=TARGET, messages=messages, max_tokens=16, temperature=0,
                                         logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(ref.logprobs.logprobs, abs=1e-5)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert content[0].bytes == list(content[0].token.encode())
    stream = client.chat.completions.create(model=TARGET, messages=messages, max_tokens=16, temperature=0,
                                            logprobs=True, stream=True)
    streamed = [e.logprob for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == pytest.approx(ref.logprobs.logprobs, abs=1e-5)


@pytest.mark.parametrize("fields", [
    {"frequency_penalty": 1.0, "presence_penalty": 0.5},
    {"repetition_penalty": 1.3},
    {"logit_bias": {"12": 5.0, "30": -100.0}, "min_tokens": 20},
])
def test_processors_through_the_api_keep_speculative_output_equal_plain(client, tokenizer, plain, fields):
    ids = tokenizer.encode(PROMPT)
    bias = tuple(sorted((int(k), v) for k, v in fields.get("logit_bias", {}).items()))
    params = {k: v for k, v in fields.items() if k != "logit_bias"} | {"logit_bias": bias}
    if "min_tokens" in params:
        params["stop_token_ids"] = tokenizer.eos_token_ids
    ref = plain(ids, max_tokens=32, **params)
    base = plain(ids, max_tokens=32)
    assert ref.token_ids != base.token_ids  # the processors really act on this prompt
    out = client.completions.create(model=TARGET, prompt=PROMPT, max_tokens=32, temperature=0, extra_body=fields)
    assert out.choices[0].text == tokenizer.decode(ref.token_ids)


def test_include_stop_str_in_output(client):
    base = client.completions.create(model=TARGET, prompt="import os\n", max_tokens=30, temperature=0, stop=["\n"])
    kept = client.completions.create(model=TARGET, prompt="import os\n", max_tokens=30, temperature=0, stop=["\n"],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == base.choices[0].text + "\n"


# Seeded sampling reproduces a sample only without speculation: with drafts, which uniforms a sample draws
# depends on the verify lengths, which follow the load (still exact in distribution, as the χ² tests check).
PLAIN = {"speculative": {"method": "none"}}


def test_n_samples_each_equal_the_request_with_seed_plus_j(client):
    body = {"model": TARGET, "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": 40, "extra_body": PLAIN}
    out = client.completions.create(**body, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    alone = [client.completions.create(**{**body, "seed": 40 + j}).choices[0].text for j in range(3)]
    assert [c.text for c in out.choices] == alone
    assert len(set(alone)) > 1  # really different samples
    assert out.usage.prompt_tokens == client.completions.create(**body).usage.prompt_tokens  # counted once
    greedy = client.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": "Hi"}], n=2,
                                            max_tokens=8, temperature=0)  # speculative: DSpark drafts
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_n_samples_stream_with_their_choice_index(client):
    body = {"model": TARGET, "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": 7, "n": 2,
            "extra_body": PLAIN}
    full = client.completions.create(**body)
    texts = ["", ""]
    for chunk in client.completions.create(**body, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in full.choices]


def test_best_of_returns_the_samples_with_the_highest_cumulative_logprob(client):
    body = {"model": TARGET, "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 11, "logprobs": 0,
            "extra_body": PLAIN}
    samples = [client.completions.create(**{**body, "seed": 11 + j}).choices[0] for j in range(4)]
    scores = [sum(c.logprobs.token_logprobs) for c in samples]
    best = client.completions.create(**body, n=2, best_of=4)
    ranked = sorted(range(4), key=lambda j: -scores[j])[:2]
    assert [c.text for c in best.choices] == [samples[j].text for j in ranked]
    assert [c.index for c in best.choices] == [0, 1]
    no_logprobs = client.completions.create(**{k: v for k, v in body.items() if k != "logprobs"}, best_of=4)
    assert no_logprobs.choices[0].text == samples[ranked[0]].text and no_logprobs.choices[0].logprobs is None
