"""Byte-level BPE tokenizer of the project's own target, trained on the train splits of every domain."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from services.chat_template import BOS, EOS, JINJA_TEMPLATE, MASK, PAD, SPECIAL_TOKENS
from training.data import DOMAINS


def _texts(data_dir: Path, split: str) -> Iterator[str]:
    for domain in DOMAINS:
        with (data_dir / f"{domain}.{split}.jsonl").open() as f:
            for line in f:
                yield json.loads(line)["text"]


def train_byte_bpe(texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str]) -> Tokenizer:
    """Byte-level BPE (every byte representable, so any text round-trips) trained on `texts`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def train_tokenizer(data_dir: Path, vocab_size: int = 8192) -> Tokenizer:
    return train_byte_bpe(_texts(data_dir, "train"), vocab_size, SPECIAL_TOKENS)


def save_tokenizer(tok: Tokenizer, out_dir: Path, max_length: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
              "pad_token": PAD, "mask_token": MASK, "add_bos_token": True, "model_max_length": max_length,
              "chat_template": JINJA_TEMPLATE}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def encode_split(tok: Tokenizer, data_dir: Path, domain: str, split: str) -> np.ndarray:
    """Every document as [bos, ids..., eos], concatenated: uint16 [tokens]."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    texts = [json.loads(line)["text"] for line in (data_dir / f"{domain}.{split}.jsonl").open()]
    out = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        out.extend((bos, *enc.ids, eos))
    return np.asarray(out, dtype=np.uint16)
