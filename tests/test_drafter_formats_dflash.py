"""z-lab DFlash (`DFlashDraftModel`, fill-in layout) and SpecForge DSpark (`DSparkDraftModel`) checkpoints,
without downloads, against the reference block of `tests/test_drafter_formats.py` (fill-in: B slots give
B − 1 drafts, each slot predicting its own position)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from drafter_worker.checkpoint import drafter_config, load_drafter
from services.errors import ModelLoadError
from services.model import CausalLM
from tests.draft_formats import (
    BLOCK,
    DRAFT_LAYERS,
    LAYERS,
    MASK,
    RANK,
    TAPS,
    TARGET_CONFIG,
    assert_greedy_is_plain,
    context,
    tiny_target,
)
from tests.test_drafter_formats import deepspec_tensors, first_block, reference_block


@pytest.fixture(scope="module")
def target() -> CausalLM:
    return tiny_target()


def write(path, target, arch="DFlashDraftModel", nested=True, **extra) -> dict[str, torch.Tensor]:
    """B = BLOCK + 1 slots (fill-in: BLOCK drafts); no embedding, no LM head; drafter fields in dflash_config."""
    path.mkdir(parents=True, exist_ok=True)
    markov = arch == "DSparkDraftModel"
    tensors = deepspec_tensors(target, markov)
    shipped = {k: tensors.pop(k) for k in ("embed_tokens.weight", "lm_head.weight")}  # the target's
    fields = {"mask_token_id": MASK, "target_layer_ids": list(TAPS), **extra}
    if markov:
        fields |= {"markov_rank": RANK, "enable_confidence_head": True, "confidence_head_with_markov": True,
                   "markov_head_type": "vanilla", "projector_type": "dspark"}
    config = {**TARGET_CONFIG, "architectures": [arch], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
              "num_hidden_layers": DRAFT_LAYERS, "num_target_layers": LAYERS, "block_size": BLOCK + 1,
              **({"dflash_config": fields} if nested else fields)}
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return tensors | shipped


@pytest.mark.parametrize("nested", [True, False], ids=["dflash_config", "top-level"])
def test_zlab_dflash_fill_in_block_matches_the_reference(tmp_path, target, nested):
    tensors = write(tmp_path / "z", target, nested=nested)
    cfg = drafter_config(tmp_path / "z", "auto", LAYERS)
    assert (str(cfg.method), cfg.layout, cfg.block_size, cfg.tap_layers) == ("dflash", "fill_in", BLOCK, TAPS)
    model, _ = load_drafter(tmp_path / "z", target, "float32")
    taps, ids = context()
    block = first_block(model, taps, ids)
    tokens, peaks, _ = reference_block(tensors, taps, ids[-1], markov=False, fill_in=True)
    assert block.tokens == tokens
    torch.testing.assert_close(torch.tensor(block.peaks), torch.tensor(peaks), atol=1e-5, rtol=1e-5)


def test_the_wrong_layout_fails_the_reference(tmp_path, target):
    """The same tensors read in the anchor layout draft something else: the parity test sees the layout."""
    tensors = write(tmp_path / "z", target, sample_from_anchor=True)
    model, _ = load_drafter(tmp_path / "z", target, "float32")
    taps, ids = context()
    _, peaks, _ = reference_block(tensors, taps, ids[-1], markov=False, fill_in=True)
    assert not torch.allclose(torch.tensor(first_block(model, taps, ids).peaks), torch.tensor(peaks), atol=1e-5)


def test_specforge_dspark_reads_its_layout_from_sample_from_anchor(tmp_path, target):
    tensors = write(tmp_path / "s", target, "DSparkDraftModel", sample_from_anchor=False)
    model, _ = load_drafter(tmp_path / "s", target, "float32")
    taps, ids = context()
    block = first_block(model, taps, ids)
    tokens, peaks, conf = reference_block(tensors, taps, ids[-1], markov=True, fill_in=True)
    assert block.tokens == tokens
    torch.testing.assert_close(torch.tensor(block.peaks), torch.tensor(peaks), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(block.confidences), torch.tensor(conf), atol=1e-5, rtol=1e-5)
    write(tmp_path / "u", target, "DSparkDraftModel")
    with pytest.raises(ModelLoadError, match="sample_from_anchor"):
        load_drafter(tmp_path / "u", target, "float32")


def test_without_layer_ids_the_zlab_default_taps_apply(tmp_path, target):
    write(tmp_path / "z", target)
    config = json.loads((tmp_path / "z" / "config.json").read_text())
    del config["dflash_config"]["target_layer_ids"]
    (tmp_path / "z" / "config.json").write_text(json.dumps(config))
    assert drafter_config(tmp_path / "z", "auto", 36).tap_layers == (1, 33)  # round(1 + i·(36−4)/(2−1))


def test_greedy_with_a_fill_in_drafter_is_plain_greedy(tmp_path, target):
    write(tmp_path / "z", target)
    assert_greedy_is_plain(target, load_drafter(tmp_path / "z", target, "float32")[0], BLOCK)
