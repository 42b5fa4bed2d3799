"""The CPU serving path's fused decoder layers (services/fused_decoder.py, services/kernels/decoder.cpp): they
compute what the module path computes (fp32 to rounding, bf16 to its precision), over cached prefixes and
ragged steps, with biases; a row's bits do not depend on the step's other rows, on their slots or on how many
rows its request brings; models the kernel does not serve keep the module path."""

from dataclasses import replace

import pytest
import torch

from services import cpu_kernels, fused_decoder
from services.layers import RaggedLayout
from tests.conftest import VOCAB, make_model
from training.tiny_model import random_model, tiny_config

STEPS = [RaggedLayout([2, 0], [0, 0], [7, 12]), RaggedLayout([0, 1, 2], [12, 0, 7], [3, 5, 1]),
         RaggedLayout([1, 2], [5, 8], [1, 8])]


def _need(dtype):
    if not cpu_kernels.available(dtype):
        pytest.skip(f"no CPU kernel for {dtype} here")


def _model(dtype, biases: bool = False, fused: bool = True):
    cfg = tiny_config(VOCAB, eos_id=0, layers=2, hidden=128)
    if biases:
        cfg = replace(cfg, qkv_bias=True, o_bias=True, mlp_bias=True)
    model = random_model(cfg, seed=0, std=0.15).to(dtype)
    model.tap_layers = (0,)
    model.prepare_for_serving()
    assert model.fused == cpu_kernels.available(dtype)
    model.fused = fused
    return model


def _steps(model, layouts, seed=3):
    """Run `layouts` in order on one cache → per step (logits of every row, features)."""
    cfg = model.config
    shape = (cfg.num_hidden_layers, 4, cfg.num_key_value_heads, 64, cfg.head_dim)
    k, v = torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype)
    g = torch.Generator().manual_seed(seed)
    outs = []
    with torch.inference_mode():
        for layout in layouts:
            n = sum(layout.lens)
            ids = torch.randint(1, VOCAB, (n,), generator=g)
            pos = torch.cat([torch.arange(s, s + m) for s, m in zip(layout.starts, layout.lens, strict=True)])
            out = model(ids, pos, layout, k, v, torch.arange(n))
            outs.append((out.logits, out.features))
    return outs


@pytest.mark.parametrize("biases", [False, True], ids=["llama", "biases"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_layers_compute_what_the_modules_compute(dtype, biases):
    _need(dtype)
    fused, modules = _steps(_model(dtype, biases), STEPS), _steps(_model(dtype, biases, fused=False), STEPS)
    bound = 1e-5 if dtype == torch.float32 else 0.02  # relative error of a whole step's logits or features
    for (a, fa), (b, fb) in zip(fused, modules, strict=True):
        for x, y in ((a, b), (fa.float(), fb.float())):
            assert (x - y).norm() <= bound * y.norm()
    if dtype == torch.bfloat16:  # bf16's own rounding, not another model: the argmax agrees almost everywhere
        agree = torch.cat([(a.argmax(-1) == b.argmax(-1)) for (a, _), (b, _) in zip(fused, modules, strict=True)])
        assert agree.float().mean() > 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_the_step(dtype):
    """One request's 9 tokens: as one step alone; one row a step beside another request on another slot;
    as a 4-row and a 5-row step sharing each with a prefill of 11 rows. The same logits, bit for bit."""
    _need(dtype)
    model = _model(dtype)
    cfg = model.config
    g = torch.Generator().manual_seed(5)
    ours, other = torch.randint(1, VOCAB, (9,), generator=g), torch.randint(1, VOCAB, (20,), generator=g)

    def run(plan):  # plan: steps of ((slot, request tokens, start, count), ...)
        shape = (cfg.num_hidden_layers, 4, cfg.num_key_value_heads, 64, cfg.head_dim)
        k, v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        rows = []
        with torch.inference_mode():
            for step in plan:
                ids = torch.cat([tokens[start : start + n] for _, tokens, start, n in step])
                pos = torch.cat([torch.arange(start, start + n) for _, _, start, n in step])
                layout = RaggedLayout([s for s, *_ in step], [st for _, _, st, _ in step], [n for *_, n in step])
                logits = model(ids, pos, layout, k, v, torch.arange(len(ids))).logits
                first = 0
                for _, tokens, _, n in step:
                    if tokens is ours:
                        rows.append(logits[first : first + n])
                    first += n
        return torch.cat(rows)

    alone = run([[(0, ours, 0, 9)]])
    one_by_one = run([[(3, ours, i, 1), (1, other, i, 1)] for i in range(9)])
    split = run([[(2, other, 0, 11), (0, ours, 0, 4)], [(0, ours, 4, 5), (2, other, 11, 3)]])
    assert torch.equal(alone, one_by_one) and torch.equal(alone, split)


def test_models_the_kernel_does_not_serve_keep_the_module_path(monkeypatch):
    qk = random_model(replace(tiny_config(VOCAB, eos_id=0, layers=1, hidden=64), qk_norm=True)).float()
    qk.prepare_for_serving()
    assert not qk.fused  # q/k norms: the kernel has none
    monkeypatch.setenv("DSPARK_FUSED_DECODER", "0")
    plain = make_model()
    plain.prepare_for_serving()
    assert not plain.fused


def test_a_row_beyond_the_cache_is_refused_before_anything_is_written():
    _need(torch.float32)
    model = _model(torch.float32)
    cfg = model.config
    k = torch.zeros(1, cfg.num_key_value_heads, 8, cfg.head_dim)
    v = torch.zeros_like(k)
    layer = model.model.layers[0]
    x = torch.randn(1, cfg.hidden_size)
    cos, sin = model.rotary().cos[[8]], model.rotary().sin[[8]]
    with pytest.raises(RuntimeError, match="beyond the cache"):
        fused_decoder.run_layer(layer, x, cos, sin, k, v, torch.tensor([0]), torch.tensor([8]))
    assert not k.any() and not v.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_changed_after_a_step_reach_the_kernel(dtype):
    """The kernel's weights are gathered once per layer (fused_decoder._weights) and kept only while current:
    an in-place change of a packed weight, or a `.to()` that replaces the fused buffers, is seen at the next step."""
    _need(dtype)
    model = _model(dtype)
    before = _steps(model, STEPS[:1])[0][0]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(-1.5)  # in place: the packed copy goes stale
    changed = _steps(model, STEPS[:1])[0][0]
    fresh = _model(dtype)
    with torch.no_grad():
        for layer in fresh.model.layers:
            layer.mlp.down_proj.weight.mul_(-1.5)
    fresh.prepare_for_serving()  # packs the changed weights
    assert not torch.equal(before, changed)
    bound = 1e-5 if dtype == torch.float32 else 5e-3  # bf16: a stale AMX copy runs the AVX512 loop, another order
    assert (changed.float() - _steps(fresh, STEPS[:1])[0][0].float()).norm() <= bound * changed.float().norm()
    if dtype == torch.bfloat16 and cpu_kernels.available(torch.float32):
        model.float()  # new fused buffers, new parameter storage
        model.prepare_for_serving()
        as_fp32 = _steps(model, STEPS[:1])[0][0]
        assert as_fp32.dtype == torch.float32
