"""`dspark train target`: train the project's own Llama target on the built corpora; resumable, seeded.

State (model, optimizer, step, RNG) goes to `run_dir/state.pt` every `checkpoint_every` steps and at
the end; a rerun with the same run_dir resumes. Every `export_every` steps the weights are also exported
(bf16, Hugging Face layout, with `trainer_state.json`) to `run_dir/export`: a session that finds the run
directory gone resumes from such an export (`resume_from`), weights and step kept, optimizer moments rebuilt.

The last `long_fraction` of the steps train on `long_seq_len` windows (same tokens per step), so that the
model serves its whole context: rotary positions it never saw in training would be out of distribution.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from services.chat_template import BOS, END, EOS
from services.checkpoint import save_model
from services.loader import native_bf16
from services.model import CausalLM
from services.model_config import ModelConfig, RopeConfig
from training.batches import WindowSampler, eval_windows, load_tokens
from training.data import DOMAINS
from training.schedule import warmup_cosine
from training.state import resume_state, save_state


@dataclass(frozen=True, slots=True)
class TargetTrainConfig:
    data_dir: Path = Path("build/data")
    run_dir: Path = Path("build/train/target")
    out_dir: Path = Path("models/dspark-target")
    # Target v2: deep-thin (16 layers, 31.5M parameters), the largest candidate that trains 20M tokens in about
    # six hours on 2 cores with native bf16 (docs/results/target-training.md has the measured candidates).
    hidden: int = 384
    layers: int = 16
    heads: int = 6
    kv_heads: int = 2
    ffn: int = 1024
    max_positions: int = 2048
    seq_len: int = 512
    batch_size: int = 8
    long_seq_len: int = 2048
    long_fraction: float = 0.1  # of the steps, at the end
    total_tokens: int = 20_000_000
    lr: float = 8e-4
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100  # steps
    eval_tokens: int = 16_384  # per domain
    checkpoint_every: int = 50  # steps
    export_every: int = 250  # steps
    resume_from: Path | None = None  # an export to start from when run_dir holds no state
    seed: int = 0

    @property
    def total_steps(self) -> int:
        return math.ceil(self.total_tokens / (self.seq_len * self.batch_size))

    @property
    def long_start(self) -> int:
        """The first step of the long-window phase."""
        return self.total_steps - int(self.total_steps * self.long_fraction) if self.long_seq_len else self.total_steps

    @property
    def long_batch(self) -> int:
        return max(1, self.batch_size * self.seq_len // max(1, self.long_seq_len))


def model_config(cfg: TargetTrainConfig, vocab_size: int, bos: int, eos: tuple[int, ...]) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=vocab_size, hidden_size=cfg.hidden,
        intermediate_size=cfg.ffn, num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads, head_dim=cfg.hidden // cfg.heads, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=10000.0), max_position_embeddings=cfg.max_positions, bos_token_id=bos,
        eos_token_ids=eos,
    )


def _init(model: CausalLM, layers: int) -> None:
    """GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2·layers)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                continue
            std = 0.02 / math.sqrt(2 * layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            p.normal_(0.0, std)


def _loss(model: CausalLM, windows: torch.Tensor, autocast: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model.forward_dense(windows[:, :-1]).logits  # [B, T, V]
    return F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())


@torch.no_grad()
def evaluate(model: CausalLM, evals: dict[str, torch.Tensor], autocast: bool, batch: int = 16) -> dict[str, float]:
    model.eval()
    out = {}
    for domain, windows in evals.items():
        losses = [_loss(model, windows[i : i + batch], autocast).item() * len(windows[i : i + batch])
                  for i in range(0, len(windows), batch)]
        out[domain] = sum(losses) / len(windows)
    model.train()
    return out


def train(cfg: TargetTrainConfig, log=print) -> Path:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(cfg.data_dir / "tokenizer" / "tokenizer.json"))
    torch.manual_seed(cfg.seed)
    # A reply ends at <|end|> as much as a document at <|endoftext|>: both stop generation.
    eos = (tok.token_to_id(EOS), tok.token_to_id(END))
    mcfg = model_config(cfg, tok.get_vocab_size(), tok.token_to_id(BOS), eos)
    model = CausalLM(mcfg)
    _init(model, cfg.layers)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    train_tokens = load_tokens(cfg.data_dir, "train")
    sampler = WindowSampler(train_tokens, cfg.seq_len, cfg.seed)
    long_sampler = WindowSampler(train_tokens, cfg.long_seq_len, cfg.seed + 1) if cfg.long_seq_len else None
    val = load_tokens(cfg.data_dir, "val")
    evals = {d: eval_windows(val[d], cfg.seq_len, cfg.eval_tokens) for d in DOMAINS}
    autocast = native_bf16(torch.device("cpu"))
    step, elapsed = resume_state(cfg.run_dir, model, opt)
    if step == 0 and cfg.resume_from is not None:
        step, elapsed = resume_export(cfg.resume_from, model)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    log_path = cfg.run_dir / "log.jsonl"
    params = sum(p.numel() for p in model.parameters())
    log(f"target: {params / 1e6:.1f}M parameters, {cfg.total_steps} steps of {cfg.batch_size}x{cfg.seq_len} "
        f"tokens, autocast bf16={autocast}, starting at step {step}")
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[info]}"), TimeRemainingColumn()) as bar:
        task = bar.add_task("train target", total=cfg.total_steps, completed=step, info="")
        while step < cfg.total_steps:
            t0 = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = warmup_cosine(step, cfg.total_steps, cfg.warmup_steps, cfg.lr)
            if step < cfg.long_start:
                windows = sampler.batch(step, cfg.batch_size)
            else:
                windows = long_sampler.batch(step - cfg.long_start, cfg.long_batch)
            loss = _loss(model, windows, autocast)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            step += 1
            elapsed += time.perf_counter() - t0
            record = {"step": step, "tokens": step * cfg.batch_size * cfg.seq_len, "loss": round(loss.item(), 4),
                      "seq_len": windows.shape[1] - 1, "elapsed_s": round(elapsed, 1)}
            if step % cfg.eval_every == 0 or step == cfg.total_steps:
                record["val"] = {d: round(v, 4) for d, v in evaluate(model, evals, autocast).items()}
            if step == cfg.total_steps and cfg.long_seq_len:
                record["val_long"] = _long_eval(model, val, cfg, autocast)
            with log_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            tok_s = record["tokens"] / max(elapsed, 1e-9)
            bar.update(task, completed=step, info=f"loss {record['loss']:.3f} {tok_s:.0f} tok/s")
            if step % cfg.checkpoint_every == 0 or step == cfg.total_steps:
                save_state(cfg.run_dir, model, opt, step, elapsed, {k: str(v) for k, v in asdict(cfg).items()})
            if step % cfg.export_every == 0:
                snapshot(cfg, model, step, elapsed)
    return export(cfg, model)


