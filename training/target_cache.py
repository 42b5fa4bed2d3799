"""The target cache: what drafter training reads instead of running the target.

Per sequence (prompt + regenerated response): token ids, a loss mask over the response, the target's
tap features, its final normed hidden state (target logits are recomputed from it with the frozen LM
head, as DeepSpec does) and the log-sum-exp of its logits over the whole vocabulary: a drafter over a draft
vocabulary recomputes only those rows, and log p_t = logit − lse stays normalised over all V. Arrays are flat
over all sequences and memory-mapped; `manifest.json` holds offsets, lengths, domains and what produced them.

Files: ids.npy int32 [N], loss_mask.npy uint8 [N], taps.npy bf16-as-uint16 [N, T*d],
hidden.npy bf16-as-uint16 [N, d], lse.npy fp32 [N] (NaN on prompt rows; caches of version 1 have none),
manifest.json — per shard of `SHARD_SEQUENCES` sequences (`shard-NNN/`), the cache's manifest listing them.

`lse_ids` (a draft vocabulary's target ids): the log-sum-exp runs over those rows of the head only, so p_t is
the target's distribution renormalised over the draft vocabulary — what a drafter over it can learn at best (the
soft targets differ from the exact ones by a factor 1 / (1 − m) a row, m the row's mass outside). On a CPU the
262,144-row head is 60 % of a Gemma 3 270M cache's cost and the draft vocabulary's an eighth of that. The manifest
names which (`lse_vocab`: "full" or the ids' sha256), and training checks it against its drafter's vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rich.progress import track

from services.gemma import softcap
from services.model import CausalLM
from services.packed_linear import linear, pack


@dataclass(slots=True)
class CachedSequence:
    ids: torch.Tensor  # [S] int64
    loss_mask: torch.Tensor  # [S] bool, True on response tokens
    taps: torch.Tensor  # [S, T*d] fp32
    hidden: torch.Tensor  # [S, d] fp32, final normed hidden (target logits = lm_head(hidden))
    domain: str
    lse: torch.Tensor | None = None  # [S] fp32 log Σ_v exp(logit_v) over the whole vocabulary


def _bf16_bits(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _from_bits(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a).view(np.int16)).view(torch.bfloat16).float()


SHARD_SEQUENCES = 1000  # sequences per shard: the unit a cut build resumes from


@torch.no_grad()
def build(model: CausalLM, records: list[dict], out_dir: Path, target: str, batch: int = 8,
          shard_sequences: int = SHARD_SEQUENCES, only: set[int] | None = None,
          lse_ids: torch.Tensor | None = None) -> dict | None:
    """Run the target over every (prompt, response) record and write the cache to `out_dir`: shards of
    `shard_sequences` records in the rollouts' order, each written to `.partial` and renamed, so a cut build
    resumes at its first missing shard (a shard is kept only while it holds the same records); the manifest,
    last, lists them. `only`: build just these shard numbers (processes may share a build) and write the
    manifest only if every shard is then there (else None). `lse_ids` [Vd] int64: the log-sum-exp over those rows
    of the head only (module docstring)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lse_vocab = lse_vocab_name(lse_ids)
    head = _Head(model, lse_ids)
    records = [r for r in records if len(r["response_ids"]) >= 2]
    parts = [(n, records[first : first + shard_sequences], out_dir / f"shard-{n:03d}")
             for n, first in enumerate(range(0, len(records), shard_sequences))]
    for number, part, shard in parts:
        if (only is None or number in only) and not _holds(shard, part, lse_vocab):
            partial = shard.with_name(shard.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            _build_shard(model, head, part, partial, target, batch)
            shutil.rmtree(shard, ignore_errors=True)
            partial.rename(shard)
    if not all(_holds(shard, part, lse_vocab) for _, part, shard in parts):
        return None  # another process builds the rest
    shards = [json.loads((shard / "manifest.json").read_text()) for _, _, shard in parts]
    manifest = {"version": 2, "target": target, "tap_layers": list(model.tap_layers),
                "hidden_size": model.config.hidden_size, "sequences": len(records),
                "tokens": sum(m["tokens"] for m in shards),
                "response_tokens": sum(m["response_tokens"] for m in shards), "lse_vocab": lse_vocab,
                "shards": [f"shard-{n:03d}" for n in range(len(shards))]}
    (out_dir / "manifest.json").write_text(json.dumps(manifest) + "\n")
    return manifest


def lse_vocab_name(lse_ids: torch.Tensor | None) -> str:
    """What a cache's log-sum-exp runs over: "full", or the sha256 of the draft vocabulary's target ids."""
    if lse_ids is None:
        return "full"
    return hashlib.sha256(lse_ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def _holds(shard: Path, part: list[dict], lse_vocab: str) -> bool:
    path = shard / "manifest.json"
    if not path.is_file():
        return False
    manifest = json.loads(path.read_text())
    return manifest["ids"] == [r["id"] for r in part] and manifest.get("lse_vocab", "full") == lse_vocab


class _Head:
    """The head rows the log-sum-exp runs over: the model's own head, or a packed copy of a draft vocabulary's."""

    def __init__(self, model: CausalLM, lse_ids: torch.Tensor | None):
        self.model, self.ids = model, lse_ids
        self.rows = None
        if lse_ids is not None:
            self.rows = model.lm_head.weight.detach()[lse_ids.to(model.lm_head.weight.device)].contiguous()
            self.packed = pack(self.rows)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return self.model.head_logits(h)
        logits = linear(h.to(self.rows.dtype), self.rows, None, self.packed)
        spec = self.model.config.gemma
        return logits if spec is None else softcap(logits, spec.final_logit_softcapping)


def _build_shard(model: CausalLM, head: _Head, records: list[dict], out_dir: Path, target: str, batch: int) -> None:
    out_dir.mkdir(parents=True)
    lengths = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in records]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    total, d, taps_width = int(offsets[-1]), model.config.hidden_size, model.config.hidden_size * len(model.tap_layers)
    ids = np.lib.format.open_memmap(out_dir / "ids.npy", "w+", np.int32, (total,))
    mask = np.lib.format.open_memmap(out_dir / "loss_mask.npy", "w+", np.uint8, (total,))
    taps = np.lib.format.open_memmap(out_dir / "taps.npy", "w+", np.uint16, (total, taps_width))
    hidden = np.lib.format.open_memmap(out_dir / "hidden.npy", "w+", np.uint16, (total, d))
    lse = np.lib.format.open_memmap(out_dir / "lse.npy", "w+", np.float32, (total,))
    order = sorted(range(len(records)), key=lambda i: lengths[i])  # similar lengths share a padded batch
    for start in track(range(0, len(order), batch), description=f"target cache {out_dir.name}"):
        group = order[start : start + batch]
        width = max(lengths[i] for i in group)
        tokens = torch.zeros(len(group), width, dtype=torch.long)
        for row, i in enumerate(group):
            seq = records[i]["prompt_ids"] + records[i]["response_ids"]
            tokens[row, : len(seq)] = torch.tensor(seq)
        out = model.forward_dense(tokens.to(model.device), head=False)  # causal: right padding never reaches real rows
        for row, i in enumerate(group):
            lo, n, p = int(offsets[i]), lengths[i], len(records[i]["prompt_ids"])
            ids[lo : lo + n] = tokens[row, :n].numpy()
            mask[lo : lo + n] = 0
            mask[lo + p : lo + n] = 1
            taps[lo : lo + n] = _bf16_bits(out.features[row, :n].cpu())
            hidden[lo : lo + n] = _bf16_bits(out.hidden[row, :n].cpu())
            lse[lo : lo + n] = np.nan  # prompt rows: no training row reads their target distribution
            lse[lo + p : lo + n] = _log_sum_exp(head, out.hidden[row, p:n])
    for arr in (ids, mask, taps, hidden, lse):
        arr.flush()
    manifest = {"version": 2, "target": target, "tap_layers": list(model.tap_layers), "hidden_size": d,
                "sequences": len(records), "tokens": total,
                "response_tokens": int(sum(len(r["response_ids"]) for r in records)),
                "lse_vocab": lse_vocab_name(head.ids), "offsets": offsets.tolist(),
                "domains": [r["domain"] for r in records],
                "ids": [r["id"] for r in records]}
    (out_dir / "manifest.json").write_text(json.dumps(manifest) + "\n")


def _log_sum_exp(head: _Head, hidden: torch.Tensor) -> np.ndarray:
    """hidden [n, d] → log Σ_v exp(logit_v) [n] over the head's rows, run 64 rows at a time (an fp32 copy of
    262,144 logits a row is 1 MiB)."""
    out = [head.logits(hidden[i : i + 64]).float().logsumexp(-1) for i in range(0, len(hidden), 64)]
    return torch.cat(out).cpu().numpy() if out else np.zeros(0, np.float32)


class TargetCache:
    """Read side: memory-mapped arrays, one `CachedSequence` per index, over a cache's shards (or the one flat
    directory of caches built before shards)."""

    def __init__(self, cache_dir: Path):
        self.dir = Path(cache_dir)
        self.manifest = json.loads((self.dir / "manifest.json").read_text())
        self.tap_layers = tuple(self.manifest["tap_layers"])
        self.lse_vocab = self.manifest.get("lse_vocab", "full")
        parts = [self.dir / name for name in self.manifest["shards"]] if "shards" in self.manifest else [self.dir]
        self._parts = [_Part(p) for p in parts]
        self._index = [(n, i) for n, part in enumerate(self._parts) for i in range(len(part))]
        self.domains = [d for part in self._parts for d in part.domains]

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> CachedSequence:
        part, local = self._index[i]
        return self._parts[part][local]


class _Part:
    """One directory of flat arrays (a shard)."""

    def __init__(self, directory: Path):
        manifest = json.loads((directory / "manifest.json").read_text())
        self.offsets, self.domains = manifest["offsets"], manifest["domains"]
        self._ids = np.load(directory / "ids.npy", mmap_mode="r")
        self._mask = np.load(directory / "loss_mask.npy", mmap_mode="r")
        self._taps = np.load(directory / "taps.npy", mmap_mode="r")
        self._hidden = np.load(directory / "hidden.npy", mmap_mode="r")
        lse = directory / "lse.npy"
        self._lse = np.load(lse, mmap_mode="r") if lse.is_file() else None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> CachedSequence:
        lo, hi = self.offsets[i], self.offsets[i + 1]
        return CachedSequence(
            ids=torch.from_numpy(self._ids[lo:hi].astype(np.int64)),
            loss_mask=torch.from_numpy(self._mask[lo:hi].astype(bool)),
            taps=_from_bits(self._taps[lo:hi]),
            hidden=_from_bits(self._hidden[lo:hi]),
            domain=self.domains[i],
            lse=None if self._lse is None else torch.from_numpy(np.array(self._lse[lo:hi])),
        )
