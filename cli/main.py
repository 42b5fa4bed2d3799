"""`dspark` command line: serve (and its roles), generate, profile, data, train, eval, models."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from cli.bench import add_parser as add_bench_parser
from cli.bench import run_bench
from cli.convert import add_parser as add_convert_parser
from cli.convert import run_convert
from cli.drafters import (
    add_cache_parser,
    add_eval_parsers,
    add_train_parser,
    add_vocab_parser,
    run_calibrate,
    run_draft_vocab,
    run_eval,
    run_target_cache,
    run_train_drafter,
)
from cli.scale import add_parsers as add_scale_parsers
from cli.scale import run_scale
from cli.serve import add_parsers as add_serve_parsers
from cli.serve import run_role, run_serve
from cli.simulate import add_parser as add_simulate_parser
from cli.simulate import run_simulate
from cli.top import add_parser as add_top_parser
from cli.top import run_top
from services.errors import DsparkError

METHODS = ("none", "ngram", "mtp", "eagle3", "dflash", "dspark")
POLICIES = ("none", "fixed")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="a shipped model's name (dspark models) or a Hugging Face model directory")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32", "float16"),
                   help="auto: bfloat16 where the device runs it natively, else float32")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    add_serve_parsers(sub)
    add_top_parser(sub)
    add_convert_parser(sub)
    add_scale_parsers(sub)
    add_bench_parser(sub)
    add_simulate_parser(sub)

    gen = sub.add_parser("generate", help="generate in-process (no Ray, no gRPC), with or without speculation")
    _add_model_args(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts", type=Path, help='JSONL file, one {"prompt": "..."} per line')
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn of the chat template")
    gen.add_argument("--drafter", help="trained drafter: a shipped name (dspark models) or a directory")
    gen.add_argument("--method", default="none", choices=METHODS, help="drafting method")
    gen.add_argument("--gamma", type=int, default=4, help="block size γ: draft tokens per cycle")
    gen.add_argument("--policy", choices=POLICIES, help="verify-length policy (default: fixed with a drafter)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 is off")
    gen.add_argument("--seed", type=int, help="per-request seed (request i uses seed + i)")
    gen.add_argument("--max-batch", type=int, default=8, help="requests decoded together (KV slots)")
    gen.add_argument("--max-len", type=int, default=1024, help="positions per KV slot")
    gen.add_argument("--compile", action="store_true",
                     help="torch.compile the step forward (one graph, compiled before the first prompt) and a block "
                          "drafter's greedy blocks")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")

    prof = sub.add_parser("profile", help="measure the SPS(B) table of a target model")
    _add_model_args(prof)
    prof.add_argument("--batch-tokens", default="1,2,4,8,16,32,64,128", help="comma-separated B values")
    prof.add_argument("--context", type=int, default=512, help="cached tokens per request")
    prof.add_argument("--tokens-per-request", type=int, default=8, help="new tokens per request (1 + γ)")
    prof.add_argument("--repeats", type=int, default=10)
    prof.add_argument("--json", action="store_true")

    data = sub.add_parser("data", help="corpora, splits and evaluation prompts")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    dbuild = data_sub.add_parser("build", help="build the code / chat / math corpora and the eval prompt sets")
    dbuild.add_argument("--out", type=Path, default=Path("build/data"), help="corpus JSONL + manifest")
    dbuild.add_argument("--eval-dir", type=Path, default=Path("benchmarks/datasets"), help="eval prompt JSONL")
    dbuild.add_argument("--seed", type=int, default=0)
    dbuild.add_argument("--math-problems", type=int, default=60_000)
    dbuild.add_argument("--eval-prompts", type=int, default=300, help="prompts per domain")

    train = sub.add_parser("train", help="train the project's own models")
    train_sub = train.add_subparsers(dest="train_command", required=True)
    ttarget = train_sub.add_parser("target", help="train the target on the built corpora (resumable)")
    ttarget.add_argument("--data-dir", type=Path, default=Path("build/data"))
    ttarget.add_argument("--run-dir", type=Path, default=Path("build/train/target"), help="resumable state")
    ttarget.add_argument("--out", type=Path, default=Path("models/dspark-target"), help="exported model")
    tdef = _target_defaults()
    ttarget.add_argument("--total-tokens", type=int, default=tdef.total_tokens)
    ttarget.add_argument("--hidden", type=int, default=tdef.hidden)
    ttarget.add_argument("--layers", type=int, default=tdef.layers)
    ttarget.add_argument("--heads", type=int, default=tdef.heads)
    ttarget.add_argument("--kv-heads", type=int, default=tdef.kv_heads)
    ttarget.add_argument("--ffn", type=int, default=tdef.ffn)
    ttarget.add_argument("--batch-size", type=int, default=tdef.batch_size)
    ttarget.add_argument("--seq-len", type=int, default=tdef.seq_len)
    ttarget.add_argument("--long-seq-len", type=int, default=tdef.long_seq_len,
                         help="window of the last --long-fraction of the steps (0: none); also the context")
    ttarget.add_argument("--long-fraction", type=float, default=tdef.long_fraction)
    ttarget.add_argument("--lr", type=float, default=tdef.lr)
    ttarget.add_argument("--eval-every", type=int, default=tdef.eval_every, help="steps between validation passes")
    ttarget.add_argument("--export-every", type=int, default=tdef.export_every, help="steps between exports")
    ttarget.add_argument("--resume-from", type=Path, help="an export (RUN_DIR/export) to resume from when RUN_DIR "
                                                          "holds no state")
    ttarget.add_argument("--seed", type=int, default=0)

    add_cache_parser(data_sub)
    add_vocab_parser(data_sub)
    add_train_parser(train_sub)
    add_eval_parsers(sub)

    models = sub.add_parser("models", help="list the shipped models")
    models.add_argument("--json", action="store_true")

    tiny = sub.add_parser("make-tiny-model", help="write a small random-weight Llama + BPE tokenizer (demo)")
    tiny.add_argument("out", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--layers", type=int, default=4)
    tiny.add_argument("--vocab-size", type=int, default=2048)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    try:
        return _COMMANDS[args.command](args)
    except (DsparkError, ValueError, FileNotFoundError) as exc:
        Console(stderr=True).print(f"error: {exc}", style="bold red", markup=False, highlight=False)
        return 2


def _generate(args: argparse.Namespace) -> int:
    from cli.generate import run_generate

    return run_generate(args)


def _profile(args: argparse.Namespace) -> int:
    from services.loader import load_model
    from services.registry import resolve_model
    from verifier_worker.profile import profile_sps

    batch_tokens = tuple(int(b) for b in args.batch_tokens.split(","))
    model = load_model(resolve_model(args.model), args.dtype, args.device)
    model.prepare_for_serving()  # the step a verifier runs (fused layers, packed linears), not the module path
    points = profile_sps(model, batch_tokens, args.context, args.tokens_per_request, args.repeats)
    if args.json:
        meta = {"model": str(args.model), "dtype": str(model.dtype).removeprefix("torch."), "device": str(model.device),
                "context": args.context, "tokens_per_request": args.tokens_per_request}
        sys.stdout.write(json.dumps({**meta, "points": [p.as_dict() for p in points]}) + "\n")
        return 0
    table = Table(title=f"SPS(B) — {args.model} ({model.dtype}, context {args.context})")
    for col in ("B (batch tokens)", "requests", "step ms", "SPS", "tokens/s"):
        table.add_column(col, justify="right")
    for p in points:
        table.add_row(str(p.batch_tokens), str(p.requests), f"{p.step_ms:.2f}", f"{p.sps:.1f}",
                      f"{p.tokens_per_s:.0f}")
    Console().print(table)
    return 0


def _make_tiny(args: argparse.Namespace) -> int:
    from training.tiny_model import build_tiny_model

    out = build_tiny_model(args.out, seed=args.seed, vocab_size=args.vocab_size, layers=args.layers)
    Console(stderr=True).print(f"wrote a random-weight demo model to {out}")
    return 0


def _data(args: argparse.Namespace) -> int:
    from training.data.build import DataConfig, build

    if args.data_command == "target-cache":
        return run_target_cache(args)
    if args.data_command == "draft-vocab":
        return run_draft_vocab(args)

    cfg = DataConfig(out_dir=args.out, eval_dir=args.eval_dir, seed=args.seed, math_problems=args.math_problems,
                     eval_prompts=args.eval_prompts)
    manifest = build(cfg)
    table = Table(title=f"corpora in {args.out}")
    for col in ("split", "documents", "characters"):
        table.add_column(col, justify="right")
    for name, stats in manifest["splits"].items():
        table.add_row(name, str(stats["documents"]), str(stats["chars"]))
    Console().print(table)
    Console().print(f"eval prompts in {args.eval_dir}: {manifest['eval_prompts']}")
    return 0


def _target_defaults():
    from training.target import TargetTrainConfig

    return TargetTrainConfig()


def _train(args: argparse.Namespace) -> int:
    from training.target import TargetTrainConfig, train

    if args.train_command == "drafter":
        return run_train_drafter(args)

    cfg = TargetTrainConfig(
        data_dir=args.data_dir, run_dir=args.run_dir, out_dir=args.out, total_tokens=args.total_tokens,
        hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, ffn=args.ffn,
        batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, eval_every=args.eval_every, seed=args.seed,
        long_seq_len=args.long_seq_len, long_fraction=args.long_fraction, export_every=args.export_every,
        resume_from=args.resume_from, max_positions=max(args.seq_len, args.long_seq_len),
    )
    console = Console(stderr=True)
    out = train(cfg, log=lambda msg: console.print(msg, markup=False, highlight=False))
    console.print(f"exported the target to {out}", markup=False)
    return 0


def _models(args: argparse.Namespace) -> int:
    from services.registry import list_models

    entries = list_models()
    if args.json:
        sys.stdout.write(json.dumps([e.as_dict() for e in entries]) + "\n")
        return 0
    table = Table(title="shipped models")
    for col in ("name", "kind", "parameters", "target", "path"):
        table.add_column(col)
    for e in entries:
        table.add_row(e.name, e.kind, f"{e.parameters / 1e6:.1f}M", e.target or "", e.path)
    Console().print(table)
    return 0


_COMMANDS = {
    "generate": _generate, "profile": _profile, "data": _data, "train": _train, "models": _models,
    "make-tiny-model": _make_tiny, "calibrate": run_calibrate, "eval": run_eval,
    "serve": run_serve, "top": run_top, "scale": run_scale, "pools": run_scale, "bench": run_bench,
    "simulate": run_simulate, "convert-drafter": run_convert,
    "verifier": run_role, "drafter": run_role, "router": run_role,
}


if __name__ == "__main__":
    sys.exit(main())
