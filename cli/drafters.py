"""`dspark data target-cache`, `dspark train drafter`, `dspark calibrate`, `dspark eval`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from drafter_worker.config import HeadType, Method

DRAFTER_METHODS = tuple(m.value for m in Method)


def add_cache_parser(data_sub) -> None:
    p = data_sub.add_parser("target-cache", help="target rollouts on train/val prompts and their feature caches")
    p.add_argument("--target", default="dspark-target")
    p.add_argument("--data-dir", type=Path, default=Path("build/data"))
    p.add_argument("--cache-dir", type=Path, help="default: build/drafters/TARGET")
    p.add_argument("--prompts-per-domain", type=int, default=1200)
    p.add_argument("--val-per-domain", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8, help="the target's sampling temperature for rollouts")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--temperatures", type=float, nargs="+", default=(),
                   help="serving temperatures, one per prompt by its id (e.g. 0 1); overrides --temperature")
    p.add_argument("--code-prompts-per-file", type=int, default=3)
    p.add_argument("--batch", type=int, default=48, help="requests decoded together in the rollouts")
    p.add_argument("--rollout-dtype", default="float32", help="the dtype the target generates in (auto: bf16 "
                   "where native)")
    p.add_argument("--feature-dtype", default="float32", help="the dtype the target's features are taken in (auto: "
                   "bf16 where native, as a real target is served)")
    p.add_argument("--compile", action="store_true", help="run the rollouts' target steps under torch.compile")
    p.add_argument("--mirror-dir", type=Path, help="gzip copies of the rollouts (commit them to resume elsewhere)")
    p.add_argument("--rollouts-only", action="store_true", help="stop after the rollouts (no feature cache)")
    p.add_argument("--lse-vocab", type=Path, metavar="D2T", help="a draft vocabulary (`dspark data draft-vocab "
                   "--out`): the train split's log-sum-exp over its ids only, an eighth of Gemma's head")
    p.add_argument("--cache-per-domain", type=int, metavar="N", help="features of the first N train rollouts of "
                   "each domain only (default: all): the cache of a shorter training run, domains balanced")
    p.add_argument("--shard-worker", type=_shard_worker, metavar="K/N",
                   help="build only the cache shards numbered K mod N (N processes share one build)")


def _shard_worker(text: str) -> tuple[int, int]:
    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit() and int(k) < int(n)):
        raise argparse.ArgumentTypeError(f"--shard-worker takes K/N with 0 <= K < N, not {text!r}")
    return int(k), int(n)


def add_vocab_parser(data_sub) -> None:
    p = data_sub.add_parser("draft-vocab", help="a draft vocabulary (EAGLE-3's d2t) from the target's rollouts, "
                            "with its coverage of held-out rollouts per domain")
    p.add_argument("--rollouts", type=Path, required=True, help="rollouts.train.jsonl: the tokens counted")
    p.add_argument("--held-out", type=Path, help="rollouts.val.jsonl: coverage measured there too")
    p.add_argument("--size", type=int, nargs="+", default=[32768], help="draft vocabulary sizes (the first is saved)")
    p.add_argument("--vocab-size", type=int, help="the target's vocabulary (default: largest id + 1 seen)")
    p.add_argument("--out", type=Path, help="where d2t [Vd] int64 is saved (safetensors)")


def run_draft_vocab(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    from training.draft_vocab import coverage, frequency_d2t, rollout_counts
    from training.rollouts import read

    train = read(args.rollouts)
    held = read(args.held_out) if args.held_out else []
    vocab = args.vocab_size or 1 + max(max(r["response_ids"], default=0) for r in train + held)
    counts = rollout_counts(train, vocab)
    report = {}
    for size in args.size:
        d2t = frequency_d2t(counts, min(size, vocab))
        report[size] = {"train": coverage(d2t, train, vocab)}
        if held:
            report[size]["held_out"] = coverage(d2t, held, vocab)
        if args.out is not None and size == args.size[0]:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            save_file({"d2t": d2t}, str(args.out))
    print(json.dumps({"response_tokens": int(counts.sum()), "distinct": int((counts > 0).sum()),  # noqa: T201
                      "coverage": report}, indent=1))
    return 0


def add_train_parser(train_sub) -> None:
    p = train_sub.add_parser("drafter", help="train a drafter on the target cache (resumable)")
    p.add_argument("--method", required=True, choices=DRAFTER_METHODS)
    p.add_argument("--target", default="dspark-target")
    p.add_argument("--head", default="markov", choices=[h.value for h in HeadType], help="dspark sequential head")
    p.add_argument("--data-dir", type=Path, default=Path("build/data"))
    p.add_argument("--cache-dir", type=Path, help="default: build/drafters/TARGET (built when missing)")
    p.add_argument("--run-dir", type=Path, help="resumable state; default: CACHE_DIR/runs/METHOD")
    p.add_argument("--out", type=Path, help="exported drafter; default: models/TARGET-METHOD")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--epochs", type=float, help="instead of --steps: passes over the cache's sequences")
    p.add_argument("--time-budget", type=float, default=0.0, help="hours of training at most: the run stops "
                   "there, its learning-rate decay spread over that time (--steps / --epochs stay a cap)")
    p.add_argument("--no-autocast", action="store_true", help="train in fp32 even where bf16 is native")
    p.add_argument("--tap-scale", action="store_true", help="each tap at unit RMS in training (folded into the "
                   "context projection at export: serving is unchanged); for targets whose taps differ in scale")
    p.add_argument("--patience", type=int, default=0,
                   help="stop after this many evaluations without a better held-out acceptance (0: never)")
    p.add_argument("--batch-sequences", type=int, default=8)
    p.add_argument("--anchors", type=int, default=24, help="anchors per sequence")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--standin-weight", type=float, default=0.0, help="block drafters: weight of the stand-in "
                   "term, which trains the states a block drafts ahead from (docs/drafters.md)")
    p.add_argument("--init-from", type=Path, help="an exported drafter to fine-tune instead of fresh weights")
    p.add_argument("--mirror-dir", type=Path, help="a compact copy of the run, refreshed every --mirror-every "
                   "steps: commit it to resume the run on a fresh machine (used when RUN_DIR holds no state)")
    p.add_argument("--mirror-every", type=int, default=250)
    p.add_argument("--draft-vocab", type=Path, help="a draft vocabulary (d2t, from `dspark data draft-vocab "
                   "--out`): the drafter's head scores only its ids")
    p.add_argument("--unroll", type=int, default=0, help="chain drafters: training-time-test steps (0: the block "
                   "size; MTP-1 with 2 also learns to draft from its own output, as drafting ahead does)")


def _cache_dir(args) -> Path:
    return args.cache_dir or Path("build/drafters") / args.target


def _log():
    console = Console(stderr=True)
    return lambda msg: console.print(msg, markup=False, highlight=False)


def run_target_cache(args: argparse.Namespace) -> int:
    from training.drafter_data import prepare
    from training.rollouts import RolloutConfig

    lse_ids = None
    if args.lse_vocab is not None:
        import torch
        from safetensors.torch import load_file

        d2t = load_file(str(args.lse_vocab))["d2t"]
        lse_ids = d2t + torch.arange(len(d2t))
    cfg = RolloutConfig(prompts_per_domain=args.prompts_per_domain, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, top_p=args.top_p, temperatures=tuple(args.temperatures),
                        code_prompts_per_file=args.code_prompts_per_file, batch=args.batch, compile=args.compile)
    caches = prepare(args.target, _cache_dir(args), args.data_dir, cfg, val_per_domain=args.val_per_domain,
                     mirror_dir=args.mirror_dir, rollout_dtype=args.rollout_dtype, rollouts_only=args.rollouts_only,
                     feature_dtype=args.feature_dtype, shard_worker=args.shard_worker,
                     cache_per_domain=args.cache_per_domain,
                     lse_ids=lse_ids)
    _log()(f"target {'rollouts' if args.rollouts_only else 'caches'}: {', '.join(str(c) for c in caches.values())}")
    return 0


def run_train_drafter(args: argparse.Namespace) -> int:
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    from drafter_worker.config import default_config
    from services.loader import load_model
    from services.registry import model_name, resolve_model
    from training.drafter import DrafterTrainConfig, train
    from training.drafter_data import prepare
    from training.rollouts import RolloutConfig
    from training.target_cache import TargetCache

    cache_dir = _cache_dir(args)
    caches = prepare(args.target, cache_dir, args.data_dir, RolloutConfig())
    train_cache, val_cache = TargetCache(caches["train"]), TargetCache(caches["val"])
    target_dir = resolve_model(args.target)
    mask_id = mask_token_id(Tokenizer.from_file(str(target_dir / "tokenizer.json")))
    d2t = None if args.draft_vocab is None else load_file(str(args.draft_vocab))["d2t"]
    _check_lse_vocab(train_cache, d2t)
    dcfg = default_config(args.method, model_name(args.target), train_cache.tap_layers, mask_id, args.head,
                          None if d2t is None else len(d2t))
    suffix = args.method if args.method != "dspark" or args.head == "markov" else f"dspark-{args.head}"
    cfg = DrafterTrainConfig(
        run_dir=args.run_dir or cache_dir / "runs" / suffix,
        out_dir=args.out or Path("models") / f"{model_name(args.target)}-{suffix}",
        steps=_steps(args, len(train_cache)), batch_sequences=args.batch_sequences,
        anchors_per_sequence=args.anchors, lr=args.lr, eval_every=args.eval_every, seed=args.seed,
        patience=args.patience, autocast=False if args.no_autocast else None, standin_weight=args.standin_weight,
        init_from=args.init_from, unroll=args.unroll, mirror_dir=args.mirror_dir, mirror_every=args.mirror_every,
        time_budget_s=args.time_budget * 3600, tap_scale=args.tap_scale)
    target = load_model(target_dir, "float32", "cpu")
    out = train(dcfg, target, train_cache, val_cache, cfg, log=_log(), d2t=d2t)
    _log()(f"exported the drafter to {out}")
    return 0


def _check_lse_vocab(cache, d2t) -> None:
    """A cache whose log-sum-exp runs over a draft vocabulary trains a drafter over that one only."""
    import torch

    from training.target_cache import lse_vocab_name

    if cache.lse_vocab == "full":
        return
    if d2t is None or lse_vocab_name(d2t + torch.arange(len(d2t))) != cache.lse_vocab:
        raise SystemExit(f"the train cache's log-sum-exp runs over a draft vocabulary ({cache.lse_vocab[:12]}…): "
                         "train with --draft-vocab naming that same d2t")


def mask_token_id(tokenizer) -> int:
    """The [MASK] row a block drafter's empty slots embed: dspark's own targets' `<|mask|>`, Gemma's `<mask>`,
    BERT-style `[MASK]` — the first the target's tokenizer has."""
    from services.chat_template import MASK

    for token in (MASK, "<mask>", "[MASK]"):
        found = tokenizer.token_to_id(token)
        if found is not None:
            return found
    raise SystemExit(f"the target's tokenizer has no mask token ({MASK}, <mask> or [MASK]) for a block drafter")


