"""Generate the Python code of the `dspark.v1` protos with grpcio-tools (the one way it is made).

    python -m protos.generate          # rewrite protos/dspark/v1/*_pb2*.py(i)
    python -m protos.generate --check  # exit 1 when the committed code differs from a fresh generation

The proto path is the repository root, so generated imports are package-qualified
(`from protos.dspark.v1 import dspark_pb2`) and need no rewriting.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
PROTOS = sorted((ROOT / "protos").rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc over every .proto under protos/ into `out_dir` → the generated files (relative paths)."""
    include = Path(protoc.__file__).parent / "_proto"  # well-known types shipped with grpcio-tools
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *(str(p.relative_to(ROOT)) for p in PROTOS)]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return sorted(p.relative_to(out_dir) for p in (out_dir / "protos").rglob("*_pb2*.py*"))


def drift() -> list[str]:
    """Generated files whose committed copy is missing or differs."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        return [str(rel) for rel in generate(fresh)
                if not (ROOT / rel).is_file() or (ROOT / rel).read_bytes() != (fresh / rel).read_bytes()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail when generated code drifts from the .proto")
    if parser.parse_args().check:
        stale = drift()
        if stale:
            sys.exit(f"generated code out of date: {', '.join(stale)}; run python -m protos.generate")
        return
    for rel in generate(ROOT):
        print(rel)  # noqa: T201


if __name__ == "__main__":
    main()
