"""The step forward under `torch.compile`: one graph with dynamic sizes, warmed before the first request.

Eager, a forward of the shipped target issues a few hundred small operations, each paying framework
dispatch; compiled, the norms, rotary, residuals and activations fuse into a few C++ kernels per layer and,
with `freezing`, the linears run oneDNN on pre-packed weights. The sizes of a step (rows N, query blocks B,
keys Lb, logit rows M) are symbolic, so one graph serves every step, prefill chunks and verify items alike:

- no size may be 1, or dynamo specialises it into a second graph (a second compile, and a second set of
  kernels that may round differently): N, B and M are padded to at least 2 by repeating their last entry
  (a repeated row writes the same key to the same place; a repeated block or logit row is dropped again);
- duck sizing is off, so two sizes that happen to be equal while tracing are not assumed equal forever.

Because every step runs the same kernels and each of them treats a row on its own, a position's logits do
not depend on what else shares the step (checked in tests/test_compiled_step.py, as for eager).

On CUDA the graph also runs as CUDA graphs (`mode="reduce-overhead"`: one launch per step instead of one
per kernel). A CUDA graph replays fixed sizes, so there the sizes are padded up to buckets (powers of two;
keys to a power of two ≥ `KV_MULTIPLE`): a handful of graphs is captured and replayed, not one per step
shape. The KV cache is marked a static address, so replays write it in place instead of copying it in.
`buckets=True` pads on CPU too (how the padding itself is tested without a GPU).
"""

from __future__ import annotations

import time

import torch

from services.attention import KV_MULTIPLE, AttentionPlan, step_block
from services.layers import RaggedLayout
from services.model import CausalLM, ForwardOutput
from services.packed_linear import mark_static_packs


def compile_frozen(fn, module: torch.nn.Module, **options):
    """`torch.compile(fn)` (dynamic sizes, one graph) with `module`'s weights frozen into constants and its AMX
    tiles' sizes static. Freezing is process-wide and read when a graph compiles (a `torch.compile(options=...)`
    entry is not honoured for it): weights become constants and the linears oneDNN calls on pre-packed weights.
    The compiler is imported here, not at the top: it costs every process that imports it 2 s, compiling or not."""
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    mark_static_packs(module)
    return torch.compile(fn, dynamic=True, fullgraph=True, **options)


class CompiledStep:
    """Callable like `CausalLM` (the `Engine`'s model call); compiles at construction (`warm_s` says how long)."""

    def __init__(self, model: CausalLM, max_len: int, num_slots: int, buckets: bool | None = None):
        self.model = model
        cuda = model.device.type == "cuda"
        self.buckets = cuda if buckets is None else buckets  # pad sizes to powers of two (CUDA graphs replay)
        self._layers: tuple | None = None  # (k_cache, v_cache, their per-layer views): one set of objects
        self.config, self.tap_layers = model.config, model.tap_layers
        import torch.fx.experimental._config as fx_config  # here: see compile_frozen

        fx_config.use_duck_shape = False
        model.rotary()  # built now, so the graph reads the table as a constant instead of rebuilding it
        self._fn = compile_frozen(model.step, model, mode="reduce-overhead" if cuda else None)
        self.warm_s = self._warm(max_len, num_slots)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    def _warm(self, max_len: int, num_slots: int) -> float:
        """One forward on a scratch cache, shaped like a mixed step, so the graph exists before any request."""
        cfg, dev = self.config, self.device
        shape = (cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, max_len, cfg.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=dev)  # [L, S, Hkv, max_len, Dh]
        v = torch.zeros_like(k)
        lens = [3, 5][: max(1, min(2, num_slots))]
        layout = RaggedLayout(slots=list(range(len(lens))), starts=[0] * len(lens), lens=lens)
        n = sum(lens)
        started = time.perf_counter()
        with torch.inference_mode():
            self(torch.zeros(n, dtype=torch.long, device=dev), torch.cat([torch.arange(m) for m in lens]).to(dev),
                 layout, k, v, torch.arange(3, device=dev))
        return time.perf_counter() - started

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: RaggedLayout,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, logit_rows: torch.Tensor) -> ForwardOutput:
        n, m = input_ids.shape[0], logit_rows.shape[0]
        plan = AttentionPlan.build(layout.slots, layout.starts, layout.lens, input_ids.device, k_cache.shape[3],
                                   block=step_block(layout.lens))  # one block size: one graph
        ws, wp, bs, gather, mask, scatter = plan.tensors()
        size = _bucket if self.buckets else lambda x: max(2, x)
        ids, pos, ws, wp, scatter = (_pad(t, size(n)) for t in (input_ids, positions, ws, wp, scatter))
        bs, gather, mask = (_pad(t, size(bs.shape[0])) for t in (bs, gather, mask))
        if self.buckets:  # keys too: the extra positions are masked out, as the KV_MULTIPLE padding is
            kv = min(k_cache.shape[3], max(KV_MULTIPLE, _bucket(mask.shape[-1])))
            mask = torch.nn.functional.pad(mask, (0, kv - mask.shape[-1]), value=False)
        rows = _pad(logit_rows, size(m)) if m else logit_rows.new_zeros(size(1))
        keys, values = self._per_layer(k_cache, v_cache)
        logits, features = self._fn(ids, pos, ws, wp, bs, gather, mask, scatter, keys, values, rows)
        return ForwardOutput(logits=logits[:m], features=None if features is None else features[:n])

    def _per_layer(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[tuple, tuple]:
        """The caches' per-layer views, made once per cache: the same tensors every step, which a CUDA graph
        needs to treat them as static addresses (fresh views each step would be copied in at every replay)."""
        if self._layers is None or self._layers[0] is not k_cache or self._layers[1] is not v_cache:
            keys, values = k_cache.unbind(0), v_cache.unbind(0)
            if self.device.type == "cuda":
                for t in (*keys, *values):
                    torch._dynamo.mark_static_address(t)
            self._layers = (k_cache, v_cache, keys, values)
        return self._layers[2], self._layers[3]


def _bucket(n: int) -> int:
    """The power of two ≥ n (and ≥ 2: a size of 1 would be specialised into a graph of its own)."""
    return max(2, 1 << (n - 1).bit_length())


def _pad(t: torch.Tensor, size: int) -> torch.Tensor:
    """t grown to `size` entries along dim 0 by repeating its last entry (a repeated row writes the same key
    to the same place; a repeated block or logit row is dropped again)."""
    extra = size - t.shape[0]
    return torch.cat([t, t[-1:].expand(extra, *t.shape[1:])]) if extra > 0 else t
