"""Bad input against the real HTTP API (tier processes, uvicorn, httpx): hypothesis-generated requests and
schemathesis over the app's own OpenAPI schema. Whatever arrives, the answer is a 2xx or an OpenAI-shaped
4xx, never a 5xx; after every test nothing is left running and a greedy completion gives the same text."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from router.settings import RouterSettings
from tests.tiers import TARGET, api_server, tier_pair

KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 64  # a request without max_tokens generates up to the context: keep that short
SHORT = 8  # max_tokens of the requests that get through, so hundreds of them run in seconds
POSTS = ("/v1/completions", "/v1/chat/completions")
SIDE_POSTS = ("/tokenize", "/detokenize")  # vLLM's side routes: schema-fuzzed, not shaped
CAP = 4 * 2**20  # ApiConfig's default body cap
# The server is module-scoped; the autouse check after each test runs once, after all its examples.
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Any JSON value, lone surrogates (legal as JSON escapes) and NaN/Infinity (which Python's parser takes) included.
TEXT = st.text(st.characters(exclude_categories=()), max_size=12)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                    max_leaves=10)

SPECULATIVE = st.sampled_from([{}, {"method": "none"}, {"gamma": 2}, {"method": "eagle3", "gamma": 4},
                               {"method": "dspark", "policy": "dspark", "min_tokens_per_s": 5.0}])
SAMPLING = {"temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 40),
            "seed": st.integers(0, 2**63 - 1), "n": st.just(1), "logprobs": st.sampled_from([None, False]),
            "stop": st.lists(st.text("abc\n ", min_size=1, max_size=4), max_size=4),
            "stop_token_ids": st.lists(st.integers(1, 8000), max_size=4), "ignore_eos": st.booleans(),
            "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
            "speculative": SPECULATIVE}
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                 "content": st.text(max_size=30)})
VALID = {
    "/v1/completions": st.fixed_dictionaries(
        {"model": st.just(TARGET), "prompt": st.text(min_size=1, max_size=30) | st.lists(st.integers(1, 8000),
                                                                                          min_size=1, max_size=12),
         "max_tokens": st.integers(1, SHORT)}, optional=SAMPLING),
    "/v1/chat/completions": st.fixed_dictionaries(
        {"model": st.just(TARGET), "messages": st.lists(MESSAGE, min_size=1, max_size=3),
         "max_tokens": st.integers(1, SHORT)}, optional={**SAMPLING, "max_completion_tokens": st.integers(1, SHORT)}),
}
# Wrong types and out-of-range values, field by field.
HUGE = st.integers(min_value=2**31) | st.integers(max_value=-(2**31))
BAD = {
    "model": TEXT | JSON,
    "prompt": st.just("") | st.just([]) | st.lists(st.integers(), min_size=1, max_size=4) | TEXT | JSON,
    "messages": st.just([]) | st.lists(st.fixed_dictionaries({"role": TEXT | JSON, "content": TEXT | JSON}),
                                       max_size=3) | JSON,
    "max_tokens": st.integers(max_value=0) | st.integers(min_value=MAX_MODEL_LEN) | st.floats() | TEXT
    | st.integers(1, SHORT).map(str) | st.just(True),  # strict types: "8" is not 8, nor true 1
    "max_completion_tokens": st.integers(max_value=0) | HUGE | JSON,
    "temperature": st.floats() | HUGE | TEXT | st.floats(0, 2).map(str), "top_p": st.floats() | HUGE | TEXT,
    "top_k": HUGE | JSON,
    "seed": HUGE | JSON, "n": st.integers() | JSON, "logprobs": st.integers(-1, 6) | st.just(True) | JSON,
    "top_logprobs": st.integers(-1, 6) | JSON,
    "stop": st.just("") | st.text(min_size=257, max_size=300) | st.lists(st.text(max_size=3), min_size=17,
                                                                         max_size=20) | JSON,
    "stop_token_ids": st.lists(st.integers(), min_size=1, max_size=4) | st.lists(st.just(1), min_size=65,
                                                                                 max_size=70) | JSON,
    "stream": JSON, "stream_options": JSON, "ignore_eos": JSON,
    "speculative": JSON | st.fixed_dictionaries({}, optional={"method": TEXT | JSON, "policy": TEXT | JSON,
                                                               "gamma": st.integers() | JSON,
                                                               "min_tokens_per_s": st.floats() | JSON}),
}


@st.composite
def shaped_bodies(draw, path: str) -> dict:
    """A valid request with up to three fields spoiled and a few unknown fields added (which are ignored)."""
    body = draw(VALID[path])
    for field in draw(st.lists(st.sampled_from(sorted(BAD)), max_size=3, unique=True)):
        body[field] = draw(BAD[field])
    extras = draw(st.dictionaries(TEXT.filter(lambda k: k not in BAD and k not in SAMPLING), JSON, max_size=2))
    return {**extras, **body}


@pytest.fixture(scope="module")
def tiers():
    with tier_pair() as addresses:
        yield addresses


@pytest.fixture(scope="module")
def api(tiers):
    settings_ = RouterSettings(verifier=tiers[0], drafter=tiers[1], api_key=[KEY], max_model_len=MAX_MODEL_LEN)
    with api_server(settings_) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(api):
    with httpx.Client(base_url=api, timeout=60) as c:
        yield c


def _greedy(client: httpx.Client) -> str:
    body = {"model": TARGET, "prompt": "def fibonacci(n):", "max_tokens": SHORT, "temperature": 0}
    r = client.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _in_flight(client: httpx.Client) -> float:
    families = text_string_to_metric_families(client.get("/metrics").text)
    return sum(s.value for f in families if f.name in ("dspark:num_requests_running", "dspark:num_requests_waiting")
               for s in f.samples)


@pytest.fixture(scope="module")
def greedy(client) -> str:
    return _greedy(client)


@pytest.fixture(autouse=True)
def still_serving(client, greedy):
    yield
    deadline = time.monotonic() + 10  # a finished stream's bookkeeping may trail its last chunk
    while _in_flight(client) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _in_flight(client) == 0
    assert _greedy(client) == greedy


def check_answer(r: httpx.Response) -> None:
    """A 2xx (a stream ending in [DONE]), or a 4xx carrying OpenAI's error object."""
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        assert [line for line in r.text.splitlines() if line.startswith("data:")][-1] == "data: [DONE]", r.text


