"""`dspark convert-drafter SRC OUT --target T [--to FORMAT]`: a drafter checkpoint rewritten in dspark's own layout,
or (`--to`) in a released format where that format can express it (`drafter_worker/formats/writers.py`).

The source is loaded through the same path serving uses (format detected from its config.json, or forced),
then saved as dspark writes its own drafters: config.json with a `dspark_drafter` section (taps resolved,
reduced vocabulary and options kept), model.safetensors without the tensors the target provides. The result
loads without format detection and drafts the same blocks (`tests/test_convert_drafter.py`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from rich.console import Console

from drafter_worker.checkpoint import load_drafter, save_drafter, shared_names
from drafter_worker.formats.writers import FORMATS, write_released
from services.errors import ModelLoadError
from services.loader import load_model
from services.registry import model_name, resolve_model


def add_parser(sub) -> None:
    p = sub.add_parser("convert-drafter", help="rewrite a drafter checkpoint in dspark's own layout or, with --to, "
                                             "in a released format")
    p.add_argument("src", type=Path, help="drafter checkpoint directory (DeepSpec, SpecForge EAGLE-3, dspark)")
    p.add_argument("out", type=Path)
    p.add_argument("--target", required=True, help="the target model it drafts for (name or directory)")
    p.add_argument("--drafter-format", default="auto", help="force the source format (auto: detect)")
    p.add_argument("--eagle-aux-layer-convention", default="auto", choices=("auto", "output", "input"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    p.add_argument("--to", default="dspark", choices=FORMATS,
                   help="the layout to write (dspark: its own; the others: released formats, refused by name where "
                        "they cannot express the drafter)")


def run_convert(args: argparse.Namespace) -> int:
    model_dir = resolve_model(args.target)
    target = load_model(model_dir, "float32", "cpu")
    drafter, calibration = load_drafter(args.src, target, "float32", "cpu", args.drafter_format,
                                        args.eagle_aux_layer_convention)
    if args.to != "dspark":
        out = write_released(drafter, target, args.out, args.to, getattr(torch, args.dtype), calibration)
        Console(stderr=True).print(f"wrote {drafter.dconfig.method} drafter as {args.to} to {out}")
        return 0
    for name in shared_names(drafter):  # a shipped copy that differs from the target has no place in the layout
        mine = drafter.get_parameter(name)
        theirs = target.get_parameter("model." + name if name.startswith("embed") else name)
        if name == "lm_head.weight" and drafter.reduced_vocab:  # the rows of its draft vocabulary
            theirs = theirs[drafter.to_target(torch.arange(len(mine)))]
        if not torch.equal(mine, theirs):
            raise ModelLoadError(f"{args.src}: its {name} differs from the target's; dspark's layout shares it")
    drafter.dconfig.target = model_name(args.target)
    out = save_drafter(drafter, args.out, getattr(torch, args.dtype), calibration)
    Console(stderr=True).print(f"wrote {drafter.dconfig.method} drafter (taps {list(drafter.dconfig.tap_layers)}) "
                               f"to {out}")
    return 0
