"""TLS between the tiers: which PEM files to use (settings) and their contents, read once at start.

One `TlsSettings` serves both ends of a hop. A server (verifier, drafter) presents `cert`/`key` and,
with `client_auth`, admits only clients whose certificate `ca` signed (mTLS). A client (the router)
trusts servers that `ca` signed and, with `client_auth`, presents `cert`/`key` itself. The files are
read when a server or router starts, so a missing or unreadable file stops it there with the setting's
name and path in the message; the key's bytes are never part of a message or a repr.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.errors import InvalidRequestError


class TlsSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cert: Path | None = Field(None, description="PEM certificate chain this end presents (a server always does)")
    key: Path | None = Field(None, description="PEM private key of cert")
    ca: Path | None = Field(None, description="PEM CA certificate(s) that sign the peers (default for clients: the "
                            "system's roots)")
    client_auth: bool = Field(False, description="mTLS: servers require a client certificate signed by ca, clients "
                              "present cert")
    server_name: str | None = Field(None, description="clients check server certificates against this name instead "
                                    "of the address's host (replicas addressed by IP, certificates issued to a name)")

    @model_validator(mode="after")
    def _complete(self) -> TlsSettings:
        if (self.cert is None) != (self.key is None):
            raise ValueError("tls: cert and key go together")
        if self.client_auth and (self.ca is None or self.cert is None):
            raise ValueError("tls.client_auth needs ca (to verify the peer) and cert/key (to present)")
        return self


@dataclass(frozen=True)
class TlsMaterial:
    """The PEM bytes of a `TlsSettings` (None where the setting is unset)."""

    cert: bytes | None
    key: bytes | None = field(repr=False)
    ca: bytes | None
    client_auth: bool
    server_name: str | None


def _pem(name: str, path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        data = path.expanduser().read_bytes()
    except OSError as error:
        raise InvalidRequestError(f"tls.{name} {path}: cannot read ({error.strerror or error})") from None
    if b"-----BEGIN " not in data:
        raise InvalidRequestError(f"tls.{name} {path}: not a PEM file")
    return data


def read_tls(settings: TlsSettings | None) -> TlsMaterial | None:
    """The files' contents (None: plaintext); a missing, unreadable or non-PEM file is an InvalidRequestError."""
    if settings is None:
        return None
    return TlsMaterial(_pem("cert", settings.cert), _pem("key", settings.key), _pem("ca", settings.ca),
                       settings.client_auth, settings.server_name)