def post_json(client: httpx.Client, path: str, body) -> httpx.Response:
    # json.dumps rather than httpx's json=: it escapes lone surrogates and writes NaN and Infinity
    return client.post(path, content=json.dumps(body).encode(), headers={**AUTH, "content-type": "application/json"})


@FUZZ
@given(path=st.sampled_from(POSTS), body=JSON)
def test_arbitrary_json_bodies_are_rejected_cleanly(client, path, body):
    check_answer(post_json(client, path, body))


@FUZZ
@given(data=st.data(), path=st.sampled_from(POSTS))
def test_valid_shaped_bodies_with_wrong_values(client, data, path):
    body = data.draw(shaped_bodies(path))
    r = post_json(client, path, body)
    check_answer(r)
    assert r.status_code in (200, 400), r.text
    if isinstance(body.get("max_tokens"), str | bool):
        assert r.status_code == 400


def _truncated(body: dict) -> st.SearchStrategy[bytes]:
    text = json.dumps(body).encode()
    return st.integers(0, len(text) - 1).map(lambda n: text[:n])


RAW = (st.binary(max_size=64) | VALID["/v1/completions"].flatmap(_truncated)
       | st.binary(min_size=1, max_size=8).map(lambda b: b'{"model": "' + b"\xff" + b + b'", "prompt": "x"}'))
CONTENT_TYPES = st.sampled_from([None, "application/json", "application/json; charset=latin-1", "text/plain",
                                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "x/y;;"])


@FUZZ
@given(path=st.sampled_from(POSTS), content=RAW, content_type=CONTENT_TYPES)
def test_undecodable_bodies_and_content_types_are_a_400(client, path, content, content_type):
    headers = AUTH if content_type is None else {**AUTH, "content-type": content_type}
    r = client.post(path, content=content, headers=headers)
    check_answer(r)
    assert r.status_code == 400