def _steps(args: argparse.Namespace, sequences: int) -> int:
    if args.epochs is None:
        return args.steps
    if args.epochs <= 0:
        raise SystemExit(f"--epochs must be positive, got {args.epochs}")
    return max(1, round(args.epochs * sequences / args.batch_sequences))


def add_eval_parsers(sub) -> None:
    cal = sub.add_parser("calibrate", help="fit Sequential Temperature Scaling of a drafter's confidences")
    cal.add_argument("--target", default="dspark-target")
    cal.add_argument("--drafter", required=True, help="drafter name or directory (calibration.json is written there)")
    cal.add_argument("--data-dir", type=Path, default=Path("build/data"), help="held-out prompts: the val split")
    cal.add_argument("--prompts-per-domain", type=int, default=32)
    cal.add_argument("--gamma", type=int, default=7)
    cal.add_argument("--temperature", type=float, default=1.0, help="the serving temperature")
    cal.add_argument("--method", choices=("platt", "sts"), default="platt",
                     help="platt: a temperature and a bias per position; sts: a temperature per position")
    cal.add_argument("--max-tokens", type=int, default=96)
    cal.add_argument("--batch", type=int, default=16)
    cal.add_argument("--dtype", default="float32", help="of the target and drafter (auto: bf16 where native, as a "
                     "real target is served)")

    ev = sub.add_parser("eval", help="τ, per-position acceptance and confidence calibration of drafters")
    ev.add_argument("--target", default="dspark-target")
    ev.add_argument("--drafter", required=True, help="comma-separated drafter names/directories, or 'all'")
    ev.add_argument("--datasets", default="code,math,chat")
    ev.add_argument("--datasets-dir", type=Path, default=Path("benchmarks/datasets"))
    ev.add_argument("--gamma", default="7", help="comma-separated γ values (mtp always drafts 1)")
    ev.add_argument("--temperature", default="1", help="comma-separated temperatures")
    ev.add_argument("--batch", default="1,16", help="comma-separated batch sizes (1 = DeepSpec's setting)")
    ev.add_argument("--prompts", type=int, default=24, help="prompts per dataset")
    ev.add_argument("--max-tokens", type=int, default=96)
    ev.add_argument("--out-dir", type=Path, default=Path("build/eval"), help="JSON, Markdown and PNG files")
    ev.add_argument("--markdown", type=Path, help="also write the Markdown report here")
    ev.add_argument("--json", action="store_true", help="print the JSON report on stdout")
    ev.add_argument("--dtype", default="float32", help="of the target and drafters (auto: bf16 where native, as a "
                    "real target is served)")


