"""Load a Hugging Face checkpoint (`config.json` + `*.safetensors`, sharded or not) into `CausalLM`."""

from __future__ import annotations

import json
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch.overrides import TorchFunctionMode

from services.errors import ModelLoadError
from services.model_config import ModelConfig

if TYPE_CHECKING:
    from services.model import CausalLM

# Buffers some exporters write that carry nothing the model needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _NoInit(TorchFunctionMode):
    """`torch.nn.init.*` returns its tensor untouched: a module built only to be filled from a checkpoint."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


@contextmanager
def unfilled() -> Iterator[None]:
    """Build modules on the meta device without their random init: every parameter is loaded, shared or sliced
    afterwards. Not only memory: a random init on meta runs through torch's Python reference ops, whose first
    call imports the compiler — 1.5 s of every tier process's start (measured on a 2-vCPU EPYC)."""
    with torch.device("meta"), _NoInit():
        yield


def cpu_model() -> str:
    """The CPU's model name and its bf16-relevant flags (figures differ with AMX, AVX512-BF16 or AVX2 only)."""
    name, flags = platform.processor() or platform.machine(), set()
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    wanted = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags]
    return f"{name} ({' '.join(wanted)})" if wanted else name


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls run natively (CUDA, or a CPU with AVX512-BF16 / AMX) instead of emulated."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def resolve_dtype(name: str | torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """`auto` is bf16 where bf16 is native and fp32 elsewhere: emulated bf16 GEMMs are several times
    slower than fp32 (measured 7x at 8 rows on an AVX2-only EPYC), native ones faster."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if native_bf16(device or torch.device("cpu")) else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(sorted(DTYPES))}")
    return DTYPES[name]


def resolve_device(name: str | torch.device | None) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def tensor_index(model_dir: Path) -> dict[str, Path]:
    """Tensor name → safetensors file, from the shard index or from the single file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = {name: model_dir / shard for name, shard in weight_map.items()}
        for path in set(files.values()):
            if not path.is_file():
                raise ModelLoadError(f"{index} names shard {path.name}, which is missing")
        return files
    single = sorted(model_dir.glob("*.safetensors"))
    if not single:
        raise ModelLoadError(f"{model_dir}: no *.safetensors files")
    files: dict[str, Path] = {}
    for path in single:
        with safe_open(path, framework="pt") as f:
            files.update({name: path for name in f.keys()})  # noqa: SIM118 (safe_open is not a dict)
    return files


def open_checkpoint(model_dir: str | Path, dtype: str | torch.dtype,
                    device: str | torch.device | None) -> tuple[Path, ModelConfig, torch.dtype, torch.device]:
    """A checkpoint directory → (it, its config, the dtype and device its tensors load in): one place checks them,
    for a whole model (`load_model`) and for its embeddings alone (services/embeddings.py)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: not a directory")
    device = resolve_device(device)
    return model_dir, ModelConfig.from_dir(model_dir), resolve_dtype(dtype, device), device


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = "cpu",
    tap_layers: tuple[int, ...] = (),
) -> CausalLM:
    # imported here: a drafter replica loads only the target's embeddings (services/embeddings.py) through this
    # module, and the decoder's code stays unloaded there
    from services.model import CausalLM

    model_dir, cfg, dtype, device = open_checkpoint(model_dir, dtype, device)
    with unfilled():
        model = CausalLM(cfg, tap_layers)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    state = _read_tensors(tensor_index(model_dir), expected, dtype, device)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.source_dir = model_dir  # where its tokenizer is (structured output reads it: services/grammar.py)
    return model.eval()


def _read_tensors(files, expected, dtype, device) -> dict[str, torch.Tensor]:
    missing = [name for name in expected if name not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"checkpoint is missing tensor {missing[0]!r}{more}")
    tied_head = "lm_head.weight" not in expected
    unexpected = [
        name for name in files
        if name not in expected and not name.endswith(_IGNORED_SUFFIXES)
        and not (tied_head and name == "lm_head.weight")
    ]
    if unexpected:
        raise ModelLoadError(f"checkpoint has tensor {unexpected[0]!r}, which this architecture lacks")
    state = {}
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as f:
            for name in names:
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(expected[name]):
                    raise ModelLoadError(
                        f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected[name])}"
                    )
                state[name] = tensor.to(device=device, dtype=dtype)
    return state
