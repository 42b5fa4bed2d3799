"""Text ↔ token ids for a model directory (`tokenizer.json`, Hugging Face `tokenizers` format), with the
model's own special-token rule and chat template.

The BOS rule is the model's, as transformers applies it: `tokenizer_config.json`'s `add_bos_token` where it
says (the project's tokenizers, and GGUF files, whose `tokenizer.ggml.add_bos_token` is written there), else
the tokenizer's own post-processor (`tokenizer.json`, e.g. Gemma's `<bos> $A`). A model fed text without the
BOS it was trained with answers garbage, so this is decided here, once, for every path that encodes text.
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from services.errors import InvalidRequestError, ModelLoadError


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...], bos_token_id: int | None,
                 add_bos: bool | None = None, chat_template: str | None = None):
        self._tok = tokenizer
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos  # True / False: the config's explicit rule; None: the post-processor decides
        self.chat_template = chat_template
        self._template = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> TextTokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir}: no tokenizer.json")
        tok = Tokenizer.from_file(str(path))
        return cls(tok, *_special_ids(model_dir, tok), *_tokenizer_config(model_dir))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids the model sees for `text`: with its BOS where the model's rule adds one."""
        if self.add_bos is None:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self._tok.encode(text, add_special_tokens=False).ids
        wants_bos = add_special_tokens and self.add_bos and self.bos_token_id is not None
        return [self.bos_token_id, *ids] if wants_bos else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as the model's chat template writes it (what transformers' apply_chat_template
        renders); a model without a template cannot chat, and says so."""
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template: use /v1/completions")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(self.chat_template)
        bos = self.token_text(self.bos_token_id) if self.bos_token_id is not None else ""
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=bos or "")

    def chat_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """The rendered conversation's ids; the BOS once, whether the template writes it or the rule adds it."""
        text = self.render_chat(messages, add_generation_prompt)
        bos = self.token_text(self.bos_token_id) if self.bos_token_id is not None else None
        return self.encode(text, add_special_tokens=not (bos and text.startswith(bos)))


def _special_ids(model_dir: Path, tok: Tokenizer) -> tuple[tuple[int, ...], int | None]:
    """EOS ids from generation_config.json, else config.json; the BOS id from tokenizer_config.json's
    `bos_token`, else config.json's `bos_token_id`."""
    eos, bos = None, None
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            raw = json.loads(path.read_text())
            eos = raw.get("eos_token_id") if eos is None else eos
            bos = raw.get("bos_token_id") if bos is None else bos
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    tok_cfg = model_dir / "tokenizer_config.json"
    if tok_cfg.is_file():
        named = json.loads(tok_cfg.read_text()).get("bos_token")
        named = named.get("content") if isinstance(named, dict) else named
        if named and tok.token_to_id(named) is not None:
            bos = tok.token_to_id(named)
    return eos_ids, bos


def _tokenizer_config(model_dir: Path) -> tuple[bool | None, str | None]:
    """(`add_bos_token` if the config states it, the chat template from the config or `chat_template.jinja`)."""
    path, raw = model_dir / "tokenizer_config.json", {}
    if path.is_file():
        raw = json.loads(path.read_text())
    template = raw.get("chat_template")
    if isinstance(template, list):  # transformers' named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja = model_dir / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text()
    add_bos = raw.get("add_bos_token")
    return (None if add_bos is None else bool(add_bos)), template
