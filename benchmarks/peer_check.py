"""`make peer-check`: the benchmark and evaluation clients people already use, unmodified, against `dspark serve`.

In a virtualenv of their own (build/peer-venv; they pin torch, transformers and openai differently from dspark):
- SGLang's `python -m sglang.bench_serving`, datasets `random` (ShareGPT-shaped text, here a local file made from
  benchmarks/datasets) and `random-ids`, backend `sglang-oai` (/v1/completions);
- vLLM's `vllm bench serve`, dataset `random`, backend `openai`;
- lm-eval's `lm_eval run --model local-completions` on a generate_until task whose yaml and jsonl this script writes.
All offline (HF_*_OFFLINE), tokenizer models/dspark-target, concurrency 8. Each client's own summary is printed;
the exit status is 1 when any client crashed or any request failed. The server is stopped on every path.

    .venv/bin/python benchmarks/peer_check.py [--port N] [--prompts 32] [--input-len 128] [--output-len 64]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / "build" / "peer-venv"
WORK = ROOT / "build" / "peer-check"
TOKENIZER = ROOT / "models" / "dspark-target"
MODEL = "dspark-target"
CONCURRENCY = 8

# What each client needs, found by importing its entry point until it ran. Neither sglang nor vllm is installed
# with its dependencies (CUDA kernels, flash-attn, ... several GB that a client never calls). torch comes from
# PyPI as the CUDA build although nothing here uses a GPU: sglang imports torchvision at start-up, and PyPI's
# torchvision only loads against PyPI's torch; the CPU torch wheel has no matching torchvision.
PINS = ["torch==2.14.1", "torchvision==0.29.1"]
GROUPS = {
    "torch": [["torch==2.14.1", "torchvision==0.29.1"]],
    "sglang": [["--no-deps", "sglang==0.5.23"],
               ["aiohttp", "msgspec", "orjson", "numpy", "requests", "tqdm", "psutil", "pybase64", "pillow",
                "transformers==5.19.0", "tokenizers==0.23.2", "apache-tvm-ffi==0.1.11", "starlette", "pyzmq",
                "IPython", "datasets", "sentencepiece", "compressed-tensors", "loguru", "gguf"]],
    # vLLM's own requirement list less its GPU kernels and media decoders, read from the installed wheel.
    "vllm": [["--no-deps", "vllm==0.33.0"], ["@vllm-requires"]],
    "lm-eval": [["lm-eval[api]==0.4.13"]],
}
VLLM_SKIP = re.compile(r"^(torch|torchaudio|torchvision|torchcodec|pynvvideocodec|flashinfer|apache-tvm|tilelang|"
                       r"nvidia|nvtx|fastsafetensors|instanttensor|quack|tokenspeed|humming|numba)", re.I)
PROBES = {"sglang": ["python", "-m", "sglang.bench_serving", "--help"], "vllm": ["vllm", "bench", "serve", "--help"],
          "lm-eval": ["lm_eval", "run", "--help"]}
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}


def log(msg: str) -> None:
    print(f"[peer-check] {msg}", flush=True)


def pip(args: list[str]) -> bool:
    cons = VENV / "pins.txt"
    cmd = [str(VENV / "bin" / "pip"), "install", "--quiet", "-c", str(cons), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        log(f"pip install {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return done.returncode == 0


def vllm_requires() -> list[str]:
    code = ("import importlib.metadata as m; import json; "
            "print(json.dumps([r for r in m.requires('vllm') if 'extra ==' not in r]))")
    out = subprocess.run([str(VENV / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True)
    return [r for r in json.loads(out.stdout) if not VLLM_SKIP.match(r)]


def install() -> dict[str, str | None]:
    """→ {client: None if it runs, else why not}. Reinstalls only when GROUPS changed (a stamp in the venv)."""
    stamp = VENV / f".installed-{hashlib.sha256(repr(GROUPS).encode()).hexdigest()[:12]}"
    if not stamp.exists():
        log(f"creating {VENV.relative_to(ROOT)} (about 8 GB, 5 minutes from a warm pip cache)")
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
        (VENV / "pins.txt").write_text("\n".join(PINS) + "\n")
        pip(["--upgrade", "pip"])
        broken = set()
        for group, steps in GROUPS.items():
            for step in steps:
                if not pip(vllm_requires() if step == ["@vllm-requires"] else step):
                    broken.add(group)
                    break
        (VENV / "broken.json").write_text(json.dumps(sorted(broken)))
        stamp.touch()
    broken = set(json.loads((VENV / "broken.json").read_text()))
    status: dict[str, str | None] = {}
    for client, probe in PROBES.items():
        if client in broken or "torch" in broken:
            status[client] = "its packages did not install (see the pip error above)"
            continue
        exe = [str(VENV / "bin" / probe[0]), *probe[1:]]
        done = subprocess.run(exe, capture_output=True, text=True, env={**os.environ, **OFFLINE})
        status[client] = None if done.returncode == 0 else f"`{' '.join(probe)}` fails: {done.stderr[-1500:]}"
    return status


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    """`dspark serve` on embedded defaults, in its own process group so that stopping it reaches Ray's children."""
    with open(WORK / "serve.log", "w") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([str(ROOT / ".venv" / "bin" / "dspark"), "serve", "--port", str(port)], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dspark serve exited with {proc.returncode}; see {WORK / 'serve.log'}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(1)
    stop_server(proc)
    raise RuntimeError(f"dspark serve not healthy after 180 s; see {WORK / 'serve.log'}")


def stop_server(proc: subprocess.Popen) -> None:
    """Ctrl-C as a user would (dspark serve then stops Ray and Redis), SIGKILL to the group if that hangs."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def write_data(n_docs: int) -> Path:
    """ShareGPT-shaped text for SGLang's `random` (it slices token ids out of the first turn), and the lm-eval task:
    word problems in the shipped math prompts' chat format, scored on the `Answer: N` line the target writes."""
    convs = []
    for name in ("code", "chat", "math"):
        for line in (ROOT / "benchmarks" / "datasets" / f"{name}.jsonl").read_text().splitlines():
            convs.append({"conversations": [{"from": "human", "value": json.loads(line)["prompt"]},
                                            {"from": "gpt", "value": "ok"}]})
    (WORK / "sharegpt.json").write_text(json.dumps(convs))
    task = WORK / "lm_eval_task"
    task.mkdir(exist_ok=True)
    with open(task / "docs.jsonl", "w") as f:
        for i in range(n_docs):
            a, b = 3 + 7 * i % 20, 2 + 5 * i % 9
            f.write(json.dumps({"question": f"Mina has {a} shells and finds {b} more. How many shells does she "
                                            f"have now?", "answer": str(a + b)}) + "\n")
    (task / "peer_gen.yaml").write_text(f"""task: dspark_peer_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {task / 'docs.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "<|user|>\\n{{{{question}}}}<|end|>\\n<|assistant|>\\n"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["<|end|>"], max_gen_toks: 32, do_sample: false, temperature: 0}}
filter_list:
  - name: answer
    filter: [{{function: regex, regex_pattern: "Answer: (-?[0-9]+)"}}, {{function: take_first}}]
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true}}
""")
    return task


def run_client(name: str, cmd: list[str]) -> tuple[int, str]:
    """→ (exit status, its output). The output goes to build/peer-check/<name>.log too."""
    log(f"{name}: {' '.join(cmd)}")
    done = subprocess.run([str(VENV / "bin" / cmd[0]), *cmd[1:]], cwd=WORK, capture_output=True, text=True,
                          env={**os.environ, **OFFLINE}, timeout=900)
    text = done.stdout + done.stderr
    (WORK / f"{name}.log").write_text(text)
    return done.returncode, text


def summary_block(text: str) -> str:
    """The client's own result box: from its `====… Result …` banner to the closing rule."""
    m = re.search(r"^=+ Serving Benchmark Result =+$.*?^=+$", text, re.S | re.M)
    return m.group(0) if m else ""


def last_error(text: str) -> str:
    """The last line of a client's output that names an error: what a crash was about, for the FAILED line."""
    lines = [line for line in text.splitlines() if re.search(r"Error|error", line)]
    return lines[-1].strip()[:600] if lines else "no error line"


def check_sglang(args, port: int, dataset: str) -> list[str]:
    out = WORK / f"sglang-{dataset}.jsonl"
    out.unlink(missing_ok=True)
    cmd = ["python", "-m", "sglang.bench_serving", "--backend", "sglang-oai", "--base-url", f"http://127.0.0.1:{port}",
           "--model", MODEL, "--tokenizer", str(TOKENIZER), "--dataset-name", dataset,
           "--dataset-path", str(WORK / "sharegpt.json") if dataset == "random" else "",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--random-range-ratio", "1", "--num-prompts", str(args.prompts), "--max-concurrency", str(CONCURRENCY),
           "--disable-tqdm", "--output-file", str(out), "--output-details"]
    rc, text = run_client(f"sglang-{dataset}", cmd)
    print(summary_block(text) or text[-3000:])
    if rc != 0 or not out.exists():
        return [f"sglang {dataset}: exit {rc}, no result file; {last_error(text)}"]
    res = json.loads(out.read_text().splitlines()[-1])
    errors = [e for e in res.get("errors", []) if e]
    if res["completed"] != args.prompts or errors:
        return [f"sglang {dataset}: {res['completed']}/{args.prompts} completed; errors: {errors[:3]}"]
    return []


def check_vllm(args, port: int) -> list[str]:
    out = WORK / "vllm-random.json"
    out.unlink(missing_ok=True)
    cmd = ["vllm", "bench", "serve", "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
           "--model", MODEL, "--tokenizer", str(TOKENIZER), "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.prompts), "--max-concurrency", str(CONCURRENCY), "--ignore-eos",
           "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(WORK),
           "--result-filename", out.name]
    rc, text = run_client("vllm-random", cmd)
    print(summary_block(text) or text[-3000:])
    if rc != 0 or not out.exists():
        return [f"vllm random: exit {rc}, no result file; {last_error(text)}"]
    res = json.loads(out.read_text())
    errors = [e for e in res.get("errors", []) if e]
    if res["failed"] or res["completed"] != args.prompts or errors:
        return [f"vllm random: {res['completed']}/{args.prompts} completed, {res['failed']} failed; {errors[:3]}"]
    return []


def check_lm_eval(args, port: int, task: Path) -> list[str]:
    # max_retries=1: a refused request fails the run instead of being retried into a pass.
    model_args = (f"model={MODEL},base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={TOKENIZER},"
                  f"tokenizer_backend=huggingface,num_concurrent={CONCURRENCY},max_retries=1,max_length=1024,"
                  "tokenized_requests=False")
    cmd = ["lm_eval", "run", "--model", "local-completions", "--model_args", model_args, "--tasks",
           "dspark_peer_gen", "--include_path", str(task), "--batch_size", "1", "--output_path",
           str(WORK / "lm_eval_out"), "--log_samples"]
    rc, text = run_client("lm-eval", cmd)
    table = [line for line in text.splitlines() if line.startswith(("local-completions", "|"))]
    print("\n".join(table) if table else text[-3000:])
    if rc != 0 or not table:
        return [f"lm-eval: exit {rc}; {last_error(text)}"]
    samples = sorted((WORK / "lm_eval_out").rglob("samples_dspark_peer_gen_*.jsonl"))
    rows = [json.loads(line) for line in samples[-1].read_text().splitlines()] if samples else []
    empty = sum(1 for r in rows if not r["resps"][0][0])
    if len(rows) != args.docs or empty:
        return [f"lm-eval: {len(rows)}/{args.docs} docs answered, {empty} empty answers"]
    return []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=0, help="dspark serve's HTTP port (default: a free one)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128, help="+ the server's BOS + output-len must stay ≤ 1024")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--docs", type=int, default=16, help="lm-eval task size")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)

    status = install()
    for client, why in status.items():
        if why:
            log(f"SKIPPED {client}: {why}")
    task = write_data(args.docs)
    port = args.port or free_port()
    log(f"starting dspark serve on 127.0.0.1:{port}")
    server = start_server(port)
    failures: list[str] = []
    try:
        if status["sglang"] is None:
            failures += check_sglang(args, port, "random")
            failures += check_sglang(args, port, "random-ids")
        if status["vllm"] is None:
            failures += check_vllm(args, port)
        if status["lm-eval"] is None:
            failures += check_lm_eval(args, port, task)
    except subprocess.TimeoutExpired as e:
        failures.append(f"timed out: {e.cmd[:3]}")
    finally:
        log("stopping dspark serve")
        stop_server(server)
    skipped = [c for c, why in status.items() if why]
    for f in failures:
        log(f"FAILED {f}")
    log(f"{'FAILED' if failures else 'OK'}: {len(failures)} failing check(s), skipped: {skipped or 'none'}; "
        f"logs in {WORK.relative_to(ROOT)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
