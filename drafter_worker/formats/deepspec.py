"""DeepSpec's released DSpark and DFlash drafters (`deepseek-ai/dspark_qwen3_*_block7`, `dflash_*_block7`).

What the format is (docs/drafters.md, Released checkpoint formats §2, read from DeepSpec's `Qwen3DSparkModel`): the
target's HF config deep-copied with `architectures: ["Qwen3DSparkModel"]`, `target_layer_ids` (output of
decoder layer k, 0-based: dspark's own tap meaning), `block_size`, `mask_token_id`, `markov_rank` (0: DFlash),
`enable_confidence_head`, `confidence_head_with_markov`, `markov_head_type`. Tensors at top level:
`fc`, `hidden_norm`, `layers.{i}.*` (Qwen3 layers: q/k norms), `norm`, `markov_head.markov_w1/w2`,
`confidence_head.proj` (with bias), and frozen copies of the target's `embed_tokens` / `lm_head`.

Its forward is the anchor layout dspark's `BlockDraftModel` runs: ctx = hidden_norm(fc(taps)), every layer's
k/v projections (and k_norm) applied to ctx and to the block, the block attends to the context before the
anchor and to itself, B_k = W2·W1[x_{k−1}], c_k = σ(proj([h_k; W1[x_{k−1}]])). So loading is renaming.
"""

from __future__ import annotations

from drafter_worker.config import DrafterConfig, HeadType, Method
from services.errors import ModelLoadError

ARCHITECTURES = ("Qwen3DSparkModel",)

# DeepSpec name → dspark name; layers.{i}.* keep their names (same module tree).
RENAMES = {
    "fc.weight": "context.fc.weight",
    "hidden_norm.weight": "context.hidden_norm.weight",
    "markov_head.markov_w1.weight": "seq_head.markov_embed.weight",
    "markov_head.markov_w2.weight": "seq_head.markov_proj.weight",
    "confidence_head.proj.weight": "confidence.proj.weight",
    "confidence_head.proj.bias": "confidence.proj.bias",
}


def matches(raw: dict) -> bool:
    return (raw.get("architectures") or [None])[0] in ARCHITECTURES


def drafter_config(raw: dict, where: str) -> DrafterConfig:
    """The config.json fields → dspark's DrafterConfig; a field this loader cannot honour is an error."""
    for key in ("target_layer_ids", "block_size", "mask_token_id", "num_hidden_layers"):
        if key not in raw:
            raise ModelLoadError(f"{where}: DeepSpec config.json lacks {key}")
    taps = tuple(int(t) for t in raw["target_layer_ids"])
    if any(t < 0 for t in taps):  # DeepSpec's −1 is the embedding output, which dspark's target cannot tap
        raise ModelLoadError(f"{where}: target_layer_ids {list(taps)}: −1 (the embedding output) is not a tap here")
    rank = int(raw.get("markov_rank", 0))
    confidence = bool(raw.get("enable_confidence_head", False))
    if rank == 0:
        if confidence:
            raise ModelLoadError(f"{where}: a confidence head without a Markov head is not supported")
        return DrafterConfig(Method.DFLASH, raw.get("target_model_name_or_path", ""), taps,
                             num_layers=int(raw["num_hidden_layers"]), block_size=int(raw["block_size"]),
                             mask_token_id=int(raw["mask_token_id"]))
    head = raw.get("markov_head_type", "vanilla")
    if head != "vanilla":  # gated / rnn: DeepSpec's input order of their projections is not verified here
        raise ModelLoadError(f"{where}: markov_head_type {head!r} is not supported (vanilla only)")
    if confidence and not raw.get("confidence_head_with_markov", True):
        raise ModelLoadError(f"{where}: confidence_head_with_markov false is not supported")
    return DrafterConfig(Method.DSPARK, raw.get("target_model_name_or_path", ""), taps,
                         num_layers=int(raw["num_hidden_layers"]), block_size=int(raw["block_size"]),
                         mask_token_id=int(raw["mask_token_id"]), head=HeadType.MARKOV, markov_rank=rank,
                         confidence_head=confidence)


def rename(state: dict, where: str) -> dict:
    """DeepSpec tensor names → dspark's. Every name is mapped or refused (the shipped embedding and head copies
    keep their names: the loader compares them with the target's)."""
    out = {}
    for name, tensor in state.items():
        if name in RENAMES:
            out[RENAMES[name]] = tensor
        elif name.startswith("layers.") or name in ("norm.weight", "embed_tokens.weight", "lm_head.weight"):
            out[name] = tensor
        elif name.endswith("rotary_emb.inv_freq"):  # recomputed from the config's rope
            continue
        else:
            raise ModelLoadError(f"{where}: unexpected tensor {name!r} for a DeepSpec DSpark/DFlash checkpoint")
    return out
