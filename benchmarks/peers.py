"""Peers side by side: plain greedy decoding tokens/s of dspark, Hugging Face transformers and llama.cpp on the
same model, machine and dtype, in one run, rounds alternating between the programs.

- dspark: the engine, eager and compiled (`EngineConfig.compile`), batch 1 and 8;
- transformers: `generate` with a static cache and the forward under `torch.compile`, as its docs advise
  for speed, on the checkpoint directory as it is (our safetensors are HF Llama), batch 1 and 8;
- llama.cpp: built from the tree vendored in the llama-cpp-python sdist into a cache directory (native
  builds run only on the CPU type they were built on, so never in git), the model converted with the
  tree's `convert_hf_to_gguf.py` (its pre-tokenizer table does not know our tokenizer's hash: the GPT-2
  one is what it is, so the check is mapped to "gpt-2"), then `llama-bench -p 0 -n <tokens>` at batch 1.
  Skipped with the reason when it cannot be built (no cmake, no compiler, no registry).
- a model that came as a GGUF (`--model gemma-3-270m`, or a `.gguf` file): llama.cpp runs the file itself
  (e.g. Q4_K_M) and its BF16 form (`llama-quantize --allow-requantize … BF16`, the same values dspark serves
  in bf16), batch 1 (`llama-bench`) and 8 (`llama-batched-bench`, 8 parallel sequences); the forward of
  1..64 tokens of one sequence, dspark's against llama.cpp's (`llama-bench -p N -n 0`); and where greedy
  decoding of dspark (bf16) and llama.cpp first diverge (`llama-simple`), a cross-engine check.

    pip install -e '.[dev,peers]'; python benchmarks/peers.py [--model gemma-3-270m] [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

from benchmarks.harness import (
    FORWARD_SIZES,
    Stopping,
    alternate,
    forward_ms,
    generate_rate,
    load_target,
    machine,
    medians,
    random_prompts,
    write_json,
)
from verifier_worker.engine import Engine, EngineConfig

CACHE = Path(os.environ.get("DSPARK_PEERS_CACHE", Path.home() / ".cache" / "dspark" / "peers"))
LLAMA_CPP_PYTHON = "0.3.36"
GGUF_TYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def llama_tree() -> Path:
    return CACHE / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"


TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize", "llama-simple")


def build_llama_cpp() -> Path:
    """→ the llama-bench binary (its siblings `TOOLS` beside it), building them on first use (about 5 minutes
    on 2 cores)."""
    tree = llama_tree()
    bench = tree / "build" / "bin" / "llama-bench"
    if all((bench.parent / t).is_file() for t in TOOLS):
        return bench
    CACHE.mkdir(parents=True, exist_ok=True)
    sdist = CACHE / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(CACHE)], check=True, capture_output=True)
    if not tree.is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(CACHE, filter="data")
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
             "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF"]
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(tree), "-B", str(tree / "build"), *generator, *flags], check=True,
                   capture_output=True)
    subprocess.run(["cmake", "--build", str(tree / "build"), "--target", *TOOLS, "-j", str(os.cpu_count())],
                   check=True, capture_output=True)
    return bench


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a model directory was dequantized from (services/gguf.py), if it was."""
    source = model_dir / "source.json"
    return Path(json.loads(source.read_text())["gguf"]) if source.is_file() else None


def requantized(bench: Path, gguf: Path, kind: str = "BF16") -> Path:
    """`gguf` turned into `kind` by llama.cpp's own tool, once."""
    out = CACHE / f"{gguf.stem}-{kind.lower()}.gguf"
    if not out.is_file():
        subprocess.run([str(bench.parent / "llama-quantize"), "--allow-requantize", str(gguf), str(out), kind],
                       check=True, capture_output=True)
    return out


