"""Settings machinery of every process: pydantic models that reject unknown keys, read from YAML and flags.

Precedence: command-line flag > `--config FILE` > defaults. Flag names are the field names in kebab
case (`num_slots` → `--num-slots`; a nested section's fields get its name first: `tls.cert` → `--tls-cert`);
in `dspark serve` the file has one section per role, and a top-level `tls:` that every role inherits.
Each role's own settings live beside its composition root (`verifier_worker/settings.py`, ...).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from services.errors import InvalidRequestError
from services.tls import TlsSettings

Traces = Literal["none", "console", "otlp"]


def cache_dir(kind: str) -> Path:
    """Where this host keeps what it derives once and reuses (`gguf` conversions, `sps` profiles):
    `$DSPARK_CACHE_DIR/<kind>`, by default under ~/.cache/dspark."""
    return Path(os.environ.get("DSPARK_CACHE_DIR", Path.home() / ".cache" / "dspark")) / kind


class Settings(BaseModel):
    """Settings at a process edge: unknown keys are errors, never ignored."""


    model_config = ConfigDict(extra="forbid")


class GrpcServerSettings(Settings):
    tls: TlsSettings | None = Field(None, description="serve gRPC over TLS (null: plaintext; keep it on loopback "
                                    "or a private network)")

    @model_validator(mode="after")
    def _tls_identity(self) -> GrpcServerSettings:
        if self.tls is not None and self.tls.cert is None:
            raise ValueError("tls: a gRPC server needs cert and key")
        return self


def section_model(kind) -> type[BaseModel] | None:
    """The model of a nested section field (`TlsSettings | None` → TlsSettings), else None."""
    for k in (kind, *getattr(kind, "__args__", ())):
        if isinstance(k, type) and issubclass(k, BaseModel):
            return k
    return None


def add_flags(parser: argparse.ArgumentParser, settings: type[BaseModel], prefix: str = "") -> None:
    """One `--kebab-case` flag per field (a nested section's: `--section-field`, dest `section.field`); unset
    flags stay out of the merge (file and defaults win)."""
    for name, field in settings.model_fields.items():
        kind, dest = field.annotation, prefix + name
        if (section := section_model(kind)) is not None:
            add_flags(parser, section, dest + ".")
            continue
        flag = "--" + dest.replace(".", "-").replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=field.description)
            continue
        kw = {"dest": dest, "metavar": dest.replace(".", "_").upper(), "default": argparse.SUPPRESS}
        if "list" in str(kind):
            parser.add_argument(flag, help=(field.description or "") + " (comma-separated)",
                                type=lambda s: [x for x in s.split(",") if x], **kw)
        else:
            parser.add_argument(flag, help=field.description, type=kind if kind in (int, float) else None, **kw)


def nest(flags: dict) -> dict:
    """Dotted flag destinations as sections: {"tls.cert": x} → {"tls": {"cert": x}}."""
    out: dict = {}
    for key, value in flags.items():
        *path, last = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`, section by section (a flag sets one key of a file's section, not all of it)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load(settings: type[Settings], config: Path | None, flags: dict) -> Settings:
    raw = {}
    if config is not None:
        try:
            raw = yaml.safe_load(Path(config).read_text()) or {}
        except (OSError, yaml.YAMLError) as error:
            raise InvalidRequestError(f"--config {config}: {error}") from None
        if not isinstance(raw, dict):
            raise InvalidRequestError(f"--config {config}: expected a mapping")
    merged = merge(raw, nest(flags))
    try:
        return settings.model_validate(merged)
    except ValidationError as error:
        raise InvalidRequestError(f"bad settings: {error}") from None
