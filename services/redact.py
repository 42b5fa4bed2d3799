"""Secrets out of logs and error messages: connection URLs carry passwords (`redis://user:PASSWORD@host`)."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit

MASK = "***"
_SECRET_PARAMS = {"password", "pass", "token"}  # query parameters redis-py (and others) read credentials from


def redact_url(url: str) -> str:
    """`url` with its password and any password-like query values replaced by ***; the rest stays readable
    (scheme, user, host, port, database) so an operator can still tell which server was meant."""
    try:
        parts = urlsplit(url)
        host = parts.netloc.rpartition("@")[2]
        netloc = parts.netloc if parts.password is None else f"{parts.username or ''}:{MASK}@{host}"
        query = [(k, MASK if k.lower() in _SECRET_PARAMS else v) for k, v in parse_qsl(parts.query, True)]
        # Reassembled by hand: urlunsplit turns `unix:///path` into `unix:/path`.
        return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{urlencode(query, safe='*')}" if query else "")
    except ValueError:  # unparseable (e.g. a bad port): nothing of it is safe to show
        return f"{url.partition(':')[0]}://{MASK}"
