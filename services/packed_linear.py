"""Linears on weights pre-packed once for oneDNN: the CPU serving path's GEMMs.

`F.linear` on the CPU re-lays its weight out for the kernel at every call; for the few rows a decode or
verify step has that is most of the call (bf16, 2 threads, one row: 384 → 2,048 100 → 34 µs, the LM head
384 → 8,192 295 → 91 µs). `torch.ops.mkldnn._reorder_linear_weight` does that once, and
`_linear_pointwise` runs on the packed copy; inductor's `freezing` does the same inside a compiled graph.

Why it stays exact: a packed GEMM gives a row the same bits at any row count, in bf16 *and* fp32
(`tests/test_packed_linear.py`). In bf16 its bits are `F.linear`'s; in fp32 they are not (MKL's, which
`F.linear` uses there, change a row's bits with the row count), so packing makes fp32 steps batch
invariant too.

`pack_linears(module)` packs every `nn.Linear` in a model for serving: the module keeps its parameters
(names, tied weights and checkpoint loading unchanged) and only its forward changes (its class becomes
`PackedLinear`). A weight changed after packing is noticed (`PackedWeight.of`) and runs unpacked.
A compiled step traces `F.linear` instead: its freezing pass packs the weights it holds as constants.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACKABLE = (torch.bfloat16, torch.float32)


class PackedWeight:
    """A weight's oneDNN-packed copy, used only while the weight is unchanged (same storage, dtype and
    version counter: `.to()`, `load_state_dict` or an in-place update make it stale, and the linear falls
    back to `F.linear`). Not a tensor, so `Module._apply` leaves it alone; a deep copy or pickle of a model
    drops it (the copy packs again where it serves)."""

    __slots__ = ("_key", "tensor")

    def __init__(self, tensor: torch.Tensor, weight: torch.Tensor):
        self.tensor, self._key = tensor, _key(weight)

    def of(self, weight: torch.Tensor) -> torch.Tensor | None:
        return self.tensor if _key(weight) == self._key else None

    def __deepcopy__(self, memo) -> None:
        return None

    def __reduce__(self):
        return _dropped, ()


def _dropped() -> None:
    return None


def _key(weight: torch.Tensor) -> tuple:
    # inference tensors keep no version counter (and cannot be changed in place outside inference mode)
    return weight.data_ptr(), weight.dtype, None if weight.is_inference() else weight._version


def pack(weight: torch.Tensor) -> PackedWeight | None:
    """weight [out, in] → its oneDNN-packed copy, or None where there is none to make: not a CPU tensor,
    another dtype, or a build or CPU oneDNN refuses."""
    if weight.device.type != "cpu" or weight.dtype not in PACKABLE or not torch.backends.mkldnn.is_available():
        return None
    try:
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            probe = torch.ops.mkldnn._linear_pointwise(weight.new_zeros(1, weight.shape[1]), packed, None, "none",
                                                       [], "")
    except RuntimeError:
        return None
    return PackedWeight(packed, weight) if probe.shape == (1, weight.shape[0]) else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedWeight | None) -> torch.Tensor:
    """x [..., in] → [..., out]: on `packed` where it is current, else `F.linear`. A compiled graph traces
    `F.linear`: inductor's freezing packs the weights it holds as constants itself."""
    if packed is not None and not torch.compiler.is_compiling():
        current = packed.of(weight)
        if current is not None:
            return torch.ops.mkldnn._linear_pointwise(x, current, bias, "none", [], "")
    return F.linear(x, weight, bias)


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose forward runs on `packed` (outside the state dict)."""

    packed: PackedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


def pack_linears(module: nn.Module) -> int:
    """Pack every `nn.Linear` of `module` and the fused projections (`pack_fused`) → how many were packed
    (0 where `pack` makes none: a CUDA model keeps its linears as they are)."""
    count = 0
    for m in list(module.modules()):
        if isinstance(m, nn.Linear) and type(m) in (nn.Linear, PackedLinear):
            packed = pack(m.weight)
            if packed is not None:
                m.__class__ = PackedLinear  # same parameters and names; only the forward changes
                m.packed = packed
                count += 1
        pack_fused = getattr(m, "pack_fused", None)
        if callable(pack_fused):
            count += pack_fused()
    return count