# Header bytes h11 lets through: no control characters, no surrounding whitespace.
HEADER = st.binary(max_size=40).map(lambda b: bytes(c for c in b if c == 9 or 32 <= c != 127).strip())
AUTHORIZATION = st.one_of(
    st.none(), HEADER, HEADER.map(lambda b: (b"Bearer " + b).strip()),
    st.sampled_from([f"Bearer {KEY}", f"bearer {KEY}", KEY, f"Bearer  {KEY}", f"Bearer {KEY}x", f"Basic {KEY}",
                     f"Bearer {KEY[:-1]}", "Bearer"]).map(str.encode))


@FUZZ
@given(path=st.sampled_from(["/v1/models", *POSTS, "/health", "/version"]), authorization=AUTHORIZATION)
def test_only_the_exact_bearer_key_opens_v1(client, path, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    r = client.request("POST" if path in POSTS else "GET", path, headers=headers)
    check_answer(r)
    if not path.startswith("/v1"):
        assert r.status_code == 200
    elif authorization != f"Bearer {KEY}".encode():
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    else:
        assert r.status_code == (400 if path in POSTS else 200)  # an empty body is bad input, after auth


PATHS = st.sampled_from(["/v1/models", *POSTS, "/health", "/metrics", "/version", "/v1", "/v1/", "/"]) | st.text(
    "abcv1-._~/", max_size=16).map(lambda p: "/" + p.lstrip("/"))  # "//x" would name a host


@FUZZ
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]), path=PATHS)
def test_unknown_paths_and_methods_are_openai_shaped(client, method, path):
    r = client.request(method, path, headers=AUTH)
    check_answer(r)


def test_oversized_bodies_are_a_413_before_they_are_read(client):
    big = json.dumps({"model": TARGET, "prompt": "x" * CAP}).encode()
    chunks = (big[i:i + 2**16] for i in range(0, len(big), 2**16))  # no Content-Length: the count decides
    for r in (client.post("/v1/completions", content=big, headers=AUTH),
              client.post("/v1/chat/completions", content=chunks, headers=AUTH)):
        check_answer(r)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert client.post("/v1/completions", content=big).status_code == 401  # the key is checked first
    almost = {"model": TARGET, "prompt": "x" * (CAP - 100)}
    r = client.post("/v1/completions", json=almost, headers=AUTH)  # under the cap: refused by length, untokenized
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.fixture(scope="module")
def openapi(api):
    return schemathesis.openapi.from_url(api + "/openapi.json")


OPERATIONS = [*(("POST", p, mode) for p in POSTS + SIDE_POSTS for mode in GenerationMode),
              *(("GET", p, GenerationMode.POSITIVE) for p in ("/v1/models", "/health", "/metrics", "/version",
                                                              "/server_info"))]


def test_the_schema_lists_every_route(openapi):
    assert {(o.ok().method.upper(), o.ok().path) for o in openapi.get_all_operations()} == {o[:2] for o in OPERATIONS}


def _servable(body: dict) -> None:
    """Name the served model (any string is valid to the schema, only one is served) and keep max_tokens short
    (unset, it means all the room left); both are edits within the schema, so a negative case stays negative."""
    if isinstance(body.get("model"), str):
        body["model"] = TARGET
    if body.get("max_tokens") is None:
        body["max_tokens"] = SHORT
    for field in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(field), int) and body[field] > SHORT:
            body[field] = SHORT


@pytest.mark.parametrize("method, path, mode", OPERATIONS)
def test_every_operation_answers_as_its_schema_says(openapi, api, method, path, mode):
    # schemathesis.pytest.from_fixture would do this, but its node-id handling predates pytest 9.2
    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=openapi[path][method].as_strategy(generation_mode=mode))
    def check(case):
        if isinstance(case.body, dict):
            _servable(case.body)
        case.call_and_validate(base_url=api, headers=AUTH, checks=[
            not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
            negative_data_rejection])

    check()