def _load_pair(target_name: str, drafter: str, dtype: str = "float32"):
    from drafter_worker.checkpoint import drafter_config, load_drafter
    from services.loader import load_model
    from services.registry import resolve_model

    drafter_dir = resolve_model(drafter)
    target = load_model(resolve_model(target_name), dtype, "cpu", tap_layers=drafter_config(drafter_dir).tap_layers)
    model, calibration = load_drafter(drafter_dir, target, dtype)
    return target, model, calibration, drafter_dir


def run_calibrate(args: argparse.Namespace) -> int:
    from drafter_worker.calibration import Calibration
    from drafter_worker.drafter import Drafter
    from services.registry import resolve_model
    from services.tokenizer import TextTokenizer
    from services.types import SamplingParams
    from training.calibration_fit import fit_platt, fit_sts
    from training.eval import evaluate
    from training.rollouts import prompts

    target, model, _, drafter_dir = _load_pair(args.target, args.drafter, args.dtype)
    if model.dconfig.confidence_head is False:
        raise ValueError(f"{drafter_dir.name} has no confidence head to calibrate")
    tok = TextTokenizer.from_dir(resolve_model(args.target))
    ids = [(tok.encode(p) if isinstance(p, str) else tok.chat_ids(p))[-256:]
           for _, _, p in prompts(args.data_dir, "val", args.prompts_per_domain, 1)]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=1)
    run = evaluate.run(target, Drafter(model), ids, args.gamma, params, tok.eos_token_ids, args.batch)
    z, labels, valid = run.cycles.tensors(args.gamma)
    fit = fit_platt if args.method == "platt" else fit_sts
    calibration = fit(z, labels, valid, serving_temperature=args.temperature)
    path = drafter_dir / "calibration.json"  # a fit of the other kind (T = 0 or T > 0) stays beside this one
    calibration.beside(Calibration.load(path) if path.is_file() else None).save(path)
    temps = [round(t, 3) for t in calibration.position_temperatures]
    _log()(f"{args.method} on {len(z)} held-out cycles: T_k = {temps}, "
           f"b_k = {[round(b, 3) for b in calibration.position_biases]}; "
           f"ECE {[round(100 * e, 1) for e in calibration.ece_before]}% → "
           f"{[round(100 * e, 1) for e in calibration.ece_after]}%; wrote {drafter_dir / 'calibration.json'}")
    return 0


