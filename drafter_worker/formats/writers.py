"""`dspark convert-drafter SRC OUT --to FORMAT`: a loaded drafter written back in a released format.

Where the format can express the drafter exactly, the file loads through the ordinary loaders (format detected
from config.json) and drafts the same blocks. Otherwise the conversion is refused before anything is written,
with the tensor, field or convention that has no place in the format (docs/drafters.md, Released checkpoint formats):

  specforge-eagle3  `LlamaForCausalLMEagle3` (§3.1–3.2): a Llama layer (no q/k norms, no biases), exactly three
                    taps whose nested `eagle_config` ids start at 1 (the only ids every SGLang version reads as
                    output-of-layer), own `lm_head` [Vd, d] with `d2t` / `t2d`, no embedding.
  deepspec-eagle3   `Qwen3Eagle3Model` (§2.6): a Qwen3 layer (q/k norms), exactly five taps, the full vocabulary,
                    residual on the raw hidden, shipped embedding / LM-head copies.
  deepspec          `Qwen3DSparkModel` (§2.2–2.3): DSpark (vanilla Markov head) or DFlash (markov_rank 0), Qwen3
                    layers, the anchor layout, shipped embedding / LM-head copies.
  zlab-dflash       `DFlashDraftModel` (§4.1): DFlash only, the fill-in layout, the target's embedding and head.
  specforge-dspark  `DSparkDraftModel` (§4.2): DSpark only, its layout stated by `sample_from_anchor`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from drafter_worker.calibration import Calibration
from drafter_worker.config import HeadType, Method
from drafter_worker.formats import deepspec
from drafter_worker.formats.layouts import ConversionRefused, Spec, spec_for
from services.embeddings import TargetEmbeddings

FORMATS = ("dspark", "specforge-eagle3", "deepspec-eagle3", "deepspec", "zlab-dflash", "specforge-dspark")


def write_released(model, target, out_dir: str | Path, fmt: str, dtype: torch.dtype = torch.bfloat16,
                   calibration: Calibration | None = None) -> Path:
    """Write `model` (a drafter loaded for `target`: a loaded target or its `TargetEmbeddings`) to `out_dir` in
    released format `fmt`."""
    target = TargetEmbeddings.of(target)
    if fmt not in FORMATS[1:]:
        raise ConversionRefused(f"unknown target format {fmt!r} (known: {', '.join(FORMATS)})")
    if model.dconfig.method is Method.MTP:
        raise ConversionRefused(_MTP_REASON)
    spec = spec_for(fmt, model, target)  # refuses what the format's config cannot express
    tensors = format_tensors(model, target, spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().to(v.dtype if not v.is_floating_point() else dtype).contiguous()
             for k, v in tensors.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**spec.config, "torch_dtype": str(dtype).split(".")[-1]},
                                                indent=2) + "\n")
    if calibration is not None:  # dspark's sidecar: other engines ignore it, dspark's loaders read it in any format
        calibration.save(out / "calibration.json")
    return out


_MTP_REASON = ("an mtp drafter has no released format to go to: dspark's MTP reads fc(concat of its taps), while "
               "DeepSeek-V3 / Qwen3-Next MTP modules read the target's final normed hidden alone through MLA or "
               "gated attention and MoE layers, and a released MTP module already lives in its target's checkpoint")


def dspark_to_format(name: str, spec: Spec) -> str:
    """dspark's tensor name → the format's (inverse of the loaders' renames)."""
    if spec.chain:
        if name.startswith("layer."):
            module, _, rest = name[len("layer."):].partition(".")
            return spec.layer_prefix + ("input_layernorm" if module == "embed_norm" else module) + "." + rest
        return "fc.weight" if name == "context.fc.weight" else name
    inverse = {v: k for k, v in deepspec.RENAMES.items()}
    return inverse.get(name, name)


def format_tensors(model, target, spec: Spec) -> dict[str, torch.Tensor]:
    """The format's tensors, or a refusal naming the first dspark tensor (or missing format tensor) that breaks
    the format's key set."""
    state = dict(model.state_dict())
    for name in ("embed_tokens.weight", "lm_head.weight"):
        if name in spec.shipped:
            continue
        state.pop(name, None)
        theirs = target.embed_tokens if name.startswith("embed") else target.lm_head
        mine = model.get_parameter(name)
        if mine.shape != theirs.shape or not torch.equal(mine.detach().cpu(), theirs.detach().cpu().to(mine.dtype)):
            raise ConversionRefused(f"{spec.name}: the drafter's {name} differs from the target's; the format has "
                                    "none and uses the target's")
    out = {dspark_to_format(k, spec): v for k, v in state.items()}
    origin = {dspark_to_format(k, spec): k for k in state}
    out |= spec.extra_tensors
    extra = sorted(set(out) - set(spec.keys))
    if extra:
        raise ConversionRefused(f"{spec.name}: the drafter's {origin.get(extra[0], extra[0])} has no place in "
                                f"{spec.architecture} ({_why(origin.get(extra[0], extra[0]))})")
    missing = sorted(set(spec.keys) - set(out))
    if missing:
        raise ConversionRefused(f"{spec.name}: {spec.architecture} needs {missing[0]}, which the drafter has no "
                                f"counterpart of ({_why(missing[0])})")
    wrong = [f"{k} {list(out[k].shape)} (the format: {list(s)})" for k, s in spec.keys.items()
             if tuple(out[k].shape) != tuple(s)]
    if wrong:
        raise ConversionRefused(f"{spec.name}: wrong shapes for {spec.architecture}: {', '.join(wrong[:3])}")
    return out


def _why(name: str) -> str:
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return "per-head q/k RMSNorm: a Qwen3 layer always has it, a Llama layer never; RMSNorm with weight 1 is " \
               "not the identity, so neither can stand in for the other"
    if name.endswith(".bias"):
        return "the format's layers have no biases"
    if name.startswith("seq_head.") and "markov" not in name:
        return f"only the {HeadType.MARKOV.value} (vanilla) head is a format's; gated/rnn input orders are unverified"
    return "not in the format's tensor list"
