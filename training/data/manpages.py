"""Man pages (troff source) → question/answer pairs: what a command does, and what its options do."""

from __future__ import annotations

import gzip
import re
from dataclasses import dataclass
from pathlib import Path

_FONT = re.compile(r"\\f(?:\(..|\[[^\]]*\]|.)")  # \fB \fI \fR \f(CW \f[B]
_ESCAPES = {r"\-": "-", r"\(em": "—", r"\(en": "–", r"\(aq": "'", r"\(dq": '"', r"\(lq": '"', r"\(rq": '"',
            r"\(bu": "•", r"\e": "\\", r"\&": "", r"\/": "", r"\,": "", r"\|": "", r"\^": "", r"\ ": " ",
            r"\~": " ", r"\(co": "©", r"\(oq": "'", r"\(cq": "'"}
# Sections that hold no prose worth learning (or only names and addresses).
_NOT_PROSE = {"NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "SEE ALSO", "AUTHOR", "AUTHORS", "COPYRIGHT",
              "REPORTING BUGS", "COLOPHON", "LICENSE", "LICENCE", "HISTORY", "BUGS"}
MAX_OPTIONS, MAX_EXTRA = 40, 6
_OTHER_ESCAPE = re.compile(r"\\(?:\(..|\[[^\]]*\]|[*nk](?:\(..|\[[^\]]*\]|.)|s[-+]?\d+|.)")


@dataclass(frozen=True, slots=True)
class ManPage:
    name: str  # the command
    summary: str  # NAME line text after the dash
    description: str  # DESCRIPTION paragraphs
    options: list[tuple[str, str]]  # (option, what it does)
    extra: list[tuple[str, str]] = ()  # (section title, its prose) for sections other than NAME/SYNOPSIS/...


def clean_troff(line: str) -> str:
    line = _FONT.sub("", line)
    for esc, repl in _ESCAPES.items():
        line = line.replace(esc, repl)
    line = _OTHER_ESCAPE.sub("", line)
    return re.sub(r"\s+,", ",", re.sub(r"\s{2,}", " ", line)).strip()


def _sections(lines: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    current = None
    for line in lines:
        if line.startswith((".SH", ".Sh")):
            current = clean_troff(line[3:]).strip('"').upper()
            out[current] = []
        elif current is not None:
            out[current].append(line)
    return out


def _paragraphs(lines: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Prose paragraphs and (.TP tag, text) option entries of one section."""
    paras, options, buf, tag, expect_tag = [], [], [], None, False

    def flush():
        nonlocal buf, tag
        text = " ".join(w for w in buf if w).strip()
        if text:
            (options.append((tag, text)) if tag else paras.append(text))
        buf, tag = [], None

    for raw in lines:
        if raw.startswith(".\\\"") or raw.startswith("'\\\""):
            continue
        if raw.startswith("."):
            macro = raw[1:].split(maxsplit=1)
            name = macro[0] if macro else ""
            if name in ("PP", "P", "LP", "SS", "sp", "br", "IP"):
                flush()
            elif name == "TP":
                flush()
                expect_tag = True
            elif name in ("B", "I", "BR", "IR", "RB", "RI", "BI", "IB") and len(macro) > 1:
                text = clean_troff(macro[1].replace('"', ""))
                if expect_tag:
                    tag, expect_tag = text, False
                else:
                    buf.append(text)
            continue
        text = clean_troff(raw)
        if expect_tag:
            tag, expect_tag = text, False
        else:
            buf.append(text)
    flush()
    return paras, options


def parse(path: Path, full: bool = False) -> ManPage | None:
    """The page's name, summary, description and options; with `full`, every option (up to MAX_OPTIONS), the
    whole description and its other prose sections (EXAMPLES, RETURN VALUE, ERRORS, FILES...) too."""
    if path.suffix == ".gz":
        with gzip.open(path, "rt", errors="replace") as f:
            raw = f.read()
    else:
        raw = path.read_text(errors="replace")
    if raw.lstrip().startswith(".so "):
        return None  # an alias page pointing at another one
    sections = _sections(raw.splitlines())
    name_lines = [clean_troff(x) for x in sections.get("NAME", []) if not x.startswith(".")]
    name_line = " ".join(name_lines)
    if " - " not in name_line:
        return None
    names, summary = name_line.split(" - ", 1)
    paras, options = _paragraphs(sections.get("DESCRIPTION", []))
    _, more_options = _paragraphs(sections.get("OPTIONS", []))
    options = [(t, d) for t, d in options + more_options if t.startswith("-") and 10 <= len(d) <= 400]
    if not paras and not options:
        return None
    name = names.split(",")[0].strip()
    if not full:
        return ManPage(name, summary.strip(), "\n\n".join(paras[:4]), options[:8])
    extra = []
    for title, lines in sections.items():
        if title in _NOT_PROSE or len(extra) >= MAX_EXTRA:
            continue
        prose, entries = _paragraphs(lines)
        text = "\n\n".join(prose + [f"{t}: {d}" for t, d in entries])
        if len(text) >= 80:
            extra.append((title, text))
    return ManPage(name, summary.strip(), "\n\n".join(paras), options[:MAX_OPTIONS], extra)