def run_eval(args: argparse.Namespace) -> int:
    import json
    import sys

    from drafter_worker.drafter import Drafter
    from services.registry import drafters_of, resolve_model
    from services.tokenizer import TextTokenizer
    from training.eval.report import EvalSpec, command_line, evaluate_drafter, markdown, read_prompts

    names = drafters_of(args.target) if args.drafter == "all" else args.drafter.split(",")
    spec = EvalSpec(datasets=tuple(args.datasets.split(",")), gammas=tuple(int(g) for g in args.gamma.split(",")),
                    temperatures=tuple(float(t) for t in args.temperature.split(",")),
                    batches=tuple(int(b) for b in args.batch.split(",")), prompts=args.prompts,
                    max_tokens=args.max_tokens)
    tok = TextTokenizer.from_dir(resolve_model(args.target))
    prompt_ids = {d: read_prompts(args.datasets_dir, d, spec.prompts, tok) for d in spec.datasets}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = {"command": command_line(sys.argv[1:]), "target": args.target, "dtype": args.dtype,
              "datasets": list(spec.datasets),
              "datasets_dir": str(args.datasets_dir),
              "prompts": spec.prompts,
              "max_tokens": spec.max_tokens, "drafters": {}}
    log = _log()
    for name in names:
        target, model, calibration, _ = _load_pair(args.target, name, args.dtype)
        gammas = (1,) if model.dconfig.block_size == 1 else spec.gammas
        runs = []
        for gamma in gammas:
            for temperature in spec.temperatures:
                plot = args.out_dir / f"reliability-{name}-g{gamma}-t{temperature:g}.png"
                # The drafter reports raw confidences: the report applies `calibration` itself (once).
                runs.append(evaluate_drafter(target, Drafter(model), calibration, prompt_ids, spec,
                                             tok.eos_token_ids, gamma, temperature, plot, log))
        report["drafters"][name] = runs
    text = markdown(report)
    (args.out_dir / "eval.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out_dir / "eval.md").write_text(text)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)
    sys.stdout.write(json.dumps(report) + "\n" if args.json else text)
    return 0
