"""A `.gguf` file as a model directory: dequantized once by transformers' GGUF integration, cached by sha256.

A user brings a GGUF (llama.cpp's format) the way they bring a Hugging Face directory. The file is checked
first with gguf-py's reader (architecture and tensor types this engine serves, or a refusal naming them),
then transformers dequantizes it (no dequantizer is written here) into its `*ForCausalLM`, which is saved
with the tokenizer as an HF directory under `cache_root()/<sha256>`. BOS/EOS come from the file's metadata
(`tokenizer.ggml.add_bos_token`, `…bos_token_id`), and so does the chat template (`tokenizer.chat_template`;
a Gemma file without one gets Gemma's turn format, as llama.cpp does). The second start finds the directory
and reads nothing but its `source.json`. A file that cannot be read whole leaves nothing in the cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
from contextlib import contextmanager
from pathlib import Path

from services.errors import ModelLoadError
from services.settings import cache_dir

# GGUF `general.architecture` → what the cached directory's config.json will say.
ARCHITECTURES = {"gemma3": "Gemma3ForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
# Tensor types transformers' GGUF integration dequantizes (gguf-py's numpy dequantizers).
TENSOR_TYPES = frozenset({"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
                          "Q5_K", "Q6_K"})
# Gemma's turn format, what llama.cpp applies to a gemma file that carries no template of its own.
GEMMA_TURNS = (
    "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
    "{% if m['role'] == 'system' %}<start_of_turn>user\n{{ m['content'] }}\n{% else %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] }}<end_of_turn>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
SOURCE = "source.json"  # written last: its presence marks a complete cache entry


def cache_root() -> Path:
    return cache_dir("gguf")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf" and path.is_file()


def materialize(path: str | Path, root: Path | None = None, sha256: str | None = None) -> Path:
    """The HF directory of GGUF file `path`, built on first use. `sha256`: the digest the file must have."""
    path = Path(path)
    digest = sha256_file(path)
    if sha256 is not None and digest != sha256:
        raise ModelLoadError(f"{path}: sha256 {digest}, expected {sha256} (a damaged or different file)")
    out = (root or cache_root()) / digest
    if (out / SOURCE).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out.parent / f"{digest}.lock"):
        if (out / SOURCE).is_file():  # another process built it while this one waited
            return out
        tmp = out.with_name(f"{digest}.partial")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            with _one_reader():
                meta = inspect(path)
                _convert(path, meta, tmp)
        except ModelLoadError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        except Exception as e:  # transformers' and gguf-py's own errors: a file that does not read whole
            shutil.rmtree(tmp, ignore_errors=True)
            raise ModelLoadError(f"{path}: cannot be dequantized ({type(e).__name__}: {e})") from e
        (tmp / SOURCE).write_text(json.dumps({"gguf": str(path.resolve()), "sha256": digest, **meta}, indent=1))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out


def inspect(path: Path) -> dict:
    """Architecture, tensor types and tokenizer metadata, refusing what this engine cannot serve by name."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # a truncated or corrupted file: gguf-py cannot map its header or tensors
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e

    def field(name: str, default=None):
        f = reader.fields.get(name)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not served (served: {', '.join(ARCHITECTURES)})")
    types = sorted({t.tensor_type.name for t in reader.tensors})
    refused = [t for t in types if t not in TENSOR_TYPES]
    if refused:
        raise ModelLoadError(f"{path}: tensor type {refused[0]} is not supported "
                             f"(supported: {', '.join(sorted(TENSOR_TYPES))})")
    return {"architecture": arch, "tensor_types": types, "name": field("general.name"),
            "license": field("general.license"),
            "add_bos_token": bool(field("tokenizer.ggml.add_bos_token", arch != "qwen2" and arch != "qwen3")),
            "add_eos_token": bool(field("tokenizer.ggml.add_eos_token", False)),
            "chat_template": field("tokenizer.chat_template") or (GEMMA_TURNS if arch == "gemma3" else None)}


def _convert(path: Path, meta: dict, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    for name, tensor in model.state_dict().items():
        if not torch.isfinite(tensor).all():
            raise ModelLoadError(f"{path}: tensor {name} dequantizes to non-finite values (a corrupted file)")
    # The dequantized model is a plain fp32 one: nothing of the quantizer is saved with it.
    model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(add_bos_token=meta["add_bos_token"], add_eos_token=meta["add_eos_token"])
    if meta["chat_template"]:
        cfg["chat_template"] = meta["chat_template"]
    cfg_path.write_text(json.dumps(cfg, indent=1))


@contextmanager
def _one_reader():
    """One gguf-py reader per file while a file converts, reading plain arrays. transformers opens the file three
    times (tokenizer, config, weights) and `inspect` once more, and each `GGUFReader` parses every metadata field
    anew: for Gemma's 262,144-token vocabulary about 30 s each on 2 vCPUs. The reader only maps the file and
    reads it, so the four can share one. And its fields are some 800,000 small views of the file (a string's
    length, its bytes): as views of a `np.memmap` each pays the subclass's bookkeeping, as views of a plain array
    over the same map none (13.6 -> 4.7 s for Gemma's reader here; the converted files are the same bytes).
    transformers imports the class from `gguf` at each call, which is where it is swapped, for the conversion
    only."""
    import gguf as gguf_py
    import numpy as np

    made, readers = gguf_py.GGUFReader, {}

    class PlainReader(made):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, mapped):  # the reader's first act: `self.data = np.memmap(path, mode=mode)`
            self._plain = np.asarray(mapped)  # an ndarray over the same map (it keeps the map alive)

    def shared(path, mode: str = "r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = PlainReader(path, mode)
        return readers[key]

    gguf_py.GGUFReader = shared
    try:
        yield
    finally:
        gguf_py.GGUFReader = made


@contextmanager
def _locked(lock_path: Path):
    """One process converts a file at a time (Ray's replicas and the CLI may resolve the same model at once)."""
    with lock_path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
