"""The `chat` domain: question/answer pairs from the Python documentation and from man pages."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

from services.chat_template import qa
from training.data import debian_docs, info
from training.data.manpages import parse
from training.data.rst import api_entries, sections

PYTHON_DOC_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
DOC_PARTS = ("faq", "tutorial", "howto", "library", "reference", "glossary.rst.txt", "using", "extending")
MAN_DIRS = tuple(Path(f"/usr/share/man/man{n}") for n in range(1, 9))  # every section, English pages only
# The Google Cloud SDK ships ~16k near-identical `gcloud-*` pages: they would be most of the corpus and teach one
# phrasing, so they stay out.
MAN_EXCLUDED_PREFIXES = ("gcloud",)
_MAN_ASK = {"1": "What does the {n} command do?", "2": "What does the {n} system call do?",
            "3": "What does the {n} library function do?", "4": "What is the {n} device?",
            "5": "What is the {n} file format?", "6": "What is the {n} game?", "7": "Explain {n}.",
            "8": "What does the {n} administration command do?"}
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
    """(id, messages) per man page: what it is, each of its options, and each further prose section."""
    for directory in dirs:
        section = directory.name.removeprefix("man")
        for path in sorted(directory.glob("*.gz")):
            if path.name.startswith(MAN_EXCLUDED_PREFIXES):
                continue
            page = parse(path, full=True)
            if page is None:
                continue
            key = f"man:{directory.name}/{path.name}"
            about = f"{page.name} — {page.summary}."
            if page.description:
                about += "\n\n" + _trim(page.description)
            yield key, qa(_MAN_ASK.get(section, _MAN_ASK["7"]).format(n=page.name), about)
            for k, (option, what) in enumerate(page.options):
                yield f"{key}#opt{k}", qa(f"What does the {option} option of {page.name} do?", what)
            for k, (title, text) in enumerate(page.extra):
                yield f"{key}#sec{k}", qa(f"What does the {title.lower()} section of {page.name}({section}) say?",
                                          _trim(text))


def info_pairs(root: Path = info.INFO_DIR) -> Iterator[tuple[str, list[dict]]]:
    """(id, messages) per node of the GNU info manuals."""
    for key, node in info.nodes(root):
        if len(node.body) < MIN_ANSWER:
            continue
        question = _pick(_ASK, key).format(t=f"{node.title} in the {node.manual} manual")
        yield key, qa(question, _trim(node.body))


def debian_doc_pairs(root: Path = debian_docs.DOC_ROOT) -> Iterator[tuple[str, list[dict]]]:
    """(id, messages) per part of every package's plain-text documentation."""
    for key, package, name, parts in debian_docs.documents(root):
        for k, part in enumerate(parts):
            where = f"part {k + 1} of " if len(parts) > 1 else ""
            yield f"{key}#{k}", qa(f"What does {where}{name} of the {package} package say?", part)
