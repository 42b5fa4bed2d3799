"""`dspark data target-cache`: rollouts of the target on train and held-out prompts, then their caches."""

from __future__ import annotations

from pathlib import Path

import torch

from services.loader import load_model
from services.model_config import ModelConfig, default_tap_layers
from services.registry import model_name, resolve_model
from services.tokenizer import TextTokenizer
from training import rollouts, target_cache


def prepare(target: str, run_dir: Path, data_dir: Path, cfg: rollouts.RolloutConfig, val_per_domain: int = 64,
            tap_layers: tuple[int, ...] | None = None, mirror_dir: Path | None = None,
            rollout_dtype: str = "float32", rollouts_only: bool = False, feature_dtype: str = "float32",
            shard_worker: tuple[int, int] | None = None, lse_ids: torch.Tensor | None = None,
            cache_per_domain: int | None = None) -> dict[str, Path]:
    """Build (or resume) `run_dir/{train,val}` caches; returns their directories. `mirror_dir` keeps gzip copies
    of the rollouts (commit them: a fresh machine resumes the rollouts from them); `rollout_dtype` is the
    dtype the target generates in (the one it is served in); `feature_dtype` the one features are taken in (fp32
    for the toy targets; a real target's served dtype, bf16 where native: what its drafters are served).
    `rollouts_only`: stop after the rollouts (returns their files), the long part, before any feature is taken.
    `shard_worker` (k, n): build only the cache shards numbered k mod n, so n processes share the build (one
    thread each goes further on a small CPU than one process of n threads); the last to finish writes the
    manifest, and a run without it afterwards completes whatever is missing. `lse_ids`: the train split's
    log-sum-exp over those target ids only (training/target_cache.py); the held-out split's stays over the whole
    vocabulary, so the acceptance early stopping reads is the exact one. `cache_per_domain`: the train cache holds
    the first N rollouts of each domain only (all are kept as rollouts): on a small CPU the cache and the training
    share one session, and code's long sequences would take most of the cache's time."""
    caches = {split: run_dir / "cache" / split for split in ("val", "train")}
    missing = [split for split, d in caches.items() if not (d / "manifest.json").exists()]
    if not missing:
        return caches  # nothing to build: the target is not even loaded
    torch.manual_seed(cfg.seed)
    model_dir = resolve_model(target)
    tokenizer = TextTokenizer.from_dir(model_dir)
    taps = tap_layers or default_tap_layers(ModelConfig.from_dir(model_dir).num_hidden_layers)
    model = None if rollouts_only else load_model(model_dir, feature_dtype, "cpu", tap_layers=taps)
    generator = model if model is not None and rollout_dtype == feature_dtype else load_model(
        model_dir, rollout_dtype, "cpu", tap_layers=taps)
    run_dir.mkdir(parents=True, exist_ok=True)
    per_domain = {"val": val_per_domain, "train": cfg.prompts_per_domain}
    for split in missing:
        out, cache_dir = run_dir / f"rollouts.{split}.jsonl", caches[split]
        items = list(rollouts.prompts(data_dir, split, per_domain[split], cfg.seed, cfg.code_prompts_per_file))
        mirror = None if mirror_dir is None else mirror_dir / f"rollouts.{split}.jsonl.gz"
        rollouts.generate(generator, tokenizer, items, cfg, out, mirror)
        if rollouts_only:
            caches[split] = out
            continue
        only = None if shard_worker is None else {n for n in range(1000) if n % shard_worker[1] == shard_worker[0]}
        records = rollouts.read(out)
        if split == "train" and cache_per_domain is not None:
            records = first_per_domain(records, cache_per_domain)
        target_cache.build(model, records, cache_dir, target=model_name(target), only=only,
                           lse_ids=lse_ids if split == "train" else None)
    return caches


def first_per_domain(records: list[dict], n: int) -> list[dict]:
    """The first `n` records of each domain, in the rollouts' order."""
    seen: dict[str, int] = {}
    kept = []
    for r in records:
        if seen.get(r["domain"], 0) < n:
            kept.append(r)
            seen[r["domain"]] = seen.get(r["domain"], 0) + 1
    return kept
