"""reStructuredText (Sphinx sources) → titled sections of plain prose."""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNDERLINE = re.compile(r"^([=\-~^*+#\"'`])\1{2,}\s*$")
_ROLE = re.compile(r":[\w:.+-]+:`(?:[^`<]*<)?([^`>]+)>?`")  # :func:`name` / :mod:`text <target>`
_LINK = re.compile(r"`([^`<]+?)\s*<[^`>]+>`_{1,2}")  # `text <url>`_
_LITERAL = re.compile(r"``([^`]+)``")
_EMPHASIS = re.compile(r"\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*")
_REF = re.compile(r"`([^`]+)`_{1,2}")
_KEPT_DIRECTIVES = ("note", "warning", "seealso", "tip", "important", "versionadded", "versionchanged",
                    "deprecated", "code-block", "sourcecode", "doctest", "testcode")


@dataclass(frozen=True, slots=True)
class Section:
    title: str
    body: str  # plain text, paragraphs separated by blank lines


def clean_inline(text: str) -> str:
    text = _ROLE.sub(lambda m: m.group(1).lstrip("~!"), text)
    text = _LINK.sub(r"\1", text)
    text = _LITERAL.sub(r"\1", text)
    text = _EMPHASIS.sub(lambda m: m.group(1) or m.group(2), text)
    return _REF.sub(r"\1", text)


def _body_lines(lines: list[str]) -> list[str]:
    """Drop directives that carry no prose (index, toctree, labels, images...) with their indented blocks."""
    out, skipping = [], False
    for line in lines:
        stripped = line.strip()
        if skipping:
            if stripped and not line.startswith((" ", "\t")):
                skipping = False
            else:
                continue
        if stripped.startswith(".. "):
            name = stripped[3:].split("::")[0].strip()
            if "::" in stripped and name in _KEPT_DIRECTIVES:
                rest = stripped.split("::", 1)[1].strip()
                if rest and name.startswith("version"):
                    out.append(f"(Python {rest})")
                continue
            skipping = True
            continue
        out.append(line[:-2] + ":" if stripped.endswith("::") and not stripped.startswith("::") else line)
    return out


def sections(text: str) -> list[Section]:
    """Split a document at its headings (a title line underlined, optionally overlined, by punctuation)."""
    lines = text.splitlines()
    heads = [i for i in range(1, len(lines))
             if _UNDERLINE.match(lines[i]) and lines[i - 1].strip() and not _UNDERLINE.match(lines[i - 1])
             and len(lines[i].rstrip()) >= len(lines[i - 1].rstrip())]
    found = []
    for n, h in enumerate(heads):
        end = heads[n + 1] - 1 if n + 1 < len(heads) else len(lines)
        body = _body_lines(lines[h + 1 : end])
        if body and _UNDERLINE.match(body[-1] if body else ""):
            body = body[:-1]  # the next heading's overline
        text_body = "\n".join(clean_inline(line.rstrip()) for line in body)
        text_body = re.sub(r"\n{3,}", "\n\n", text_body).strip()
        found.append(Section(clean_inline(lines[h - 1].strip()), text_body))
    return found


_API = re.compile(r"^\.\. (?:py:)?(function|method|class|attribute|data|exception|decorator|coroutinefunction|"
                  r"coroutinemethod|classmethod|staticmethod)::\s*(.+)$")
_MODULE = re.compile(r"^\.\. (?:py:)?(?:module|currentmodule)::\s*(\S+)")


@dataclass(frozen=True, slots=True)
class ApiEntry:
    kind: str  # function, method, class, ...
    signature: str  # e.g. join(path, *paths)
    module: str | None
    body: str


def api_entries(text: str) -> list[ApiEntry]:
    """The indented description under each `.. function::`-style directive."""
    lines, found, module = text.splitlines(), [], None
    i = 0
    while i < len(lines):
        if m := _MODULE.match(lines[i]):
            module = m.group(1)
        m = _API.match(lines[i].strip()) if not lines[i].startswith(" ") else None
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].strip().startswith(":") and lines[j].startswith(" "):
            j += 1  # directive options such as :noindex:
        block = []
        while j < len(lines) and (not lines[j].strip() or lines[j].startswith((" ", "\t"))):
            block.append(lines[j][3:] if lines[j].startswith("   ") else lines[j].strip())
            j += 1
        body = "\n".join(clean_inline(b.rstrip()) for b in _body_lines(block))
        found.append(ApiEntry(m.group(1), clean_inline(m.group(2)), module, re.sub(r"\n{3,}", "\n\n", body).strip()))
        i = j
    return found
