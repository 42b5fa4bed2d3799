"""The `chat` domain: question/answer pairs from the Python documentation and from man pages."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

from services.data.chat_format import qa
from services.data.manpages import parse
from services.data.rst import api_entries, sections

PYTHON_DOC_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
DOC_PARTS = ("faq", "tutorial", "howto", "library", "reference", "glossary.rst.txt", "using", "extending")
MAN_DIRS = (Path("/usr/share/man/man1"), Path("/usr/share/man/man8"))
_ASK = ("Explain {t}.", "What should I know about {t}?", "Can you describe {t}?", "Tell me about {t}.",
        "Give me an overview of {t}.")
MIN_ANSWER, MAX_ANSWER = 120, 2400


def _pick(options: tuple[str, ...], key: str) -> str:
    return options[int(hashlib.sha256(key.encode()).hexdigest(), 16) % len(options)]


def _trim(text: str) -> str:
    """Cut at the last paragraph boundary before MAX_ANSWER characters."""
    if len(text) <= MAX_ANSWER:
        return text
    cut = text.rfind("\n\n", 0, MAX_ANSWER)
    return text[: cut if cut > MIN_ANSWER else MAX_ANSWER].rstrip()


def doc_pairs(root: Path = PYTHON_DOC_SOURCES) -> Iterator[tuple[str, list[dict]]]:
    """(id, messages) for each documentation section with enough prose. FAQ titles are questions already."""
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is missing: install Debian's python3.11-doc (make data-deps)")
    files = sorted(p for part in DOC_PARTS for p in ([root / part] if part.endswith(".txt") else
                                                       sorted((root / part).rglob("*.rst.txt"))))
    for path in files:
        rel = path.relative_to(root).as_posix()
        for n, sec in enumerate(sections(path.read_text(errors="replace"))):
            if len(sec.body) < MIN_ANSWER or len(sec.title) > 120:
                continue
            title = sec.title.rstrip(":")
            question = title if title.endswith("?") else _pick(_ASK, rel + title).format(t=title)
            yield f"doc:{rel}#{n}", qa(question, _trim(sec.body))


def api_pairs(root: Path = PYTHON_DOC_SOURCES) -> Iterator[tuple[str, list[dict]]]:
    """(id, messages) for each documented function, class, method... of the library reference."""
    for path in sorted((root / "library").rglob("*.rst.txt")):
        rel = path.relative_to(root).as_posix()
        for n, entry in enumerate(api_entries(path.read_text(errors="replace"))):
            if len(entry.body) < 60:
                continue
            where = f" in the {entry.module} module" if entry.module else ""
            name = entry.signature.split("(")[0]
            question = f"What does the {entry.kind} {name}{where} do?"
            yield f"api:{rel}#{n}", qa(question, _trim(f"{entry.signature}\n\n{entry.body}"))


def man_pairs(dirs: tuple[Path, ...] = MAN_DIRS) -> Iterator[tuple[str, list[dict]]]:
    for directory in dirs:
        for path in sorted(directory.glob("*.gz")):
            page = parse(path)
            if page is None:
                continue
            key = f"man:{directory.name}/{path.name}"
            about = f"{page.name} — {page.summary}."
            if page.description:
                about += "\n\n" + _trim(page.description)
            yield key, qa(f"What does the {page.name} command do?", about)
            for k, (option, what) in enumerate(page.options):
                yield f"{key}#opt{k}", qa(f"What does the {option} option of {page.name} do?", what)
