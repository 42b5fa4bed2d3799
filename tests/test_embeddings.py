"""A drafter replica loads the target's embeddings only: the same tensors the whole target holds, and drafters
loaded next to them equal drafters loaded next to the whole target."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafter_worker.checkpoint import drafter_config, load_drafter
from services.checkpoint import save_model
from services.embeddings import TargetEmbeddings, load_embeddings
from services.errors import ModelLoadError
from services.loader import load_model
from services.registry import resolve_model

from .conftest import make_model


@pytest.mark.parametrize("tied", [False, True])
def test_the_embeddings_are_the_targets_tensors(tmp_path, tied):
    model = make_model()
    if tied:
        model.config = dataclasses.replace(model.config, tie_word_embeddings=True)
        model.lm_head.weight = model.model.embed_tokens.weight
    target = load_model(save_model(model, tmp_path / "m"), "float32")
    embeddings = load_embeddings(tmp_path / "m", "float32")
    assert torch.equal(embeddings.embed_tokens, target.model.embed_tokens.weight)
    assert torch.equal(embeddings.lm_head, target.lm_head.weight)
    assert (embeddings.lm_head is embeddings.embed_tokens) == tied
    assert embeddings.config == target.config and embeddings.dtype == torch.float32
    of = TargetEmbeddings.of(target)  # a loaded target's own tensors, not copies
    assert of.embed_tokens is target.model.embed_tokens.weight and of.lm_head is target.lm_head.weight
    assert TargetEmbeddings.of(embeddings) is embeddings


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_drafter_loaded_next_to_the_embeddings_is_the_one_loaded_next_to_the_target(dtype):
    """Every weight and the calibration equal: what the replica serves is what in-process generation serves."""
    target_dir = resolve_model("dspark-target")
    for method in ("dspark", "eagle3"):
        name = f"dspark-target-{method}"
        taps = drafter_config(resolve_model(name)).tap_layers
        whole, cal = load_drafter(name, load_model(target_dir, dtype, tap_layers=taps), dtype)
        alone, cal_alone = load_drafter(name, load_embeddings(target_dir, dtype), dtype)
        mine, theirs = whole.state_dict(), alone.state_dict()
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), method
        assert cal == cal_alone


def test_a_missing_or_misshaped_embedding_is_named(tmp_path):
    model_dir = save_model(make_model(), tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    save_file({**tensors, "lm_head.weight": tensors["lm_head.weight"][:-1]}, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"'lm_head.weight' has shape"):
        load_embeddings(model_dir)
    del tensors["model.embed_tokens.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.embed_tokens\.weight'"):
        load_embeddings(model_dir)
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_embeddings(tmp_path / "absent")
