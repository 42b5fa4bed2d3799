"""Validation figures of a trained target: loss (nats/token) and bits per byte per domain."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from services.loader import load_model
from services.tokenizer import TextTokenizer
from training.batches import eval_windows, load_tokens
from training.data import DOMAINS
from training.target import evaluate


def validation_report(model_dir: Path, data_dir: Path, seq_len: int = 256, eval_tokens: int = 65_536) -> dict:
    """Per domain: mean next-token loss over the first `eval_tokens` of the validation split, and the
    same in bits per UTF-8 byte of the text those tokens decode to."""
    model = load_model(model_dir, dtype="float32")
    tok = TextTokenizer.from_dir(model_dir)
    val = load_tokens(data_dir, "val")
    windows = {d: eval_windows(val[d], seq_len, eval_tokens) for d in DOMAINS}
    with torch.inference_mode():
        losses = evaluate(model, windows, autocast=False)
    report = {}
    for domain, w in windows.items():
        targets = w[:, 1:]
        text_bytes = sum(len(tok.decode(row.tolist()).encode()) for row in targets)
        bits = losses[domain] * targets.numel() / math.log(2)
        report[domain] = {"loss": round(losses[domain], 4), "bits_per_byte": round(bits / text_bytes, 4),
                          "tokens": int(targets.numel())}
    return report
