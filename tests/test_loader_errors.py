"""Bad model directories fail with a message that names the problem."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.checkpoint import save_model
from services.errors import ModelLoadError
from services.loader import load_model


@pytest.fixture
def model_dir(tmp_path, tiny_model):
    return save_model(tiny_model, tmp_path / "m")


def _edit_config(model_dir, **changes):
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def _edit_tensors(model_dir, edit):
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_not_a_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_model(tmp_path / "absent")


def test_no_config(tmp_path):
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(tmp_path)


def test_unsupported_architecture(model_dir):
    _edit_config(model_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(model_dir)


def test_unsupported_rope(model_dir):
    _edit_config(model_dir, rope_parameters={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ModelLoadError, match="unsupported rope type 'yarn'"):
        load_model(model_dir)


def test_missing_field(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    del cfg["hidden_size"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="'hidden_size'"):
        load_model(model_dir)


def test_missing_tensor_is_named(model_dir):
    _edit_tensors(model_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model(model_dir)


def test_misshaped_tensor_is_named(model_dir):
    def shrink(t):
        t["model.norm.weight"] = torch.ones(3)

    _edit_tensors(model_dir, shrink)
    with pytest.raises(ModelLoadError, match=r"'model\.norm\.weight' has shape \(3,\), expected \(64,\)"):
        load_model(model_dir)


def test_unexpected_tensor_is_named(model_dir):
    def add(t):
        t["model.layers.0.self_attn.q_norm.weight"] = torch.ones(32)

    _edit_tensors(model_dir, add)
    with pytest.raises(ModelLoadError, match=r"q_norm\.weight"):
        load_model(model_dir)


def test_missing_shard(model_dir):
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002\.safetensors, which is missing"):
        load_model(model_dir)


def test_no_weights(model_dir):
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(model_dir)


def test_bad_tap_layer(model_dir):
    with pytest.raises(ValueError, match="tap layer 5"):
        load_model(model_dir, tap_layers=(5,))
