"""`dspark data build`: corpora for the three domains, deterministic splits, evaluation prompt sets."""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

from services.chat_template import qa, render
from training.data import DOMAINS, SPLITS, chat, code, math_problems
from training.data.tokenizer_build import encode_split, save_tokenizer, train_tokenizer

SOURCES = {
    "code": {"what": "Python standard library sources, test suites included (site-packages held out)",
             "licence": "PSF License 2.0"},
    "chat/python-docs": {"what": "python3.11-doc reST sources: FAQ, tutorial, HOWTOs, library and language "
                                 "reference, recast as questions and answers", "licence": "PSF License 2.0"},
    "chat/man-pages": {"what": "English man pages of sections 1-8 on the build machine (gcloud-* left out): "
                               "description, options and prose sections as questions and answers",
                       "licence": "each page under its package's licence, see /usr/share/doc/<package>/copyright"},
    "chat/info": {"what": "GNU info manuals in /usr/share/info, one question and answer per node",
                  "licence": "GNU Free Documentation License (each manual's own terms)"},
    "chat/debian-docs": {"what": "plain-text package documentation in /usr/share/doc (READMEs, guides, FAQs; "
                                 "change logs, copyright and NEWS left out), in parts of about 2,400 characters",
                         "licence": "each file under its package's licence, see /usr/share/doc/<package>/copyright"},
    "math": {"what": "generated multi-step word problems of 12 kinds (arithmetic, percentages, fractions, "
                     "equations, geometry, averages, divisibility...) with worked solutions (seeded)",
             "licence": "Apache-2.0 (this project)"},
}


@dataclass(frozen=True, slots=True)
class DataConfig:
    out_dir: Path = Path("build/data")
    eval_dir: Path = Path("benchmarks/datasets")
    seed: int = 0
    math_problems: int = 60_000
    eval_prompts: int = 300  # per domain, from the test split
    limit: int | None = None  # documents per file-backed source, for quick builds in tests
    vocab_size: int = 8192
    max_length: int = 2048  # the tokenizer's model_max_length: target v2's context


def split_of(key: str, seed: int) -> str:
    """90 / 5 / 5 by a hash of the document id: stable under additions and reordering."""
    bucket = int(hashlib.sha256(f"{seed}:{key}".encode()).hexdigest(), 16) % 1000
    return "train" if bucket < 900 else ("val" if bucket < 950 else "test")


def _documents(cfg: DataConfig):
    """(domain, id, record) for every document; chat and math records carry their messages."""
    def limited(it):
        for n, item in enumerate(it):
            if cfg.limit is not None and n >= cfg.limit:
                return
            yield item

    for key, text in limited(code.stdlib_files()):
        yield "code", key, {"text": text}
    for source in (chat.doc_pairs(), chat.api_pairs(), chat.man_pairs(), chat.info_pairs(),
                   chat.debian_doc_pairs()):
        for key, messages in limited(source):
            yield "chat", key, {"messages": messages, "text": render(messages)}
    for n in range(cfg.math_problems):
        question, solution = math_problems.problem(cfg.seed * 1_000_003 + n)
        messages = qa(question, solution)
        yield "math", f"math:{cfg.seed}:{n}", {"messages": messages, "text": render(messages)}


def _eval_prompts(domain: str, record: dict) -> list[str]:
    if domain == "code":
        return code.completion_prompts(record["text"])
    return [render(record["messages"][:-1], add_generation_prompt=True)]


def _tokenize(cfg: DataConfig) -> dict[str, int]:
    """Train the tokenizer on the train splits; write every split as uint16 token ids (`<name>.bin`)."""
    tok = train_tokenizer(cfg.out_dir, cfg.vocab_size)
    save_tokenizer(tok, cfg.out_dir / "tokenizer", cfg.max_length)
    counts = {}
    for domain in DOMAINS:
        for split in SPLITS:
            ids = encode_split(tok, cfg.out_dir, domain, split)
            ids.tofile(cfg.out_dir / f"{domain}.{split}.bin")
            counts[f"{domain}.{split}"] = int(ids.size)
    return counts


def build(cfg: DataConfig) -> dict:
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    files = {(d, s): (cfg.out_dir / f"{d}.{s}.jsonl").open("w") for d in DOMAINS for s in SPLITS}
    stats = {f"{d}.{s}": {"documents": 0, "chars": 0} for d in DOMAINS for s in SPLITS}
    prompts: dict[str, list[dict]] = {d: [] for d in DOMAINS}
    try:
        for domain, key, record in _documents(cfg):
            split = split_of(key, cfg.seed)
            files[domain, split].write(json.dumps({"id": key, **record}, ensure_ascii=False) + "\n")
            stats[f"{domain}.{split}"]["documents"] += 1
            stats[f"{domain}.{split}"]["chars"] += len(record["text"])
            if split == "test":
                for n, p in enumerate(_eval_prompts(domain, record)):
                    prompts[domain].append({"id": f"{key}#{n}", "domain": domain, "prompt": p})
    finally:
        for f in files.values():
            f.close()
    for name in stats:
        stats[name]["sha256"] = hashlib.sha256((cfg.out_dir / f"{name}.jsonl").read_bytes()).hexdigest()
    cfg.eval_dir.mkdir(parents=True, exist_ok=True)
    for domain, rows in prompts.items():
        # An even, seeded sample over the whole test split (not its first files), in a stable order.
        rows = sorted(rows, key=lambda r: hashlib.sha256(f"{cfg.seed}:{r['id']}".encode()).hexdigest())
        prompts[domain] = rows = sorted(rows[: cfg.eval_prompts], key=lambda r: r["id"])
        (cfg.eval_dir / f"{domain}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    tokens = _tokenize(cfg)
    manifest = {"config": {k: str(v) for k, v in asdict(cfg).items()}, "python": platform.python_version(),
                "sources": SOURCES, "splits": stats, "tokens": tokens,
                "eval_prompts": {d: len(rows) for d, rows in prompts.items()}}
    (cfg.out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
