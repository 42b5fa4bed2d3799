"""The `code` domain: the Python standard library's own sources (site-packages left out)."""

from __future__ import annotations

import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

# Corpus v2 keeps the stdlib's own test suites (more code, same licence); installed packages stay held out.
EXCLUDED_PARTS = {"site-packages", "dist-packages", "__pycache__"}
MAX_FILE_BYTES = 400_000  # a few generated tables (unicode data, big test fixtures) are not code to learn
_DEF = re.compile(r"^\s*(?:async\s+)?def \w+\(.*\)(?:\s*->\s*[^:]+)?:\s*$")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> Iterator[tuple[str, str]]:
    """(id, source text) for every stdlib module (outside installed packages), in path order."""
    root = root or stdlib_root()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if EXCLUDED_PARTS.intersection(rel.parts[:-1]) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield f"code:{rel.as_posix()}", text


def completion_prompts(text: str, max_prompts: int = 12, context_lines: int = 20) -> list[str]:
    """Prompts that end right after a function's signature (and its docstring when it has a short one):
    the model writes the body."""
    lines = text.splitlines()
    prompts = []
    for i, line in enumerate(lines):
        if len(prompts) >= max_prompts or not _DEF.match(line) or i + 1 >= len(lines):
            continue
        end = i + _docstring_lines(lines, i + 1)
        prompts.append("\n".join(lines[max(0, i - context_lines) : end + 1]) + "\n")
    return prompts


def _docstring_lines(lines: list[str], start: int) -> int:
    """Lines of the docstring opening at `start` (0 when there is none or it is longer than 10 lines)."""
    doc = lines[start].strip()
    quote = doc[:3]
    if quote not in ('"""', "'''"):
        return 0
    if len(doc) > 6 and doc.endswith(quote):
        return 1
    for n in range(1, 10):
        if start + n < len(lines) and quote in lines[start + n]:
            return n + 1
    return 0
