"""`dspark generate`: in-process generation over the engine, with an optional drafter."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console

from drafter_worker.checkpoint import drafter_config, load_drafter
from drafter_worker.drafter import Drafter
from drafter_worker.ngram import NgramProposer
from in_process.generation import GenerationRequest, GenerationResult, InProcessRouter
from router.scheduling.policy import Policy
from services.chat_template import render
from services.errors import InvalidRequestError
from services.loader import load_model
from services.model_config import ModelConfig
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from services.types import SamplingParams
from verifier_worker.engine import Engine, EngineConfig


def read_prompts(path: Path) -> list[str]:
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{path}:{n}: not JSON ({exc.msg})") from exc
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise InvalidRequestError(f'{path}:{n}: expected {{"prompt": "..."}}')
        prompts.append(record["prompt"])
    if not prompts:
        raise InvalidRequestError(f"{path}: no prompts")
    return prompts


def resolve_policy(args: argparse.Namespace) -> Policy:
    if args.method == "none":
        if args.policy not in (None, "none"):
            raise InvalidRequestError(f"--policy {args.policy} needs a drafting --method")
        return Policy.NONE
    if args.method == "ngram" and args.drafter is not None:
        raise InvalidRequestError("--method ngram is model-free and takes no --drafter")
    if args.method != "ngram" and args.drafter is None:
        raise InvalidRequestError(f"--method {args.method} needs --drafter (a trained {args.method} drafter)")
    if args.gamma < 1:
        raise InvalidRequestError("--gamma must be >= 1")
    return Policy(args.policy or "fixed")


def run_generate(args: argparse.Namespace) -> int:
    policy = resolve_policy(args)
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts)
    if args.chat:
        prompts = [render([{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts]
    model_dir = resolve_model(args.model)
    tokenizer = TextTokenizer.from_dir(model_dir)
    proposer, taps = None, ()
    if args.method not in ("none", "ngram"):
        dcfg = drafter_config(resolve_model(args.drafter), "auto", ModelConfig.from_dir(model_dir).num_hidden_layers)
        if dcfg.method != args.method:
            raise InvalidRequestError(f"{args.drafter} is a {dcfg.method} drafter, not {args.method}")
        taps = dcfg.tap_layers
    model = load_model(model_dir, args.dtype, args.device, tap_layers=taps)
    if taps:
        draft_model, calibration = load_drafter(args.drafter, model, args.dtype, args.device)
        proposer = Drafter(draft_model, calibration, compile=args.compile)
    elif args.method == "ngram":
        proposer = NgramProposer()
    engine = Engine(model, EngineConfig(num_slots=args.max_batch, max_len=args.max_len, compile=args.compile))
    router = InProcessRouter(engine, proposer, policy, args.gamma)
    requests = [
        GenerationRequest(
            request_id=f"prompt-{i}",
            prompt_ids=tokenizer.encode(text),
            params=SamplingParams(
                temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                seed=None if args.seed is None else args.seed + i, max_tokens=args.max_tokens,
            ),
            stop_token_ids=tokenizer.eos_token_ids,
        )
        for i, text in enumerate(prompts)
    ]
    started = time.perf_counter()
    results = router.generate(requests)
    wall = time.perf_counter() - started
    for text, result in zip(prompts, results, strict=True):
        record = result_record(text, result, tokenizer)
        if args.json:
            sys.stdout.write(json.dumps(record) + "\n")
        else:
            _print_human(record)
    tokens = sum(len(r.token_ids) for r in results)
    # The run's throughput: all tokens over the wall time of the batch (what --max-batch changes).
    summary = {"run": {"requests": len(results), "completion_tokens": tokens, "wall_s": round(wall, 4),
                       "tokens_per_s": round(tokens / wall, 2) if wall > 0 else 0.0}}
    if args.json:
        sys.stderr.write(json.dumps(summary) + "\n")
    else:
        Console().print(f"[bold]run: {tokens} tokens from {len(results)} requests in {wall:.2f} s, "
                        f"{summary['run']['tokens_per_s']:.1f} tok/s")
    return 0


def result_record(prompt: str, result: GenerationResult, tokenizer: TextTokenizer) -> dict:
    drafts = result.draft_tokens
    return {
        "prompt": prompt,
        "text": tokenizer.decode(result.token_ids),
        "token_ids": result.token_ids,
        "finish_reason": str(result.finish_reason),
        "prompt_tokens": len(result.prompt_ids),
        "completion_tokens": len(result.token_ids),
        "cycles": result.cycles,
        "tau": round(result.tau, 4),
        "num_draft_tokens": drafts,
        "num_accepted_tokens": result.accepted_tokens,
        "acceptance_rate": round(result.accepted_tokens / drafts, 4) if drafts else None,
        "accepted_per_pos": result.accepted_per_pos,
        "queued_s": round(result.queued_s, 4),  # waiting for a slot, before its first scheduled step
        "elapsed_s": round(result.elapsed_s, 4),  # from its first scheduled step to its last token
        "tokens_per_s": round(result.tokens_per_s, 2),  # decode speed over elapsed_s
    }


def _print_human(record: dict) -> None:
    console = Console()
    console.rule(f"[bold]{record['prompt'][:60]!r}")
    console.print(record["prompt"], end="", style="dim", markup=False, highlight=False)
    console.print(record["text"], markup=False, highlight=False)
    console.print(
        f"[cyan]{record['completion_tokens']} tokens, {record['cycles']} cycles, τ={record['tau']:.2f}, "
        f"{record['tokens_per_s']:.1f} tok/s, finish={record['finish_reason']}"
    )
