"""Text ↔ token ids for a model directory (`tokenizer.json`, Hugging Face `tokenizers` format)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from services.errors import ModelLoadError


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...], bos_token_id: int | None):
        self._tok = tokenizer
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> TextTokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir}: no tokenizer.json")
        tok = Tokenizer.from_file(str(path))
        eos, bos = _special_ids(model_dir, tok)
        return cls(tok, eos, bos)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if self.bos_token_id is not None else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _special_ids(model_dir: Path, tok: Tokenizer) -> tuple[tuple[int, ...], int | None]:
    """EOS ids from generation_config.json, else config.json; BOS only if the tokenizer config adds it."""
    eos = None
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file() and eos is None:
            eos = json.loads(path.read_text()).get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    bos = None
    tok_cfg = model_dir / "tokenizer_config.json"
    if tok_cfg.is_file():
        raw = json.loads(tok_cfg.read_text())
        if raw.get("add_bos_token") and raw.get("bos_token"):
            bos = tok.token_to_id(raw["bos_token"])
    return eos_ids, bos
