"""`dspark train drafter`: train an MTP / EAGLE-3 / DFlash / DSpark drafter on the target cache.

Each step draws `batch_sequences` cached sequences and `anchors_per_sequence` anchors in each. Block
drafters run one parallel forward per anchor; chain drafters unroll the whole sequences for γ steps
(training-time test) and read the rows of the same anchors, so every method is scored on the same
(anchor, k) pairs: slot k predicts the token at anchor + k + 1, target logits = LMHead(hidden[anchor + k]).
State goes to `run_dir/state.pt` atomically every `checkpoint_every` steps; a rerun resumes. With `mirror_dir`,
a compact copy (training/run_mirror.py) goes there every `mirror_every` steps: committed, it resumes the run on
a fresh machine.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from drafter_worker.checkpoint import DraftModel, build_draft_model, load_drafter, save_drafter
from drafter_worker.config import DrafterConfig, Method
from services.loader import native_bf16
from services.model import CausalLM
from training import tap_scale as tap_scales
from training.anchors import block_labels, sample_anchors
from training.drafter_losses import decay_weights, dflash_loss, dspark_loss, soft_ce_loss, standin_loss, step_weights
from training.early_stop import EarlyStop, expected_accepted
from training.run_mirror import load_mirror, save_mirror
from training.schedule import cosine_at, warmup_cosine
from training.state import resume_state, save_state
from training.target_cache import TargetCache


@dataclass(frozen=True, slots=True)
class DrafterTrainConfig:
    run_dir: Path
    out_dir: Path
    steps: int = 1000
    batch_sequences: int = 8
    anchors_per_sequence: int = 32
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_sequences: int = 48
    checkpoint_every: int = 50
    seed: int = 42
    patience: int = 0  # evaluations without a better held-out acceptance before stopping; 0: run every step
    autocast: bool | None = None  # bf16 autocast of the training steps; None: where the device has native bf16
    standin_weight: float = 0.0  # block drafters: weight of the stand-in term (drafting ahead, drafter_losses)
    init_from: Path | None = None  # an exported drafter to start from (a fine-tune) instead of fresh weights
    unroll: int = 0  # chain drafters: training-time-test steps (0: the block size); MTP-1 drafts one token but
    # drafting ahead runs it on its own output as context (drafter_worker/predraft.py), which a second step trains
    mirror_dir: Path | None = None  # a compact copy of the run for git (run_mirror.py); None: none
    mirror_every: int = 250
    time_budget_s: float = 0.0  # > 0: stop when the run's training time reaches it, the cosine decay spread over
    # that time rather than over `steps` (which stays a cap): a run that must end within a session ends decayed
    tap_scale: bool = False  # each tap at unit RMS in training, folded into fc at export (training/tap_scale.py)


@dataclass(slots=True)
class Batch:
    ids: torch.Tensor  # [B, S] int64, right-padded
    taps: torch.Tensor  # [B, S, T*d]
    hidden: torch.Tensor  # [B, S, d] target final normed hidden
    seq: torch.Tensor  # [A] sequence of each anchor
    anchors: torch.Tensor  # [A] anchor positions
    labels: torch.Tensor  # [A, γ]
    eval_mask: torch.Tensor  # [A, γ]
    lse: torch.Tensor | None = None  # [B, S] the target's log-sum-exp over its whole vocabulary


def make_batch(cache: TargetCache, indices: list[int], anchors: int, gamma: int, gen: torch.Generator,
               device: torch.device, tap_scale: torch.Tensor | None = None) -> Batch:
    seqs = [cache[i] for i in indices]
    width = max(len(s.ids) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    taps = torch.zeros(len(seqs), width, seqs[0].taps.shape[1])
    hidden = torch.zeros(len(seqs), width, seqs[0].hidden.shape[1])
    lse = None if seqs[0].lse is None else torch.zeros(len(seqs), width)
    seq_of, anchor_list, labels, masks = [], [], [], []
    for b, s in enumerate(seqs):
        n = len(s.ids)
        ids[b, :n], taps[b, :n], hidden[b, :n] = s.ids, s.taps, s.hidden
        if lse is not None:
            lse[b, :n] = s.lse
        pos = sample_anchors(s.loss_mask, anchors, gen)
        lab, mask = block_labels(s.ids, s.loss_mask, pos, gamma)
        seq_of.append(torch.full_like(pos, b))
        anchor_list.append(pos)
        labels.append(lab)
        masks.append(mask)
    if tap_scale is not None:
        taps = tap_scales.apply(taps, tap_scale)
    return Batch(ids.to(device), taps.to(device), hidden.to(device), torch.cat(seq_of).to(device),
                 torch.cat(anchor_list).to(device), torch.cat(labels).to(device), torch.cat(masks).to(device),
                 None if lse is None else lse.to(device))


def target_logp(model: DraftModel, batch: Batch, rows: torch.Tensor) -> torch.Tensor:
    """log p_t [A, γ, Vd] at the batch's rows [A, γ]: over a draft vocabulary its rows of the head less the cache's
    log-sum-exp over the whole vocabulary (the head's other rows are never run), else a log-softmax."""
    logits = model.lm_head(batch.hidden[batch.seq[:, None], rows]).float()  # [A, γ, Vd]
    if not model.reduced_vocab:
        return logits.log_softmax(-1)
    if batch.lse is None:
        raise ValueError("a drafter over a draft vocabulary trains on a target cache with lse.npy (version 2)")
    return logits - batch.lse[batch.seq[:, None], rows][..., None]


def forward_loss(model: DraftModel, batch: Batch, standin_weight: float = 0.0
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The method's loss on one batch, and its terms (incl. per-slot acceptance 1 − ½‖p_d − p_t‖₁ [A, γ]);
    block drafters add `standin_weight` × the stand-in term. γ is the batch's (chain drafters may unroll past
    their block size)."""
    dcfg: DrafterConfig = model.dconfig
    gamma = batch.labels.shape[1]
    rows = (batch.anchors[:, None] + torch.arange(gamma, device=batch.ids.device)).clamp(max=batch.ids.shape[1] - 1)
    logp_t = target_logp(model, batch, rows)  # [A, γ, Vd]
    if dcfg.method.is_block:
        b, s = batch.ids.shape
        positions = torch.arange(s, device=batch.ids.device).expand(b, s)
        ctx = model.context(batch.taps)  # [B, S, d]
        kv = model.rows_kv(ctx, positions)  # per layer [B, Hkv, S, Dh]
        anchor_tokens = batch.ids[batch.seq, batch.anchors]
        h = model.backbone_packed(anchor_tokens, batch.anchors, batch.seq, kv, gamma)  # [A, γ, d]
        prev = torch.cat([anchor_tokens[:, None], batch.labels[:, :-1]], dim=1)  # teacher forcing [A, γ]
        logits, conf = model.teacher_forced(h, prev)
        weights = decay_weights(batch.eval_mask)
        labels = model.draft_ids(batch.labels)  # [A, γ]; Vd for a token outside the draft vocabulary
        inside = labels < model.draft_vocab
        if dcfg.method is Method.DFLASH:
            loss, terms = dflash_loss(logits, logp_t, labels, weights, inside)
        else:
            loss, terms = dspark_loss(logits, logp_t, labels, weights, conf, labels_inside=inside)
        if standin_weight:
            terms["standin"] = standin_loss(h, ctx[batch.seq[:, None], rows], batch.eval_mask)
            loss = loss + standin_weight * terms["standin"]
        return loss, terms
    picked = model.unrolled_at(batch.taps, batch.ids, batch.seq, batch.anchors, gamma)  # [A, γ, d] row a−1+k of step k
    return soft_ce_loss(model.logits(picked), logp_t, step_weights(batch.eval_mask))


def train(dcfg: DrafterConfig, target: CausalLM, cache: TargetCache, val: TargetCache, cfg: DrafterTrainConfig,
          log=print, d2t: torch.Tensor | None = None) -> Path:
    """`d2t`: the draft vocabulary (training/draft_vocab.py) when `dcfg` has one."""
    if cfg.unroll and dcfg.method.is_block:
        raise ValueError(f"unroll is for chain drafters; a {dcfg.method} block has its size fixed")
    steps_per_anchor = cfg.unroll or dcfg.block_size
    torch.manual_seed(cfg.seed)
    if (d2t is None) != (dcfg.draft_vocab_size is None) or (d2t is not None and len(d2t) != dcfg.draft_vocab_size):
        raise ValueError("a draft vocabulary needs its d2t, of draft_vocab_size ids")
    model = build_draft_model(dcfg, target, d2t=d2t).float().train()
    if cfg.init_from is not None and not (cfg.run_dir / "state.pt").is_file():  # a resume has its own weights
        model.load_state_dict(load_drafter(cfg.init_from, target, "float32")[0].state_dict())
    scale = tap_scales.for_run(cfg.run_dir, cache, len(dcfg.tap_layers)) if cfg.tap_scale else None
    if scale is not None:
        log(f"tap scale (1 / RMS per tap): {[round(x, 5) for x in scale.tolist()]}")
        if cfg.init_from is not None and not (cfg.run_dir / "state.pt").is_file():
            tap_scales.unfold(model, scale)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    step, elapsed = resume_state(cfg.run_dir, model, opt)
    if step == 0 and cfg.mirror_dir is not None:
        step, elapsed = load_mirror(cfg.mirror_dir, cfg.run_dir, model, opt)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    keeper = EarlyStop.load(cfg.run_dir, cfg.patience)
    device = target.device
    autocast = native_bf16(device) if cfg.autocast is None else cfg.autocast  # validation stays fp32
    warmup = max(1, int(cfg.warmup_ratio * cfg.steps))
    budget = cfg.time_budget_s
    if budget > 0:
        warmup = min(warmup, 50)  # the step count is a cap then, not the length of the run
    log(f"{dcfg.method}: {sum(p.numel() for p in params) / 1e6:.2f}M trainable parameters, {cfg.steps} steps of "
        f"{cfg.batch_sequences}x{cfg.anchors_per_sequence} anchors, γ={dcfg.block_size}, bf16 autocast {autocast}, "
        f"starting at step {step}")
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[info]}"), TimeRemainingColumn()) as bar:
        task = bar.add_task(f"train {dcfg.method}", total=cfg.steps, completed=step, info="")
        while step < cfg.steps and not keeper.stopped and not (budget > 0 and elapsed >= budget):
            t0 = time.perf_counter()
            for group in opt.param_groups:
                if budget > 0 and step >= warmup:
                    group["lr"] = cosine_at(elapsed / budget, cfg.lr, floor_ratio=0.0)
                else:
                    group["lr"] = warmup_cosine(step, cfg.steps, warmup, cfg.lr, floor_ratio=0.0)
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)  # batch of step n is fixed: resumable
            indices = torch.randint(len(cache), (cfg.batch_sequences,), generator=gen).tolist()
            batch = make_batch(cache, indices, cfg.anchors_per_sequence, steps_per_anchor, gen, device, scale)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss, terms = forward_loss(model, batch, cfg.standin_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            step += 1
            elapsed += time.perf_counter() - t0
            record = {"step": step, "elapsed_s": round(elapsed, 1), "loss": round(loss.item(), 4),
                      **{k: round(v.item(), 4) for k, v in terms.items() if v.dim() == 0}}
            last = step == cfg.steps or (budget > 0 and elapsed >= budget)
            if step % cfg.eval_every == 0 or last:
                record["val"] = evaluate(model, val, cfg, scale)
                if keeper.update(cfg.run_dir, model, step, record["val"]["expected_accepted"]):
                    log(f"stopping early at step {step}: no better held-out acceptance since step {keeper.best_step}")
            with (cfg.run_dir / "log.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")
            bar.update(task, completed=step, info=f"loss {record['loss']:.3f}")
            if step % cfg.checkpoint_every == 0 or last or keeper.stopped:
                save_state(cfg.run_dir, model, opt, step, elapsed, {k: str(v) for k, v in asdict(cfg).items()})
            if cfg.mirror_dir is not None and (step % cfg.mirror_every == 0 or last or keeper.stopped):
                save_mirror(cfg.mirror_dir, cfg.run_dir, model, opt, step, elapsed, keeper.best_step)
    best = keeper.restore_best(cfg.run_dir, model)
    if best is not None:
        log(f"exporting the weights of step {best} (held-out expected accepted {keeper.best:.3f})")
    earlier = ""  # a fine-tune's log follows the log of the weights it started from (read before they are replaced)
    if cfg.init_from is not None and (Path(cfg.init_from) / "training_log.jsonl").is_file():
        earlier = (Path(cfg.init_from) / "training_log.jsonl").read_text()
    if scale is not None:
        tap_scales.fold(model, scale)
    out = save_drafter(model, cfg.out_dir)
    if (cfg.run_dir / "log.jsonl").is_file():  # a run of 0 steps exports its starting weights, with no log
        (out / "training_log.jsonl").write_text(earlier + (cfg.run_dir / "log.jsonl").read_text())
    return out


@torch.no_grad()
def evaluate(model: DraftModel, val: TargetCache, cfg: DrafterTrainConfig, tap_scale: torch.Tensor | None = None
             ) -> dict:
    """Held-out loss and expected acceptance 1 − ½‖p_d − p_t‖₁ per slot (T = 1, teacher-forced prefix)."""
    model.eval()
    gen = torch.Generator().manual_seed(cfg.seed)
    losses, accepts = [], []
    indices = list(range(min(cfg.eval_sequences, len(val))))
    for start in range(0, len(indices), cfg.batch_sequences):
        batch = make_batch(val, indices[start : start + cfg.batch_sequences], cfg.anchors_per_sequence,
                           model.dconfig.block_size, gen, model.lm_head.weight.device, tap_scale)
        loss, terms = forward_loss(model, batch)
        losses.append(loss.item())
        mask = batch.eval_mask.float()
        accepts.append(((terms["accept"] * mask).sum(0), mask.sum(0)))
    model.train()
    num = sum(a for a, _ in accepts)
    den = sum(m for _, m in accepts).clamp_min(1)
    rates = (num / den).tolist()
    return {"loss": round(sum(losses) / len(losses), 4), "accept@k": [round(x, 4) for x in rates],
            "expected_accepted": round(expected_accepted(rates), 4)}
