"""The lease on a request's state in a tier (a KV slot, a draft context): while a stream carries the request it
is kept; once none has for `lease_s` (its router went away between calls) the tier frees it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class Lease:
    streams: int = 0  # streams attached (0 or 1 in practice)
    touched: float = field(default_factory=time.monotonic)  # opened, last cycle or last stream's end

    def touch(self) -> None:
        self.touched = time.monotonic()

    def attach(self) -> None:
        self.streams += 1

    def detach(self) -> None:
        self.streams -= 1
        self.touch()

    def expired(self, lease_s: float, now: float) -> bool:
        return self.streams <= 0 and now - self.touched > lease_s
