"""GNU info manuals (`/usr/share/info/*.info*.gz`) → one titled section per node, for the chat domain."""

from __future__ import annotations

import gzip
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

INFO_DIR = Path("/usr/share/info")
_HEADER = re.compile(r"^File: ([^,]+),\s+Node: ([^,\n]+)")
_UNDERLINE = re.compile(r"^[=*\-.]{3,}\s*$")
# The Python manual's info build duplicates the reST sources the chat domain already reads.
EXCLUDED_MANUALS = ("python3",)
_MENU = re.compile(r"^\* Menu:", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class InfoNode:
    manual: str  # "coreutils"
    node: str  # "Backup options"
    title: str  # the node's heading line ("2.2 Backup options"), or the node name
    body: str  # prose, paragraphs separated by blank lines; the node's menu cut off


def _manual_files(root: Path) -> list[list[Path]]:
    """Each manual's files in order: foo.info.gz, or foo.info-1.gz, foo.info-2.gz, ..."""
    manuals: dict[str, list[Path]] = {}
    for path in sorted(root.glob("*.info*")):
        base = re.sub(r"\.info(-\d+)?(\.gz)?$", "", path.name)
        manuals.setdefault(base, []).append(path)
    part = re.compile(r"-(\d+)(?:\.gz)?$")
    return [sorted(paths, key=lambda p: int(m.group(1)) if (m := part.search(p.name)) else 0)
            for _, paths in sorted(manuals.items())]


def _read(path: Path) -> str:
    if path.suffix == ".gz":
        with gzip.open(path, "rt", errors="replace") as f:
            return f.read()
    return path.read_text(errors="replace")


def _node(chunk: str) -> InfoNode | None:
    lines = chunk.strip("\n").splitlines()
    if not lines or not (m := _HEADER.match(lines[0])):
        return None
    manual, node = m.group(1).removesuffix(".info"), m.group(2).strip()
    rest = lines[1:]
    while rest and not rest[0].strip():
        rest = rest[1:]
    title = node
    if len(rest) >= 2 and _UNDERLINE.match(rest[1]):
        title, rest = rest[0].strip(), rest[2:]
    body = "\n".join(rest)
    if (menu := _MENU.search(body)) is not None:
        body = body[: menu.start()]
    body = re.sub(r"\n{3,}", "\n\n", body).strip()
    return InfoNode(manual, node, title, body) if body else None


def nodes(root: Path = INFO_DIR) -> Iterator[tuple[str, InfoNode]]:
    """(id, node) for every node of every manual, in file order; index and tag-table chunks are skipped."""
    for paths in _manual_files(root):
        if paths[0].name.startswith(EXCLUDED_MANUALS):
            continue
        for path in paths:
            for n, chunk in enumerate(_read(path).split("\x1f")):
                info = _node(chunk)
                if info is not None and not info.node.lower().endswith("index"):
                    yield f"info:{path.name}#{n}", info