def llama_batched(bench: Path, gguf: Path, batch: int, tokens: int, threads: int) -> float:
    """Decoding tokens/s of `batch` parallel sequences (32-token prompts), llama-batched-bench's S_TG."""
    proc = subprocess.run([str(bench.parent / "llama-batched-bench"), "-m", str(gguf), "-c", "4096", "-npp", "32",
                           "-ntg", str(tokens), "-npl", str(batch), "-t", str(threads), "--output-format", "jsonl"],
                          check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return float(rows[-1]["speed_tg"])


def llama_forward_ms(bench: Path, gguf: Path, sizes: tuple[int, ...], threads: int) -> dict[int, float]:
    """ms of one forward of n tokens of one sequence (llama-bench's prompt processing, -p n -n 0)."""
    proc = subprocess.run([str(bench), "-m", str(gguf), "-p", ",".join(map(str, sizes)), "-n", "0", "-t",
                           str(threads), "-r", "5", "-o", "json"], check=True, capture_output=True, text=True)
    return {int(r["n_prompt"]): round(1000 * r["n_prompt"] / r["avg_ts"], 2) for r in json.loads(proc.stdout)}


def llama_greedy_text(bench: Path, gguf: Path, prompt: str, tokens: int) -> str:
    """llama.cpp's greedy continuation of `prompt` (llama-simple prints the prompt, then the continuation)."""
    proc = subprocess.run([str(bench.parent / "llama-simple"), "-m", str(gguf), "-n", str(tokens), prompt],
                          check=True, capture_output=True, text=True)
    out = proc.stdout
    return out[out.index(prompt) + len(prompt):] if prompt in out else out


def agreement(tokenizer, ours: list[int], theirs: str) -> int:
    """Tokens of our greedy output before its text stops being a prefix of llama.cpp's."""
    for k in range(len(ours)):
        if not theirs.startswith(tokenizer.decode(ours[: k + 1])):
            return k
    return len(ours)


def convert(model_dir: Path, dtype: torch.dtype) -> Path:
    """The checkpoint as GGUF in `dtype`, converted once per model and dtype."""
    out = CACHE / f"{model_dir.name}-{GGUF_TYPES[dtype]}.gguf"
    if out.is_file():
        return out
    tree = llama_tree()
    # Run the converter with its pre-tokenizer check answering "gpt-2" (our tokenizer is GPT-2's byte-level BPE).
    shim = ("import runpy, sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/gguf-py']; "
            "import conversion.base as b; b.TextModel.get_vocab_base_pre = lambda self, tok: 'gpt-2'; "
            "sys.argv = [sys.argv[1] + '/convert_hf_to_gguf.py'] + sys.argv[2:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    subprocess.run([sys.executable, "-c", shim, str(tree), str(model_dir), "--outfile", str(out), "--outtype",
                    GGUF_TYPES[dtype]], check=True, capture_output=True)
    return out


def llama_bench(bench: Path, gguf: Path, tokens: int, threads: int) -> float:
    proc = subprocess.run([str(bench), "-m", str(gguf), "-p", "0", "-n", str(tokens), "-t", str(threads),
                           "-r", "3", "-o", "json"], check=True, capture_output=True, text=True)
    return float(json.loads(proc.stdout)[0]["avg_ts"])


def dspark_tps(engine: Engine, batch: int, tokens: int, vocab: int) -> float:
    ids = random_prompts(vocab, batch, 32, seed=batch)
    return generate_rate(engine, ids, Stopping(tokens), batch=batch).tokens_per_s


