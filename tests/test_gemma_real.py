"""The real Gemma 3 270M (base), from the public GGUF that `make test` installs by pip (Gemma Terms of Use):
its config and tokenizer (BOS as the file says), fp32 greedy equal to transformers' on the same dequantized
weights, speculative equal to plain in bf16 and fp32, and the chat and completion paths of the API agreeing
on what the model sees."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from drafter_worker.ngram import NgramProposer
from in_process.generation import GenerationRequest, InProcessRouter
from router.scheduling.policy import Policy
from services.loader import load_model
from services.model_config import ModelConfig
from services.pip_models import PIP_MODELS
from services.registry import list_models, model_name, resolve_model
from services.tokenizer import TextTokenizer
from services.types import SamplingParams
from tests.conftest import make_engine

pytestmark = pytest.mark.slow
MODEL = "gemma-3-270m"
PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n\n",
           "<start_of_turn>user\nWhat is 12 + 30?<end_of_turn>\n<start_of_turn>model\n"]
TOKENS = 24


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model(MODEL)


@pytest.fixture(scope="module")
def tok(model_dir):
    return TextTokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def fp32(model_dir):
    return load_model(model_dir, "float32")


def _greedy(model, prompts: list[list[int]], proposer=None) -> list[list[int]]:
    engine = make_engine(model, num_slots=4, max_len=128, max_batch_tokens=64)
    requests = [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=TOKENS)) for i, p in enumerate(prompts)]
    router = InProcessRouter(engine, proposer, Policy.FIXED, 5) if proposer else InProcessRouter(engine)
    return [r.token_ids for r in router.generate(requests)]


def test_listed_installed_and_checked(model_dir):
    entry = {e.name: e for e in list_models()}[MODEL]
    assert entry.kind == "target" and entry.path == str(model_dir) and 260e6 < entry.parameters < 280e6
    assert model_dir.name == PIP_MODELS[MODEL].sha256 and model_name(MODEL) == MODEL
    cfg = ModelConfig.from_dir(model_dir)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.vocab_size) == (18, 640, 4, 1, 256, 262_144)
    assert cfg.tie_word_embeddings and cfg.gemma.sliding_window == 512
    assert cfg.gemma.sliding_layers == tuple((i + 1) % 6 != 0 for i in range(18))


def test_the_tokenizer_adds_the_bos_the_file_asks_for(model_dir, tok):
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    for text in PROMPTS:
        assert tok.encode(text) == hf(text).input_ids and tok.encode(text)[0] == 2
    assert tok.encode("def fibonacci(n):") == [2, 2063, 10779, 78113, 236769, 236749, 1473]
    assert tok.eos_token_ids == (1,)
    chat = tok.chat_ids([{"role": "user", "content": "What is 12 + 30?"}])
    assert chat == tok.encode(PROMPTS[3]) and chat.count(2) == 1


def test_fp32_greedy_equals_transformers(model_dir, tok, fp32):
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    prompts = [tok.encode(p) for p in PROMPTS]
    ours = _greedy(fp32, prompts)
    for ids, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = ref.generate(torch.tensor([ids]), max_new_tokens=TOKENS, do_sample=False, eos_token_id=None)
        assert got == out[0, len(ids):].tolist()
    assert "return" in tok.decode(ours[0])  # with its BOS the model continues the function (without: garbage)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_greedy_equals_plain(model_dir, tok, fp32, dtype):
    model = fp32 if dtype == "float32" else load_model(model_dir, dtype)
    prompts = [tok.encode(p) for p in PROMPTS]
    assert _greedy(model, prompts, NgramProposer()) == _greedy(model, prompts)


@pytest.mark.parametrize("method", ["dspark", "eagle3"])
def test_a_draft_vocabulary_drafter_for_gemma_is_lossless_as_served(model_dir, tok, method):
    """A fresh Gemma drafter as training builds it (Llama layers the CPU kernels serve, a draft vocabulary with the
    target's head rows shared, the Markov head over it): plain greedy output through the engine, drafts inside,
    in the dtype served here (bf16 where it is native; the shipped drafters are checked in both dtypes:
    tests/test_gemma_drafters.py)."""
    from drafter_worker.checkpoint import build_draft_model
    from drafter_worker.config import default_config
    from drafter_worker.drafter import Drafter
    from training.draft_vocab import frequency_d2t

    model = load_model(model_dir, "auto", tap_layers=(1, 9, 16))
    prompts = [tok.encode(p) for p in PROMPTS]
    plain = _greedy(model, prompts)
    counts = torch.zeros(model.config.vocab_size)
    counts[torch.tensor([t for ids in plain for t in ids])] = 1.0  # the target's own output, among 4,096 ids
    d2t = frequency_d2t(counts + torch.rand(model.config.vocab_size) * 0.5, 4096)
    torch.manual_seed(0)
    drafter = build_draft_model(default_config(method, MODEL, (1, 9, 16), 4, "markov", len(d2t)), model, d2t=d2t)
    assert drafter.config.architecture == "LlamaForCausalLM" and drafter.shares_head
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad and p.dim() >= 2:
                p.normal_(0.0, 0.02)
    proposer = Drafter(drafter.eval())
    from services import cpu_kernels

    assert proposer.fused or not cpu_kernels.available(model.dtype), "the CPU serving kernels, where they run"
    assert _greedy(model, prompts, proposer) == plain


def test_the_api_agrees_on_what_the_model_sees(tok):
    """Text and token-id prompts, echo and prompt logprobs, chat and /tokenize: one BOS, counted in usage."""
    import httpx
    import openai

    from cluster.launcher import start_tiers
    from router.settings import RouterSettings
    from tests.tiers import api_server, verifier_settings

    (verifier,) = start_tiers([("verifier", verifier_settings(model=MODEL, dtype="auto", max_len=256))])
    try:
        settings = RouterSettings(model=MODEL, verifier=verifier.address, method="none", max_model_len=256)
        with api_server(settings) as (url, _):
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            ids = tok.encode("def fibonacci(n):")
            text = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=8, temperature=0)
            by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
            assert text.choices[0].text == by_ids.choices[0].text and "if" in text.choices[0].text
            assert text.usage.prompt_tokens == by_ids.usage.prompt_tokens == len(ids) == 7
            echo = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=2, temperature=0,
                                             echo=True, logprobs=1)
            assert echo.choices[0].text.startswith("def fibonacci(n):")  # the BOS is not text
            assert len(echo.choices[0].logprobs.token_logprobs) == 7 + 2
            assert echo.choices[0].logprobs.token_logprobs[0] is None  # nothing predicts the BOS
            messages = [{"role": "user", "content": "What is 12 + 30?"}]
            chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
            assert chat.usage.prompt_tokens == len(tok.chat_ids(messages))
            tokens = httpx.post(url + "/tokenize", json={"messages": messages}).json()["tokens"]
            assert tokens == tok.chat_ids(messages) and tokens.count(2) == 1
            bare = httpx.post(url + "/tokenize", json={"prompt": "def fibonacci(n):", "add_special_tokens": False})
            assert bare.json()["tokens"] == ids[1:]
    finally:
        verifier.stop()


def test_eval_prompts_in_dspark_turns_are_rendered_in_gemmas_template(tmp_path, tok):
    """The eval sets are written in dspark's turn format; a Gemma target sees them in its own."""
    from services.chat_template import parse, render
    from training.eval.report import read_prompts

    messages = [{"role": "user", "content": "What does the class Action in the argparse module do?"}]
    text = render(messages, add_generation_prompt=True)
    assert parse(text) == messages and parse("def fibonacci(n):") is None
    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": text}) + "\n" +
                                        json.dumps({"prompt": "def fibonacci(n):"}) + "\n")
    chat, code = read_prompts(tmp_path, "chat", 2, tok)
    assert chat == tok.chat_ids(messages) and tok.token_text(chat[1]) == "<start_of_turn>"
    assert code == tok.encode("def fibonacci(n):") and code[0] == 2  # the BOS, then the text as it is
    toy = TextTokenizer.from_dir(resolve_model("dspark-target-v2"))
    assert read_prompts(tmp_path, "chat", 1, toy) == [toy.encode(text)]  # dspark's own targets: unchanged
