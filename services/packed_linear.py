"""How the CPU serving path runs its linears: the project's kernel, or oneDNN on weights packed once.

`F.linear` on the CPU re-lays its weight out for oneDNN at every call; for the few rows of a decode or
verify step that is most of the call. Two faster ways, each giving a row the same bits at any row count
(the batch invariance greedy speculation relies on; `tests/test_packed_linear.py`):

- the project's kernel (services/cpu_kernels.py), where it serves the dtype (bf16 with AVX512-BF16, fp32 with
  AVX2): it streams the weight as it is at the memory's speed. Target v2's 65 linears of one token, weights
  from memory, bf16, 2 threads: 2.6 ms against 5.8 ms packed oneDNN and 7.6 ms `F.linear`. Where the CPU has
  AMX, a bf16 weight is copied once into the tile layout (`cpu_kernels.pack_amx`): 1.4 ms at one row, 1.5 ms
  at eight (the AVX512 loop: 2.3 and 4.8 ms);
- else oneDNN on a copy packed once (`mkldnn._reorder_linear_weight`, run by `_linear_pointwise`; what
  inductor's `freezing` does inside a compiled graph): 384 → 2,048 at one row, hot cache, 100 → 34 µs.
  In bf16 its bits are `F.linear`'s; in fp32 MKL's (which `F.linear` uses there) are not batch invariant, the
  packed GEMM is.

`pack_linears(module)` prepares every `nn.Linear` of a model for serving: the module keeps its parameters
(names, tied weights and checkpoint loading unchanged) and only its forward changes (its class becomes
`PackedLinear`). A weight changed after packing is noticed (`PackedWeight.current`) and runs on `F.linear`.
A compiled step calls the kernel as an opaque op, or traces `F.linear` where oneDNN serves (its freezing
pass packs the weights it holds as constants).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services import cpu_kernels

PACKABLE = (torch.bfloat16, torch.float32)


class PackedWeight:
    """How a weight runs: on the project's kernel (`kernel`; `tensor` its AMX tile layout where AMX serves,
    else None: the weight itself, services/cpu_kernels.py) or on its oneDNN-packed copy `tensor`; used only
    while the weight is unchanged (same storage, dtype and version counter: `.to()`, `load_state_dict` or an
    in-place update make it stale, and the linear falls back to `F.linear`). Not a tensor, so `Module._apply`
    leaves it alone; a deep copy or pickle of a model drops it (the copy packs again where it serves)."""

    __slots__ = ("_key", "kernel", "tensor")

    def __init__(self, tensor: torch.Tensor | None, weight: torch.Tensor, kernel: bool):
        self.tensor, self.kernel, self._key = tensor, kernel, _key(weight)

    def kernel_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """What the kernel takes for `weight`: its tile layout, or the weight itself."""
        return weight if self.tensor is None else self.tensor

    def current(self, weight: torch.Tensor) -> bool:
        return _key(weight) == self._key

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
    """weight [out, in] → how it runs: the project's kernel where it serves the dtype, else a oneDNN-packed
    copy, else None (not a CPU tensor, another dtype, or a build or CPU oneDNN refuses)."""
    if weight.device.type != "cpu" or weight.dtype not in PACKABLE:
        return None
    if cpu_kernels.linear_available(weight.dtype) and weight.is_contiguous():
        return PackedWeight(cpu_kernels.pack_amx(weight) if cpu_kernels.amx_serves(weight) else None, weight, True)
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            probe = torch.ops.mkldnn._linear_pointwise(weight.new_zeros(1, weight.shape[1]), packed, None, "none",
                                                       [], "")
    except RuntimeError:
        return None
    return PackedWeight(packed, weight, False) if probe.shape == (1, weight.shape[0]) else None


def kernel_weight(weight: torch.Tensor, packed: PackedWeight | None) -> torch.Tensor:
    """What the project's kernel takes for `weight`: its AMX tile layout where `pack` made one and it is current,
    else the weight itself (the kernel's AVX512 / AVX2 loop reads it as it is)."""
    return packed.tensor if packed is not None and packed.kernel and packed.tensor is not None and \
        packed.current(weight) else weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedWeight | None) -> torch.Tensor:
    """x [..., in] → [..., out]: as `packed` says where it is current, else `F.linear`. A compiled graph calls
    the kernel as an opaque op, and traces `F.linear` for a oneDNN weight: inductor's freezing packs the
    weights it holds as constants itself."""
    if packed is None:
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling():
        return cpu_kernels.linear(x, packed.kernel_weight(weight), bias) if packed.kernel else F.linear(x, weight, bias)
    if not packed.current(weight):
        return F.linear(x, weight, bias)
    if packed.kernel:
        return cpu_kernels.linear(x, kernel_weight(weight, packed), bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed.tensor, bias, "none", [], "")


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose forward runs on `packed` (outside the state dict)."""

    packed: PackedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


def mark_static_packs(module: nn.Module) -> None:
    """Before a dynamic-shape compile of `module`: its AMX tile layouts keep their sizes. They are not parameters,
    so the compile would give their sizes symbols that freezing then drops. Marked here, not when packed: the
    mark imports torch's compiler, 2 s of every process's start, which only a compile needs."""
    import torch._dynamo

    for m in module.modules():
        for value in vars(m).values():
            if isinstance(value, PackedWeight) and value.kernel and value.tensor is not None:
                torch._dynamo.mark_static(value.tensor)


def pack_linears(module: nn.Module) -> int:
    """Pack every `nn.Linear` of `module` and the fused projections (`pack_fused`) → how many were packed
    (0 where `pack` makes none: a CUDA model keeps its linears as they are)."""
    count = 0
    for m in list(module.modules()):
        if type(m) in (nn.Linear, PackedLinear):  # not subclasses: their forwards are their own
            packed = pack(m.weight)
            if packed is not None:
                m.__class__ = PackedLinear  # same parameters and names; only the forward changes
                m.packed = packed
                count += 1
        pack_fused = getattr(m, "pack_fused", None)
        if callable(pack_fused):
            count += pack_fused()
    return count
