"""Where a decode step's time goes: each decoder layer's attention and MLP (norms included), the final norm and
the LM head, for one sequence of n new tokens after `context` cached ones, on the verifier's prepared model.

Forward hooks time each part with perf_counter (the CPU runs ops synchronously); the sum is checked against
the step's wall time, the rest being embedding, rotary tables, plans and framework overhead between parts.

    python benchmarks/step_breakdown.py --model gemma-3-270m [--tokens 1] [--context 256] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch

from benchmarks.harness import cpu_model
from services.layers import RaggedLayout
from services.loader import load_model
from services.registry import resolve_model
from verifier_worker.kv_cache import KVCache


def breakdown(model, tokens: int, context: int, repeats: int) -> dict:
    spent: dict[str, list[float]] = defaultdict(list)
    started: dict[str, float] = {}

    def timed(name: str, module: torch.nn.Module) -> None:
        module.register_forward_pre_hook(lambda *_: started.__setitem__(name, time.perf_counter()))
        module.register_forward_hook(lambda *_: spent[name].append(time.perf_counter() - started[name]))

    for layer in model.model.layers:
        timed("attention", layer.self_attn)
        timed("mlp", layer.mlp)
        timed("layer", layer)
    timed("final norm", model.model.norm)
    timed("lm head", model.lm_head)
    cache = KVCache(model.config, 1, context + tokens + 8, model.dtype, model.device)
    layout = RaggedLayout([0], [context], [tokens])
    ids = torch.randint(0, model.config.vocab_size, (tokens,))
    positions, rows = torch.arange(context, context + tokens), torch.arange(tokens)
    walls = []
    with torch.inference_mode():
        for i in range(repeats + 3):
            if i == 3:
                spent.clear()
            t0 = time.perf_counter()
            model(ids, positions, layout, cache.k, cache.v, rows)
            walls.append(time.perf_counter() - t0)
    layers = len(model.model.layers)
    ms = {name: 1000 * sum(v) / repeats for name, v in spent.items()}  # per step, summed over the layers
    norms_and_residuals = ms["layer"] - ms["attention"] - ms["mlp"]
    step = 1000 * statistics.median(walls[3:])
    return {"step_ms": round(step, 2), "attention_ms": round(ms["attention"], 2), "mlp_ms": round(ms["mlp"], 2),
            "layer_norms_residuals_ms": round(norms_and_residuals, 2), "per_layer_ms": round(ms["layer"] / layers, 3),
            "final_norm_ms": round(ms["final norm"], 2), "lm_head_ms": round(ms["lm head"], 2),
            "other_ms": round(step - ms["layer"] - ms["final norm"] - ms["lm head"], 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tokens", default="1,8")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    model = load_model(resolve_model(args.model), args.dtype)
    model.prepare_for_serving()
    out = {"model": args.model, "cpu": cpu_model(), "threads": torch.get_num_threads(),
           "dtype": str(model.dtype).removeprefix("torch."), "context": args.context,
           "tokens": {n: breakdown(model, int(n), args.context, args.repeats) for n in args.tokens.split(",")}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
