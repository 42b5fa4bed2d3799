"""Plain-text package documentation under `/usr/share/doc` (READMEs, guides, FAQs) → titled text parts.

Change logs, release notes, copyright files and NEWS are left out: they are long, repetitive and say little about use.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Iterator
from pathlib import Path

DOC_ROOT = Path("/usr/share/doc")
SKIPPED = re.compile(r"(changelog|copyright|news|changes|authors|thanks|credits|todo|history|license|copying|"
                     r"relnotes|release)",
                     re.IGNORECASE)
TEXT_SUFFIXES = (".txt", ".md", ".rst", "")
MAX_FILE_BYTES = 400_000
PART_CHARS = 2400


def _text(path: Path) -> str | None:
    name = path.name.removesuffix(".gz")
    if (SKIPPED.search(path.as_posix()) or Path(name).suffix.lower() not in TEXT_SUFFIXES
            or path.stat().st_size > MAX_FILE_BYTES):
        return None
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError):
        return None  # binary, truncated or not UTF-8: not documentation we can read as text
    if "\x00" in text or sum(c.isalpha() for c in text[:4000]) < 0.5 * min(len(text), 4000):
        return None
    return text.strip() or None


def parts(text: str, size: int = PART_CHARS) -> list[str]:
    """Cut at paragraph boundaries into parts of at most about `size` characters."""
    out, buf = [], ""
    for para in re.split(r"\n\s*\n", text):
        para = para.rstrip()
        if buf and len(buf) + len(para) + 2 > size:
            out.append(buf)
            buf = ""
        buf = f"{buf}\n\n{para}" if buf else para
    if buf:
        out.append(buf)
    return [p[: size * 2] for p in out if len(p.strip()) >= 80]


def documents(root: Path = DOC_ROOT) -> Iterator[tuple[str, str, str, list[str]]]:
    """(id, package, file name, parts) for every readable text file, in path order."""
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.is_symlink() or "python3.11/html" in path.as_posix():
            continue
        text = _text(path)
        if text is None:
            continue
        rel = path.relative_to(root)
        pieces = parts(text)
        if pieces:
            yield f"doc:{rel.as_posix()}", rel.parts[0], path.name.removesuffix(".gz"), pieces
