"""Linears on oneDNN-packed weights (services/packed_linear.py): the same bits for a row at any row count,
bf16's bits equal to `F.linear`'s, a packed model's logits equal to the unpacked one's in bf16, and the
compiled graph traces the plain linear (its freezing packs)."""

from copy import deepcopy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.layers import RaggedLayout
from services.packed_linear import PackedLinear, linear, pack, pack_linears
from tests.conftest import make_model

SHAPES = [(48, 80), (96, 32), (64, 520)]  # (in, out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_has_the_same_bits_at_any_row_count(dtype, shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape[1], shape[0], generator=g).to(dtype)
    packed = pack(w)
    if packed is None:
        pytest.skip("oneDNN cannot pack on this build")
    x = torch.randn(33, shape[0], generator=g).to(dtype)
    one_by_one = torch.cat([linear(x[i : i + 1], w, None, packed) for i in range(33)])
    for rows in (2, 3, 7, 8, 16, 17, 33):
        assert torch.equal(linear(x[:rows], w, None, packed), one_by_one[:rows]), rows
    assert torch.allclose(one_by_one.float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)
    if dtype == torch.bfloat16:
        assert torch.equal(one_by_one, F.linear(x, w))


def test_pack_linears_keeps_parameters_names_and_ties():
    model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 16, bias=False)).to(torch.bfloat16)
    model[2].weight = nn.Parameter(model[0].weight.t().contiguous())
    names = list(model.state_dict())
    weight = model[0].weight
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    with torch.inference_mode():
        before = model(x)
        packed = pack_linears(model)
        after = model(x)
    if packed == 0:
        pytest.skip("oneDNN cannot pack on this build")
    assert packed == 2 and isinstance(model[0], PackedLinear) and model[0].weight is weight
    assert list(model.state_dict()) == names
    assert torch.equal(before, after)
    copy = deepcopy(model).float()  # a copy drops the packed weights; converting it works
    assert copy[0].packed is None and torch.allclose(copy(x.float()), after.float(), atol=0.05)


def test_a_weight_changed_after_packing_runs_unpacked():
    lin = nn.Linear(16, 8).to(torch.bfloat16)
    if pack_linears(lin) == 0:
        pytest.skip("oneDNN cannot pack on this build")
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.mul_(2)
    assert lin.packed.of(lin.weight) is None
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


def test_a_packed_target_gives_the_unpacked_logits_in_bf16():
    model = make_model().to(torch.bfloat16)
    cfg = model.config
    k = torch.zeros(cfg.num_hidden_layers, 2, cfg.num_key_value_heads, 64, cfg.head_dim, dtype=torch.bfloat16)
    ids = torch.randint(1, cfg.vocab_size, (7,))
    args = (ids, torch.arange(7), RaggedLayout([0], [0], [7]))
    with torch.inference_mode():
        for layer in model.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        plain = model(*args, k.clone(), k.clone(), torch.arange(7)).logits
        model.prepare_for_serving()
        packed = model(*args, k.clone(), k.clone(), torch.arange(7)).logits
    assert torch.equal(plain, packed)


def test_a_compiled_graph_traces_the_plain_linear():
    w = torch.randn(40, 24, dtype=torch.bfloat16)
    packed = pack(w)
    if packed is None:
        pytest.skip("oneDNN cannot pack on this build")
    fn = torch.compile(lambda x: torch.relu(linear(x, w, None, packed)), dynamic=True, fullgraph=True)
    x = torch.randn(5, 24, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(fn(x), torch.relu(linear(x, w, None, packed)))
