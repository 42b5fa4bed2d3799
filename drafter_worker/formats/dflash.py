"""z-lab's DFlash drafters (`DFlashDraftModel`) and SpecForge's DSpark (`DSparkDraftModel`).

The format (docs/drafters.md, Released checkpoint formats §4.1–4.2): DeepSpec's backbone names (`fc`,
`hidden_norm`, `layers.{i}.*` with q/k norms, `norm`; SpecForge DSpark adds DeepSpec's `markov_head.*` and
`confidence_head.*`), no embedding and no LM head (the target's), and the drafter fields in a nested
`dflash_config` (or at top level): `mask_token_id`, `target_layer_ids` (output of layer k, as dspark's taps;
absent: z-lab's default round(1 + i·(L−4)/(Ld−1))). z-lab's block is the fill-in layout: a block of
`block_size` B slots yields B − 1 drafts. SpecForge's DSpark declares its layout with `sample_from_anchor`;
without it the layout is not known for sure, and loading refuses rather than guess.
"""

from __future__ import annotations

from drafter_worker.config import DrafterConfig, HeadType, Method
from drafter_worker.formats import deepspec
from services.errors import ModelLoadError

ARCHITECTURES = ("DFlashDraftModel", "DSparkDraftModel")


def matches(raw: dict) -> bool:
    return (raw.get("architectures") or [None])[0] in ARCHITECTURES


def field(raw: dict, key: str, default=None):
    """`dflash_config` first, then the top level (as vLLM and SGLang read them)."""
    return (raw.get("dflash_config") or {}).get(key, raw.get(key, default))


def default_taps(target_layers: int, draft_layers: int) -> tuple[int, ...]:
    if draft_layers == 1:
        return (target_layers // 2,)
    return tuple(round(1 + i * (target_layers - 4) / (draft_layers - 1)) for i in range(draft_layers))


def drafter_config(raw: dict, where: str, target_layers: int) -> DrafterConfig:
    dspark = raw["architectures"][0] == "DSparkDraftModel"
    layers, block = int(raw.get("num_hidden_layers", 1)), int(field(raw, "block_size", 16))
    mask = field(raw, "mask_token_id")
    if mask is None:
        raise ModelLoadError(f"{where}: no mask_token_id (dflash_config or top level)")
    taps = field(raw, "target_layer_ids")
    taps = default_taps(target_layers, layers) if taps is None else tuple(int(t) for t in taps)
    if dspark:
        anchored = field(raw, "sample_from_anchor")
        if anchored is None:
            raise ModelLoadError(f"{where}: a SpecForge DSpark config without sample_from_anchor: its block layout "
                                 "is not known for sure")
        layout = "anchor" if anchored else "fill_in"
    else:
        layout = "fill_in" if field(raw, "sample_from_anchor", False) is False else "anchor"
    drafts = block - (layout == "fill_in")
    if not dspark:
        return DrafterConfig(Method.DFLASH, "", taps, num_layers=layers, block_size=drafts, mask_token_id=int(mask),
                             layout=layout)
    head = field(raw, "markov_head_type", "vanilla")
    if head != "vanilla" or not field(raw, "confidence_head_with_markov", True):
        raise ModelLoadError(f"{where}: only the vanilla Markov head with confidence_head_with_markov is supported")
    return DrafterConfig(Method.DSPARK, "", taps, num_layers=layers, block_size=drafts, mask_token_id=int(mask),
                         head=HeadType.MARKOV, markov_rank=int(field(raw, "markov_rank")),
                         confidence_head=bool(field(raw, "enable_confidence_head", True)), layout=layout)


def rename(state: dict, where: str) -> dict:
    """Same names as DeepSpec's; vLLM's accepted aliases too (`midlayer.` → `layers.0.`, Muse-Glimmer's
    `encoder.fc.` / `encoder.output_norm_enc.`)."""
    aliases = {"encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm.", "midlayer.": "layers.0."}
    renamed = {}
    for name, tensor in state.items():
        for old, new in aliases.items():
            if name.startswith(old):
                name = new + name[len(old):]
        renamed[name] = tensor
    return deepspec.rename(renamed, where)
