"""Mask cost a token, llguidance (what dspark runs) against xgrammar, on Gemma 3's 262,144-token vocabulary: the same
JSON schema and tokens, one thread. Needs `pip install xgrammar` (not a dependency of dspark). Prints JSON.

    python -m benchmarks.grammar_engines
"""

from __future__ import annotations

import json
import time

import torch

from benchmarks.harness import cpu_model
from services.grammar import JSON_LAYOUT
from services.registry import resolve_model
from services.tokenizer import TextTokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                                           "year": {"type": "integer"}},
          "required": ["name", "tags", "year"], "additionalProperties": False}
TEXT = json.dumps({"name": "Ada Lovelace", "tags": ["math", "computing", "poetry"], "year": 1843})


def _summary(build_s: float, compile_s: float, times: list[float]) -> dict:
    return {"tokenizer_s": round(build_s, 2), "compile_s": round(compile_s, 4),
            "mask_ms_mean": round(1e3 * sum(times) / len(times), 3), "mask_ms_max": round(1e3 * max(times), 3)}


def llguidance_cost(model_dir, ids: list[int]) -> dict:
    import llguidance
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(str(model_dir / "tokenizer.json"), eos_token=[1])
    t1 = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                                                          defaults=JSON_LAYOUT))
    t2 = time.perf_counter()
    bits, times = allocate_token_bitmask(1, lltok.vocab_size), []
    for token in ids:
        start = time.perf_counter()
        fill_next_token_bitmask(matcher, bits)
        times.append(time.perf_counter() - start)
        assert matcher.consume_token(token)
    return _summary(t1 - t0, t2 - t1, times)


def xgrammar_cost(model_dir, ids: list[int]) -> dict:
    import transformers
    import xgrammar

    t0 = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(transformers.AutoTokenizer.from_pretrained(str(model_dir)),
                                                   vocab_size=262144)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
    t2 = time.perf_counter()
    matcher, bits, times = xgrammar.GrammarMatcher(compiled), xgrammar.allocate_token_bitmask(1, info.vocab_size), []
    for token in ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bits)
        times.append(time.perf_counter() - start)
        assert matcher.accept_token(token)
    return _summary(t1 - t0, t2 - t1, times)


def main() -> None:
    torch.set_num_threads(1)
    model_dir = resolve_model("gemma-3-270m")
    ids = TextTokenizer.from_dir(model_dir).encode(TEXT, add_special_tokens=False)
    report = {"tokens": len(ids), "llguidance": llguidance_cost(model_dir, ids),
              "xgrammar": xgrammar_cost(model_dir, ids), "cpu": cpu_model()}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