class HfPeer:
    """transformers' generate, static cache, compiled forward (its documented recipe for speed)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.model.generation_config.cache_implementation = "static"
        self.model.forward = torch.compile(self.model.forward, mode="reduce-overhead", fullgraph=True)

    def tps(self, batch: int, tokens: int) -> float:
        g = torch.Generator().manual_seed(batch)
        ids = torch.randint(3, self.model.config.vocab_size, (batch, 32), generator=g)
        started = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                  min_new_tokens=tokens, do_sample=False)
        return batch * (out.shape[1] - 32) / (time.perf_counter() - started)


AGREEMENT_PROMPTS = ("def fibonacci(n):", "The capital of France is", "import numpy as np\n\n",
                     "Once upon a time", "SELECT name FROM users WHERE", "The derivative of x^2 is")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dspark-target")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peers", default="dspark,dspark-compiled,transformers,llama.cpp")
    p.add_argument("--json")
    args = p.parse_args()
    target = load_target(args.model, args.dtype)
    model, model_dir = target.model, target.model_dir
    dtype, threads, vocab = model.dtype, torch.get_num_threads(), model.config.vocab_size
    meta = {"model": args.model, **machine(), "dtype": target.dtype_name, "tokens": args.tokens}
    print(json.dumps(meta), flush=True)
    arms, skipped, extra = {}, {}, {}
    wanted = args.peers.split(",")
    source = gguf_source(model_dir)
    if "dspark" in wanted:
        engine = Engine(model, EngineConfig(num_slots=8, max_len=1024))
        arms["dspark"] = {b: (lambda b=b, e=engine: dspark_tps(e, b, args.tokens, vocab)) for b in (1, 8)}
    if "dspark-compiled" in wanted:
        engine_c = Engine(model, EngineConfig(num_slots=8, max_len=1024, compile=True))
        arms["dspark-compiled"] = {b: (lambda b=b, e=engine_c: dspark_tps(e, b, args.tokens, vocab)) for b in (1, 8)}
    if "transformers" in wanted:
        hf = HfPeer(model_dir, dtype)
        arms["transformers"] = {b: (lambda b=b: hf.tps(b, args.tokens)) for b in (1, 8)}
    if "llama.cpp" in wanted:
        try:
            bench = build_llama_cpp()
            files = ({"llama.cpp": convert(model_dir, dtype)} if source is None else
                     {"llama.cpp-bf16": requantized(bench, source), f"llama.cpp-{source.stem}": source})
            for name, gguf in list(files.items()):
                arms[name] = {1: lambda g=gguf: llama_bench(bench, g, args.tokens, threads)}
                if source is not None:
                    arms[name][8] = lambda g=gguf: llama_batched(bench, g, 8, args.tokens, threads)
                try:  # a build that cannot run this file here (e.g. AMX kernels a VM refuses) is reported
                    for fn in arms[name].values():
                        fn()
                except subprocess.CalledProcessError as error:
                    skipped[name] = f"llama.cpp failed on {gguf.name}: {error}"
                    print(f"{name} skipped: {skipped[name]}", flush=True)
                    del arms[name], files[name]
            if source is not None:
                extra = gguf_checks(model, model_dir, bench, files, threads, args.tokens)
        except (OSError, subprocess.CalledProcessError) as error:
            skipped["llama.cpp"] = f"could not build or convert: {error}"
            print(f"llama.cpp skipped: {error}", flush=True)
    flat = medians(alternate({(name, b): fn for name, arm in arms.items() for b, fn in arm.items()}, args.rounds))
    table = {name: {b: flat[(name, b)] for b in arm} for name, arm in arms.items()}
    base = table.get("dspark", table.get("dspark-compiled", {}))
    for name, per in table.items():
        ratios = ", ".join(f"b{b} {tps:.1f} tok/s (dspark {base[b] / tps:.2f} x)"
                           for b, tps in per.items() if b in base)
        print(f"{name:>24}: {ratios}", flush=True)
    write_json(args.json, {"meta": meta, "tokens_per_s": table, "skipped": skipped, **extra})


def gguf_checks(model, model_dir: Path, bench: Path, files: dict[str, Path], threads: int, tokens: int) -> dict:
    """The forward curve against llama.cpp's on each file, and greedy agreement with llama.cpp."""
    from services.tokenizer import TextTokenizer

    model.prepare_for_serving()
    ours = {n: round(ms, 2) for n, ms in forward_ms(model, FORWARD_SIZES, 32, 10).items()}
    curves = {"dspark": ours} | {name: llama_forward_ms(bench, g, FORWARD_SIZES, threads) for name, g in files.items()}
    for name, curve in curves.items():
        steps = ", ".join(f"{n}: {ms:.1f}" for n, ms in curve.items())
        print(f"forward ms {name:>22}: {steps}; f(8)/f(1) {curve[8] / curve[1]:.2f}", flush=True)
    tok = TextTokenizer.from_dir(model_dir)
    engine = Engine(model, EngineConfig(num_slots=8, max_len=1024))
    ids = [tok.encode(p) for p in AGREEMENT_PROMPTS]
    greedy = generate_rate(engine, ids, Stopping(tokens), batch=len(ids)).outputs
    agree = {name: [agreement(tok, ids, llama_greedy_text(bench, g, prompt, tokens))
                    for prompt, ids in zip(AGREEMENT_PROMPTS, greedy, strict=True)] for name, g in files.items()}
    for name, counts in agree.items():
        print(f"greedy agreement with {name}: tokens before the first divergence {counts} (of {tokens})", flush=True)
    return {"forward_ms": curves, "greedy_agreement": agree}


if __name__ == "__main__":
    main()
