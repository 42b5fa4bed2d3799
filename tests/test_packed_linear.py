"""The CPU serving path's linears (services/packed_linear.py, services/cpu_kernels.py): the project's kernel
and oneDNN on packed weights each give a row the same bits at any row count, in bf16 and fp32; oneDNN's bf16
bits are `F.linear`'s; a prepared model keeps its parameters, names and ties, drops the packing when copied,
and runs unpacked once a weight changes; a compiled graph gives the eager bits."""

from copy import deepcopy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services import cpu_kernels
from services.layers import RaggedLayout
from services.packed_linear import PackedLinear, linear, pack, pack_linears
from tests.conftest import make_model

SHAPES = [(48, 80), (96, 32), (64, 520), (70, 24)]  # (in, out); 70: a tail of K % 8 values


@pytest.fixture(params=["kernel", "onednn"])
def way(request, monkeypatch):
    """Which way `pack` chooses: the project's kernel (skipped where this CPU or build has none) or oneDNN."""
    if request.param == "onednn":
        monkeypatch.setattr(cpu_kernels, "linear_available", lambda dtype: False)
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_has_the_same_bits_at_any_row_count(dtype, shape, way):
    if way == "kernel" and not cpu_kernels.linear_available(dtype):
        pytest.skip(f"no CPU kernel for {dtype} here")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape[1], shape[0], generator=g).to(dtype)
    packed = pack(w)
    if packed is None:
        pytest.skip("oneDNN cannot pack on this build")
    assert packed.kernel == (way == "kernel")
    x = torch.randn(150, shape[0], generator=g).to(dtype)
    one_by_one = torch.cat([linear(x[i : i + 1], w, None, packed) for i in range(150)])
    # the kernel's fp32 tiles change at 8 rows and at chunks of 64 (services/kernels/linear.cpp: avx2_outputs)
    for rows in (2, 3, 7, 8, 16, 17, 33, 64, 65, 150):
        assert torch.equal(linear(x[:rows], w, None, packed), one_by_one[:rows]), rows
    assert torch.allclose(one_by_one.float(), F.linear(x, w).float(), rtol=2e-2, atol=6e-2)
    if dtype == torch.bfloat16 and way == "onednn":
        assert torch.equal(one_by_one, F.linear(x, w))


@pytest.mark.skipif(not cpu_kernels.linear_available(torch.bfloat16), reason="no bf16 CPU kernel here")
def test_the_kernel_rounds_its_fp32_sum_as_torch_does():
    """Each output is a fp32 dot product rounded to bf16 once (nearest even): within one bf16 step of the exact
    sum, and exactly torch's rounding of the kernel's own fp32 result where that is exact."""
    g = torch.Generator().manual_seed(1)
    x, w = (torch.randint(-8, 9, shape, generator=g).to(torch.bfloat16) for shape in ((5, 70), (9, 70)))
    exact = (x.double() @ w.double().T)  # small integers: every partial sum is exact in fp32
    assert torch.equal(cpu_kernels.linear(x, w, None), exact.to(torch.bfloat16))


def test_pack_linears_keeps_parameters_names_and_ties(way):
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


def test_a_weight_changed_after_packing_runs_unpacked(way):
    lin = nn.Linear(16, 8).to(torch.bfloat16)
    if pack_linears(lin) == 0:
        pytest.skip("oneDNN cannot pack on this build")
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.mul_(2)
    assert not lin.packed.current(lin.weight)
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


def test_a_packed_target_gives_the_unpacked_logits_in_bf16(way):
    """oneDNN's packed GEMM gives F.linear's bits; the kernel sums in another order, so its bits are its own and
    only close (what the fused step's own tests then pin down)."""
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
    if way == "kernel":
        torch.testing.assert_close(packed, plain, atol=0.1, rtol=0.05)
    else:
        assert torch.equal(plain, packed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_compiled_graph_gives_the_eager_bits(dtype, way):
    """Bit for bit, except oneDNN weights in fp32: a compiled graph traces F.linear for them, MKL's fp32 bits and
    not the packed GEMM's (then close)."""
    w = torch.randn(40, 24).to(dtype)
    packed = pack(w)
    if packed is None:
        pytest.skip("oneDNN cannot pack on this build")
    fn = torch.compile(lambda x: torch.relu(linear(x, w, None, packed)), dynamic=True, fullgraph=True)
    x = torch.randn(5, 24).to(dtype)
    with torch.inference_mode():
        compiled, eager = fn(x), torch.relu(linear(x, w, None, packed))
    if way == "onednn" and dtype == torch.float32:
        torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    else:
        assert torch.equal(compiled, eager)


def test_a_build_killed_mid_way_does_not_hold_the_next_one(tmp_path, monkeypatch):
    """torch's loader waits while its lock file exists; one left by a killed build goes under the kernel lock."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with cpu_kernels._build_lock() as directory:
        (directory / "lock").touch()  # what a build killed mid-way leaves
    with cpu_kernels._build_lock() as again:
        assert again == directory and not (again / "lock").exists()
    assert directory.parent.parent == tmp_path and directory.name.startswith("dspark_cpu_kernels-")
