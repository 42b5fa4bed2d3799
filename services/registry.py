"""The models shipped under `models/`: names, kinds, sizes; `--model NAME` resolution."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from safetensors import safe_open

from services.errors import ModelLoadError

MODELS_DIR = Path(os.environ.get("DSPARK_MODELS_DIR", Path(__file__).resolve().parents[1] / "models"))


@dataclass(frozen=True, slots=True)
class ModelEntry:
    name: str
    kind: str  # "target" or "drafter"
    path: str
    parameters: int
    target: str | None  # the target a drafter belongs to

    def as_dict(self) -> dict:
        return asdict(self)


def _parameters(model_dir: Path) -> int:
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118
    return total


def _shipped(root: Path | None) -> list[tuple[Path, dict]]:
    """(directory, its `dspark_drafter` block or {} for a target) of each model under `models/`."""
    return [(config.parent, json.loads(config.read_text()).get("dspark_drafter") or {})
            for config in sorted((root or MODELS_DIR).glob("*/config.json"))]


def list_models(root: Path | None = None) -> list[ModelEntry]:
    """The models under `models/`, then the ones a pip package brings (path empty until installed)."""
    from services.pip_models import PIP_MODELS  # here: GGUF conversion loads where a model may need it

    entries = [ModelEntry(name=path.name, kind="drafter" if drafter else "target", path=str(path),
                          parameters=_parameters(path), target=drafter.get("target"))
               for path, drafter in _shipped(root)]
    for name, pip_model in PIP_MODELS.items():
        entries.append(ModelEntry(name=name, kind="target", path=pip_model.location() or "",
                                  parameters=pip_model.parameters, target=None))
    return entries


def drafters_of(target: str | Path, root: Path | None = None) -> list[str]:
    """The names of the drafters shipped for `target` (a name, GGUF file or directory: `model_name`). Drafters
    are trained here and ship under `models/`; none comes by pip. Reads each model's config.json only (a
    replica's start-up needs no parameter counts)."""
    return [path.name for path, drafter in _shipped(root) if drafter.get("target") == model_name(target)]


def resolve_model(name_or_path: str | Path, root: Path | None = None) -> Path:
    """A directory path as given; a `.gguf` file as its cached HF directory (services/gguf.py); else the
    shipped model of that name, under `models/` or installed by pip (`PIP_MODELS`). The GGUF code loads only
    where a name needs it (a drafter replica of a target under `models/` never does)."""
    root = root or MODELS_DIR
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if path.suffix == ".gguf":
        from services import gguf

        if not gguf.is_gguf(path):
            raise ModelLoadError(f"{name_or_path}: no such GGUF file")
        return gguf.materialize(path)
    shipped = root / str(name_or_path)
    if shipped.is_dir():
        return shipped
    from services.pip_models import PIP_MODELS

    if str(name_or_path) in PIP_MODELS:
        return PIP_MODELS[str(name_or_path)].resolve()
    names = ", ".join(e.name for e in list_models(root)) or "none"
    raise ModelLoadError(f"{name_or_path}: neither a model directory, a .gguf file nor a shipped model "
                         f"(shipped: {names})")


def model_name(name_or_path: str | Path) -> str:
    """The name a model is served and its drafters are registered under: a shipped model's name, a GGUF file's
    stem, a directory's name (never the cache directory a GGUF or pip model resolves to)."""
    path = Path(name_or_path)
    return path.stem if path.suffix == ".gguf" else path.name
