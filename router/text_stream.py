"""Incremental detokenization with stop strings, for streaming one text delta per cycle.

The whole output is re-decoded each time (byte-level BPE merges across token boundaries, and outputs
here are short), and text that could still change is held back: a trailing U+FFFD (an incomplete
UTF-8 sequence) and any suffix that might grow into a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.tokenizer import TextTokenizer


@dataclass(slots=True)
class TextStream:
    tokenizer: TextTokenizer | None
    stop: tuple[str, ...] = ()
    token_ids: list[int] = field(default_factory=list)
    sent: int = 0  # characters of text already handed out
    stopped: bool = False
    _full: str = field(default="", init=False)  # decoded text of token_ids

    def feed(self, new_ids: list[int]) -> tuple[list[int], str]:
        """Add a cycle's tokens → (tokens kept, text delta). After a stop string, later tokens are dropped."""
        if not self.stop:  # no stop strings: one decode per cycle
            self.token_ids.extend(new_ids)
            self._full = self._decode()
            return list(new_ids), self._delta(final=False)
        kept = []
        for token in new_ids:  # find the token that completes a stop string
            if self.stopped:
                break
            self.token_ids.append(token)
            kept.append(token)
            self._full = self._decode()
            self.stopped = self._stop_at(self._full) is not None
        return kept, self._delta(final=self.stopped)

    def flush(self) -> str:
        """The text held back, at the end of the request."""
        return self._delta(final=True)

    @property
    def text(self) -> str:
        cut = self._stop_at(self._full)
        return self._full if cut is None else self._full[:cut]

    def _decode(self) -> str:
        return self.tokenizer.decode(self.token_ids) if self.tokenizer is not None else ""

    def _stop_at(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _delta(self, final: bool) -> str:
        text = self.text
        safe = len(text)
        if not final:
            while safe > self.sent and text[safe - 1] == "\ufffd":
                safe -= 1
            hold = 0
            for s in self.stop:  # hold back a suffix that is a proper prefix of a stop string
                hold = max([hold, *(n for n in range(1, min(len(s) - 1, safe) + 1) if text[safe - n : safe] == s[:n])])
            safe -= hold
        if safe <= self.sent:
            return ""
        delta, self.sent = text[self.sent : safe], safe
        return delta
