"""Incremental detokenization with stop strings, for streaming one text delta per cycle.

Each new token is decoded in a short window rather than re-decoding the whole output (which made a cycle's
cost grow with the output: O(n²) over a request). The window is vLLM's: the tokens since `prefix` give the
decoder its left context (byte-level BPE merges and a leading-space rule depend on it), and the text they
add beyond the window's earlier part is the new text. A window whose text ends in U+FFFD (an incomplete
UTF-8 sequence) waits for its next token. Text that could still become a stop string is held back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.tokenizer import TextTokenizer

_CONTEXT = 5  # tokens of left context a window keeps when it moves on (vLLM keeps 5 too)


@dataclass(slots=True)
class TextStream:
    tokenizer: TextTokenizer | None
    stop: tuple[str, ...] = ()
    include_stop: bool = False  # the text ends after the stop string rather than before it
    skip_special: bool = True  # special tokens (BOS, EOS) have no text
    min_tokens: int = 0  # stop strings count only in text after this many tokens (vLLM's rule)
    token_ids: list[int] = field(default_factory=list)
    sent: int = 0  # characters of text already handed out
    stopped: bool = False
    _full: str = field(default="", init=False)  # decoded text of token_ids[:_read]
    _prefix: int = field(default=0, init=False)  # start of the decode window (left context)
    _read: int = field(default=0, init=False)  # tokens whose text is in _full
    _stops_from: int = field(default=0, init=False)  # a stop string must end past this character of _full

    def feed(self, new_ids: list[int]) -> tuple[list[int], str]:
        """Add a cycle's tokens → (tokens kept, text delta). After a stop string, later tokens are dropped."""
        if not self.stop:  # no stop strings: one window decode per cycle
            self.token_ids.extend(new_ids)
            self._advance()
            return list(new_ids), self._delta(final=False)
        kept = []
        for token in new_ids:  # find the token that completes a stop string
            if self.stopped:
                break
            self.token_ids.append(token)
            kept.append(token)
            self._advance()
            self.stopped = self._stop_at(self._full) is not None
        return kept, self._delta(final=self.stopped)

    def flush(self) -> str:
        """The text held back, at the end of the request (an incomplete UTF-8 tail included, as U+FFFD)."""
        self._advance(final=True)
        return self._delta(final=True)

    @property
    def text(self) -> str:
        cut = self._stop_at(self._full)
        return self._full if cut is None else self._full[:cut]

    def _advance(self, final: bool = False) -> None:
        """Move the tokens after `_read` into `_full`, unless their text is still an incomplete character."""
        if self.tokenizer is None or self._read == len(self.token_ids):
            return
        known = self.tokenizer.decode(self.token_ids[self._prefix : self._read], self.skip_special)
        window = self.tokenizer.decode(self.token_ids[self._prefix :], self.skip_special)
        if window.endswith("\ufffd") and not final:
            return
        if len(self.token_ids) < self.min_tokens:  # text before the min_tokens-th token completes no stop string
            self._stops_from = len(self._full) + len(window) - len(known)
        self._full += window[len(known) :]
        self._read = len(self.token_ids)
        self._prefix = max(0, self._read - _CONTEXT)

    def _stop_at(self, text: str) -> int | None:
        """Where the text ends for the first stop string in it (its start, or its end with include_stop)."""
        hits = []
        for s in self.stop:
            i = text.find(s, max(0, self._stops_from - len(s) + 1))
            if i >= 0:
                hits.append((i, i + len(s) if self.include_stop else i))
        return min(hits)[1] if hits else None

    def _delta(self, final: bool) -> str:
        text = self.text
        safe = len(text)
        if not final:
            hold = 0
            for s in self.stop:  # hold back a suffix that is a proper prefix of a stop string
                hold = max([hold, *(n for n in range(1, min(len(s) - 1, safe) + 1) if text[safe - n : safe] == s[:n])])
            safe -= hold
        if safe <= self.sent:
            return ""
        delta, self.sent = text[self.sent : safe], safe
        return delta
