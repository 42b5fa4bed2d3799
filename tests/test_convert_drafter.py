"""`dspark convert-drafter`: a released checkpoint rewritten in dspark's layout loads without format detection
and drafts exactly what the original drafts."""

from __future__ import annotations

import json

import pytest
import torch

from cli.main import main
from drafter_worker.checkpoint import drafter_config, load_drafter
from services.model import CausalLM
from tests.draft_formats import TAPS, D, save_target, tiny_target
from tests.test_drafter_formats import first_block as block_of
from tests.test_drafter_formats import write_deepspec
from tests.test_drafter_formats_eagle3 import first_block as chain_of
from tests.test_drafter_formats_eagle3 import write_eagle3


@pytest.fixture(scope="module")
def target() -> CausalLM:
    return tiny_target()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, target):
    path = tmp_path_factory.mktemp("target")
    return save_target(path, target)


@pytest.mark.parametrize("fmt", ["deepspec", "eagle3"])
def test_a_converted_drafter_drafts_what_the_original_drafts(tmp_path, target, target_dir, fmt):
    if fmt == "deepspec":
        write_deepspec(tmp_path / "src", target)
    else:
        write_eagle3(tmp_path / "src")
    assert main(["convert-drafter", str(tmp_path / "src"), str(tmp_path / "out"), "--target", str(target_dir),
                 "--dtype", "float32"]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dspark_drafter"]["tap_layers"] == list(TAPS)
    assert drafter_config(tmp_path / "out", "dspark").method == drafter_config(tmp_path / "src", "auto", 8).method
    original, _ = load_drafter(tmp_path / "src", target, "float32")
    converted, _ = load_drafter(tmp_path / "out", target, "float32", fmt="dspark")  # no detection
    g = torch.Generator().manual_seed(5)
    taps, ids = torch.randn(11, len(TAPS) * D, generator=g), torch.randint(4, 300, (12,), generator=g).tolist()
    draft = block_of if fmt == "deepspec" else chain_of
    a, b = draft(original, taps, ids), draft(converted, taps, ids)
    assert a.tokens == b.tokens and a.peaks == b.peaks and a.confidences == b.confidences
