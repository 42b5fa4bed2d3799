"""A `.gguf` file as `--model`: dequantized once by transformers into a cached directory keyed by the file's
sha256, logits equal transformers' reading of the same file, tokenizer and chat template from its metadata;
architectures and tensor types it cannot serve refused by name; damaged files refused with nothing cached."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from services import gguf
from services.errors import ModelLoadError
from services.loader import load_model
from services.registry import model_name, resolve_model
from services.tokenizer import TextTokenizer
from tests.conftest import full_forward
from tests.gguf_files import write_gemma


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(root))
    return root / "gguf"


@pytest.mark.parametrize("tensor_type", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q5_1"])
def test_logits_equal_transformers_reading_the_same_file(tmp_path, tensor_type):
    path = write_gemma(tmp_path / f"tiny-{tensor_type}.gguf", tensor_type)
    model_dir = resolve_model(path)
    assert json.loads((model_dir / "source.json").read_text())["sha256"] == gguf.sha256_file(path)
    assert model_name(path) == f"tiny-{tensor_type}"
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    ours = load_model(model_dir, "float32")
    ids = torch.randint(0, ours.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(full_forward(ours, ids).logits, expected, atol=1e-4, rtol=1e-4)


def test_tokenizer_bos_and_chat_template_come_from_the_metadata(tmp_path):
    path = write_gemma(tmp_path / "tiny.gguf")
    tok = TextTokenizer.from_dir(resolve_model(path))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    text = "def the(n): return a"
    assert tok.encode(text) == hf(text).input_ids and tok.encode(text)[0] == 2 == tok.bos_token_id
    assert tok.encode(text, add_special_tokens=False) == tok.encode(text)[1:]
    assert tok.eos_token_ids == (1,)
    chat = [{"role": "user", "content": "the"}]
    assert tok.render_chat(chat) == "<bos><start_of_turn>user\nthe<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.chat_ids(chat)
    assert ids.count(2) == 1 and ids[0] == 2  # the template writes the BOS; the rule adds no second one


def test_the_second_resolve_reads_the_cache(tmp_path, monkeypatch, cache):
    path = write_gemma(tmp_path / "tiny.gguf")
    first = resolve_model(path)

    def refuse(*_):
        raise AssertionError("converted twice")
    monkeypatch.setattr(gguf, "_convert", refuse)
    assert resolve_model(path) == first
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [first.name]


def test_unserved_architecture_is_refused_by_name(tmp_path, cache):
    path = write_gemma(tmp_path / "phi.gguf", arch="phi3")
    with pytest.raises(ModelLoadError, match="architecture 'phi3' is not served"):
        resolve_model(path)
    assert not any(p.is_dir() for p in cache.iterdir())


def test_unsupported_tensor_type_is_refused_by_name(tmp_path, cache):
    path = write_gemma(tmp_path / "iq.gguf", odd_type="IQ2_XXS")
    with pytest.raises(ModelLoadError, match="tensor type IQ2_XXS is not supported"):
        resolve_model(path)
    assert not any(p.is_dir() for p in cache.iterdir())


@pytest.mark.parametrize("damage", ["truncated", "header", "nan"])
def test_a_damaged_file_is_refused_and_nothing_is_cached(tmp_path, cache, damage):
    path = write_gemma(tmp_path / "tiny.gguf", "F32")
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) * 2 // 3]
    elif damage == "header":
        data[:4] = b"XXXX"
    else:  # the last tensor (output_norm, F32) is the file's tail: NaNs there
        data[-16:] = b"\xff" * 16
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"tiny\.gguf"):
        resolve_model(path)
    assert not any(p.is_dir() for p in cache.iterdir())


def test_a_pip_model_with_the_wrong_digest_is_refused(tmp_path):
    path = write_gemma(tmp_path / "tiny.gguf")
    with pytest.raises(ModelLoadError, match=r"expected 0{64}"):
        gguf.materialize(path, sha256="0" * 64)


def test_a_missing_gguf_file_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="no such GGUF file"):
        resolve_model(tmp_path / "absent.gguf")
