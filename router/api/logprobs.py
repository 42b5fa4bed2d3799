"""Token log-probabilities in OpenAI's two response shapes.

Completions (the legacy shape lm-eval's loglikelihood reads): parallel lists `tokens`, `token_logprobs`,
`top_logprobs` (token text → logprob) and `text_offset` (each token's character offset in the choice's text;
with `echo` the prompt's tokens come first and the first has no logprob, `null`). Chat: `content`, a list of
{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}. A token's text is its own decode, as vLLM
gives it; JSON has no -inf, so an impossible token reads -9999.0 (vLLM's value).
"""

from __future__ import annotations

import math

from services.tokenizer import TextTokenizer
from services.types import TokenLogprobs

_FLOOR = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else _FLOOR


class LogprobFormat:
    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        if token_id not in self._texts:
            self._texts[token_id] = self.tokenizer.decode([token_id])
        return self._texts[token_id]

    def completion(self, token_ids: list[int], lp: TokenLogprobs | None, offset: int,
                   prompt: tuple[list[int], TokenLogprobs | None] | None = None) -> dict:
        """The completions `logprobs` object of `token_ids` (prompt tokens first with echo), offsets from `offset`."""
        tokens, values, tops = [], [], []
        if prompt is not None:
            ids, plp = prompt
            for i, token in enumerate(ids):
                tokens.append(token)
                known = plp is not None and 0 < i <= len(plp)  # the first prompt token has no logprob
                values.append(_finite(plp.logprobs[i - 1]) if known else None)
                tops.append(self._top_dict(plp, i - 1, token) if known else None)
        for i, token in enumerate(token_ids):
            tokens.append(token)
            values.append(None if lp is None else _finite(lp.logprobs[i]))
            tops.append(None if lp is None else self._top_dict(lp, i, token))
        texts = [self.text(t) for t in tokens]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": texts, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def chat(self, token_ids: list[int], lp: TokenLogprobs | None) -> dict:
        """The chat `logprobs` object: {"content": [...]} with one entry per token."""
        content = []
        for i, token in enumerate(token_ids):
            entry = self._entry(token, None if lp is None else lp.logprobs[i])
            entry["top_logprobs"] = [] if lp is None else [
                self._entry(t, v) for t, v in zip(lp.top_ids[i], lp.top_logprobs[i], strict=True)]
            content.append(entry)
        return {"content": content}

    def _entry(self, token: int, value: float | None) -> dict:
        text = self.text(token)
        return {"token": text, "logprob": None if value is None else _finite(value), "bytes": list(text.encode())}

    def _top_dict(self, lp: TokenLogprobs, i: int, token: int) -> dict[str, float]:
        """The top alternatives and the token itself (vLLM's completions add it: `logprobs: 0` gives just it)."""
        top = {self.text(t): _finite(v) for t, v in zip(lp.top_ids[i], lp.top_logprobs[i], strict=True)}
        top.setdefault(self.text(token), _finite(lp.logprobs[i]))
        return top
