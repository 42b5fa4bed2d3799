"""Our logits equal transformers' on tiny random checkpoints saved in Hugging Face layout."""

from __future__ import annotations

import pytest
import torch
import transformers

from services.loader import load_model
from tests.conftest import full_forward

COMMON = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True}),
    "llama-llama3-rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}, "rope_theta": 500000.0}),
    "llama-linear-rope-tied": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
}


def save_reference(tmp_path, case: str, shard: bool = False) -> torch.nn.Module:
    cfg_name, model_name, extra = CASES[case]
    config = getattr(transformers, cfg_name)(**COMMON, **extra)
    torch.manual_seed(0)
    ref = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # random everything, biases and norms included, so every tensor matters
        for name, p in ref.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    ref.save_pretrained(tmp_path, max_shard_size="40KB" if shard else "1GB")
    return ref


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case):
    ref = save_reference(tmp_path, case)
    ours = load_model(tmp_path, dtype="float32")
    ids = torch.randint(0, COMMON["vocab_size"], (48,))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    assert expected.abs().max() > 1.0  # the comparison is not between two near-zero tensors
    torch.testing.assert_close(full_forward(ours, ids).logits, expected, atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_loads(tmp_path):
    ref = save_reference(tmp_path, "qwen3", shard=True)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ours = load_model(tmp_path, dtype="float32")
    ids = torch.randint(0, COMMON["vocab_size"], (20,))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    torch.testing.assert_close(full_forward(ours, ids).logits, expected, atol=1e-4, rtol=1e-4)


def test_our_checkpoint_loads_in_transformers(tmp_path, tiny_model):
    from services.checkpoint import save_model

    save_model(tiny_model, tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, tiny_model.config.vocab_size, (30,))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    torch.testing.assert_close(full_forward(tiny_model, ids).logits, expected, atol=1e-4, rtol=1e-4)


def test_bf16_load_is_close(tmp_path):
    ref = save_reference(tmp_path, "llama")
    ours = load_model(tmp_path, dtype="bfloat16")
    assert ours.dtype == torch.bfloat16
    ids = torch.randint(0, COMMON["vocab_size"], (16,))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    got = full_forward(ours.float(), ids).logits  # bf16 weights, fp32 math: rounding of weights only
    assert (got - expected).abs().max() < 0.1 * expected.abs().max()