def _long_eval(model: CausalLM, val: dict, cfg: TargetTrainConfig, autocast: bool) -> dict[str, dict[str, float]]:
    """Held-out loss per domain over the same tokens cut into seq_len and into long_seq_len windows."""
    out = {}
    for d in DOMAINS:
        n = min(len(val[d]) - 1, 4 * cfg.eval_tokens) // cfg.long_seq_len * cfg.long_seq_len
        if n == 0:
            continue  # a validation split shorter than one long window (tiny test corpora)
        short = evaluate(model, {d: eval_windows(val[d], cfg.seq_len, n)}, autocast)[d]
        long = evaluate(model, {d: eval_windows(val[d], cfg.long_seq_len, n)}, autocast, batch=2)[d]
        out[d] = {str(cfg.seq_len): round(short, 4), str(cfg.long_seq_len): round(long, 4)}
    return out


def snapshot(cfg: TargetTrainConfig, model: CausalLM, step: int, elapsed: float) -> Path:
    """An export of the weights so far with the step it was taken at (`trainer_state.json`)."""
    out = save_model(model, cfg.run_dir / "export.tmp", torch.bfloat16)
    (out / "trainer_state.json").write_text(json.dumps({"step": step, "elapsed_s": round(elapsed, 1)}) + "\n")
    final = cfg.run_dir / "export"
    if final.exists():
        shutil.rmtree(final)
    out.replace(final)
    return final


def resume_export(path: Path, model: CausalLM) -> tuple[int, float]:
    """Weights and (step, elapsed) of an export: a restart with fresh optimizer moments."""
    from safetensors.torch import load_file

    state = load_file(str(path / "model.safetensors"))
    missing = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False).missing_keys
    if any(not k.endswith("lm_head.weight") for k in missing):
        raise ValueError(f"{path} does not match the configured model: missing {missing[:3]}")
    meta = json.loads((path / "trainer_state.json").read_text())
    return int(meta["step"]), float(meta["elapsed_s"])



def export(cfg: TargetTrainConfig, model: CausalLM) -> Path:
    """bf16 weights in Hugging Face layout with the tokenizer and generation config."""
    out = save_model(model, cfg.out_dir, torch.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(cfg.data_dir / "tokenizer" / name, out / name)
    shutil.copy(cfg.data_dir / "manifest.json", out / "data_manifest.json")  # corpus provenance and hashes
    if (cfg.run_dir / "log.jsonl").is_file():
        shutil.copy(cfg.run_dir / "log.jsonl", out / "training_log.jsonl")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": model.config.bos_token_id, "eos_token_id": list(model.config.eos_token_ids)}, indent=2)
        + "\n")
    return out
