"""The AMX bf16 linear (services/kernels/amx.cpp): a row's bits do not depend on how many rows share the call
or on which tile they land in, outputs agree with a fp32 reference, widths that are not a multiple of 64 and a
bias are served, and a weight in the wrong layout is refused. Skipped where the CPU or OS gives no AMX tiles."""

import pytest
import torch
import torch.nn.functional as F

from services import cpu_kernels

pytestmark = pytest.mark.skipif(
    not (cpu_kernels.available(torch.bfloat16) and cpu_kernels._module().amx_usable()),
    reason="no AMX-BF16 tiles on this CPU or OS")

SHAPES = [(64, 64), (96, 48), (256, 272), (512, 1040)]  # (K in, N out): N % 64 of 0, 48, 16 and 16


def _operands(k: int, n: int, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    return x, w, torch.randn(n, generator=g)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_has_the_same_bits_alone_or_among_up_to_33_rows(shape):
    x, w, _ = _operands(*shape, rows=33)
    packed = cpu_kernels.pack_amx(w)
    alone = torch.cat([cpu_kernels.linear(x[i : i + 1], packed, None) for i in range(33)])
    for rows in (2, 5, 15, 16, 17, 32, 33):
        assert torch.equal(cpu_kernels.linear(x[:rows], packed, None), alone[:rows]), rows
    shifted = cpu_kernels.linear(x[3:20], packed, None)  # other rows share each tile
    assert torch.equal(shifted, alone[3:20])


@pytest.mark.parametrize("shape", SHAPES)
def test_outputs_agree_with_a_fp32_reference_with_and_without_bias(shape):
    x, w, b = _operands(*shape, rows=9)
    packed = cpu_kernels.pack_amx(w)
    reference = F.linear(x.float(), w.float())
    got = cpu_kernels.linear(x, packed, None)
    assert got.shape == (9, shape[1])
    assert torch.allclose(got.float(), reference, rtol=1e-2, atol=2e-2)
    with_bias = cpu_kernels.linear(x, packed, b)
    assert torch.allclose(with_bias.float(), reference + b, rtol=1e-2, atol=2e-2)


def test_small_integers_give_the_exact_sum_rounded_once():
    """Integer operands make every fp32 partial sum exact: the tile path then equals torch's rounding."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-8, 9, (7, 128), generator=g).to(torch.bfloat16)
    w = torch.randint(-8, 9, (80, 128), generator=g).to(torch.bfloat16)
    exact = (x.double() @ w.double().T).to(torch.bfloat16)
    assert torch.equal(cpu_kernels.linear(x, cpu_kernels.pack_amx(w), None), exact)


def test_zero_rows_give_an_empty_result():
    _, w, _ = _operands(64, 64, rows=1)
    assert cpu_kernels.linear(torch.empty(0, 64, dtype=torch.bfloat16), cpu_kernels.pack_amx(w), None).shape == (0, 64)


def test_bad_layouts_are_refused_by_name():
    x, w, _ = _operands(64, 64, rows=2)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu_kernels.pack_amx(w[:40])
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_kernels.pack_amx(w.float())
    packed = cpu_kernels.pack_amx(w)
    with pytest.raises(RuntimeError, match="packed"):
        cpu_kernels.linear(torch.randn(2, 96).to(torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match=r"dtype|bf16 rows"):
        cpu_kernels.linear(x.float(), packed, None)


def test_amx_serves_only_tile_shaped_bf16_weights(monkeypatch):
    assert cpu_kernels.amx_serves(torch.zeros(64, 64, dtype=torch.bfloat16))
    assert not cpu_kernels.amx_serves(torch.zeros(64, 48, dtype=torch.bfloat16))  # K not a multiple of 32
    assert not cpu_kernels.amx_serves(torch.zeros(40, 64, dtype=torch.bfloat16))  # N not a multiple of 16
    assert not cpu_kernels.amx_serves(torch.zeros(64, 64))
    monkeypatch.setenv("DSPARK_AMX", "0")
    assert not cpu_kernels.amx_serves(torch.zeros(64, 64, dtype=torch.bfloat16))
