"""The project's own CPU kernels (services/kernels/*.cpp), built on first use with torch's C++ extension loader.

`linear` (services/kernels/linear.cpp) is a matrix-vector-shaped GEMM for the few rows of a decode or verify
step: it streams each weight row once at the memory's speed and gives every output one fixed-order dot
product, so a row's bits do not depend on the step's other rows. It needs AVX2 + FMA (bf16 widened to fp32 in
registers; AVX512-BF16's dot products where the CPU has them). The fused kernels (decoder layer, Markov head)
serve bf16 on AVX512-BF16 only: `available` says which dtypes they serve, `linear_available` the linear's.

The build (about a minute, once per checkout: cached under ~/.cache/torch_extensions) needs a C++
compiler; without one, or with `DSPARK_CPU_KERNELS=0`, `available` says no and the linears run on oneDNN
(services/packed_linear.py), which is batch invariant too, only slower at these shapes.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).parent / "kernels" / name
           for name in ("linear.cpp", "amx.cpp", "decoder.cpp", "heads.cpp", "bindings.cpp")]


def _avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")  # or "DEFAULT", ...


def _cpu_supports(dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        return torch.cpu._is_avx512_bf16_supported()
    return dtype == torch.float32 and _avx2()


@functools.cache
def _module() -> ModuleType | None:
    if os.environ.get("DSPARK_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load
        _put_ninja_on_path()
        # The loader rebuilds when a source changes, not a header: their hash goes into the flags, so it does.
        headers = hashlib.sha256(b"".join(h.read_bytes() for h in sorted(SOURCES[0].parent.glob("*.h"))))
        flags = ["-O3", "-fopenmp", f"-DDSPARK_HEADERS={headers.hexdigest()[:16]}"]
        with _build_lock() as directory:
            return load("dspark_cpu_kernels", [str(s) for s in SOURCES], extra_cflags=flags,
                        extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)
    except Exception as exc:  # no compiler, no headers: the oneDNN path serves instead
        log.warning("CPU kernels unavailable (%s: %s); linears run on oneDNN", type(exc).__name__, exc)
        return None


@contextlib.contextmanager
def _build_lock() -> Iterator[Path]:
    """The build directory of this checkout's kernels, held under a lock the kernel frees when its holder dies.

    torch's loader guards a build with a lock *file* and waits for it to go away; a process killed mid-build
    (a timed-out start, a cancelled run) leaves it, and every later process waited forever. Under this lock
    no other build runs, so such a file is stale and goes. One directory per checkout: two checkouts' sources
    (a worktree, a clean clone) would each rebuild over the other's objects in a shared one."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    where = hashlib.sha256(str(SOURCES[0].parent.resolve()).encode()).hexdigest()[:12]
    directory = root / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / f"dspark_cpu_kernels-{where}"
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        yield directory


def _put_ninja_on_path() -> None:
    """torch's loader runs `ninja` from PATH; the pip package's binary sits in the venv's bin, which a process
    started as `.venv/bin/python` (make, Ray workers) does not have on its PATH."""
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def build() -> bool:
    """Build (or find in the cache) the kernels now, so that no tier process pays the build at start-up: the
    install step and the test session call it. → whether they are there."""
    return _module() is not None


def amx_serves(weight: torch.Tensor) -> bool:
    """Whether `weight` runs on AMX tiles here (services/kernels/amx.cpp): bf16, N a multiple of 16 and K of 32,
    a CPU with AMX-BF16 the OS lets us use; `DSPARK_AMX=0` keeps the AVX512 loop."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[0] % 16 or weight.shape[1] % 32:
        return False
    return os.environ.get("DSPARK_AMX", "1") != "0" and available(torch.bfloat16) and _module().amx_usable()


def pack_amx(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 → its AMX tile layout [N/16, K/32, 16, 16, 2], which `linear` takes in its place."""
    return _module().pack_amx(weight.detach())  # before a compile: packed_linear.mark_static_packs


def available(dtype: torch.dtype) -> bool:
    """Whether every kernel (`linear`, the decoder layer, the Markov head) serves this dtype here: the CPU has the
    instructions and the module builds."""
    return _cpu_supports(dtype) and _module() is not None


def linear_available(dtype: torch.dtype) -> bool:
    """Whether `linear` serves this dtype here: fp32 and bf16 wherever AVX2 is (and the module builds)."""
    return dtype in (torch.float32, torch.bfloat16) and _avx2() and _module() is not None


@torch.library.custom_op("dspark::linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _module().linear(x, weight, bias)


@_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0] * (16 if weight.dim() == 5 else 1))


def decoder_layer(*args) -> torch.Tensor:
    """One decoder layer in one call (services/kernels/decoder.cpp; the arguments: services/fused_decoder.py)."""
    return _module().decoder_layer(*args)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of rows x [..., d] in one call, rounded as the decoder layer's (services/kernels/decoder.cpp)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return _module().rms_norm(rows, weight, eps).view(x.shape)


def context_rows(*args) -> None:
    """Context rows' keys and values into a cache slot (services/kernels/decoder.cpp; drafter_worker/fused_block.py)."""
    _module().context_rows(*args)


def markov_block(*args) -> list[torch.Tensor]:
    """A block of DSpark's Markov head (services/kernels/heads.cpp; arguments: drafter_worker/fused_block.py)."""
    return _module().markov_block(*args)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K], weight [N, K] (or `pack_amx`'s layout of it), bias [N] or None → [..., N]; call only where
    `linear_available(x.dtype)`. Under `torch.compile` an opaque custom op (`dspark::linear`)."""
    rows = x.reshape(-1, x.shape[-1])
    run = _linear_op if torch.compiler.is_compiling() else _module().linear
    y = run(rows, weight, bias)
    return y.view(*x.shape[:-1], y.shape[-1])
