"""One admission step for every client front (HTTP, gRPC): a client's prompt and options → a `RouterRequest`
whose speculation is already resolved, or the error that says why not.

One length rule for both fronts: prompt + max_tokens must fit `max_model_len`; a request that names no
max_tokens gets the rest of the context. A text prompt is refused by its length before it is tokenized
(tokenizing is slow and superlinear: a 4 MB prompt would hold the event loop for a minute), since no token
spells more characters than the longest one. Capacity (429) is checked once, by `Router.generate`.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence

from router.router import Router
from router.session import RouterRequest
from services.errors import InvalidRequestError
from services.tokenizer import TextTokenizer
from services.types import MAX_BAD_WORD_TOKENS, SamplingParams


class AdmissionError(InvalidRequestError):
    """Bad input, with the request field at fault and an OpenAI error code for the HTTP front."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.param, self.code = param, code


class Admission:
    def __init__(self, router: Router, tokenizer: TextTokenizer, max_model_len: int):
        self.router, self.tokenizer, self.max_model_len = router, tokenizer, max_model_len
        longest = max(len(tokenizer.decode([i])) for i in range(tokenizer.vocab_size))
        self.max_chars = max_model_len * max(longest, 1)

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        self._fits(text, param)
        return self.tokenizer.encode(text, add_special_tokens)

    def encode_chat(self, messages: list[dict[str, str]], param: str = "messages") -> list[int]:
        """The conversation in the model's own chat template (its BOS once)."""
        try:
            text = self.tokenizer.render_chat(messages)
        except InvalidRequestError as e:
            raise AdmissionError(str(e), param) from e
        self._fits(text, param)
        return self.tokenizer.chat_ids(messages)

    def bad_words(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's rule: each word as written (left-stripped) and, where that makes other tokens of the same
        count, with a leading space (the word inside a sentence)."""
        out: list[tuple[int, ...]] = []
        for word in words:
            bare = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if len(bare) > MAX_BAD_WORD_TOKENS or len(spaced) > MAX_BAD_WORD_TOKENS:
                raise AdmissionError(f"a bad word may be at most {MAX_BAD_WORD_TOKENS} tokens", "bad_words")
            out += [w for w in (bare, spaced) if w and w not in out and (w is bare or len(w) == len(bare))]
        return tuple(out)

    def _fits(self, text: str, param: str) -> None:
        if len(text) > self.max_chars:
            raise AdmissionError(f"the {param} cannot fit this model's maximum context length of "
                                 f"{self.max_model_len} tokens", param, "context_length_exceeded")

    def token_ids(self, ids: Sequence[int], param: str) -> list[int]:
        if any(not 0 <= t < self.tokenizer.vocab_size for t in ids):
            raise AdmissionError(f"{param} must lie in [0, {self.tokenizer.vocab_size})", param)
        return list(ids)

    def max_tokens(self, wanted: int | None, prompt_tokens: int, prompt_param: str) -> int:
        """The length rule: `wanted` (None: the rest of the context) if prompt + wanted fits the context."""
        room = self.max_model_len - prompt_tokens
        if room < 1 or (wanted or 0) > room:
            raise AdmissionError(f"this model's maximum context length is {self.max_model_len} tokens; the "
                                 f"request has {prompt_tokens} prompt tokens and asks for {wanted or 'at least 1'} "
                                 "more", "max_tokens" if room >= 1 else prompt_param, "context_length_exceeded")
        return wanted or room

    def __call__(self, prompt_ids: list[int], params: SamplingParams, client_id: str, stop: tuple[str, ...],
                 stop_token_ids: Sequence[int], ignore_eos: bool, speculative: dict | None,
                 include_stop: bool = False, skip_special: bool = True) -> RouterRequest:
        """The request as the router core takes it: EOS unless ignore_eos, a session id unique even when a client
        reuses its own (a request rejected as a duplicate would release the other's sessions), speculation
        resolved against what this deployment serves; min_tokens masks the same stop tokens the router stops at."""
        eos = () if ignore_eos else tuple(self.tokenizer.eos_token_ids)
        stop_ids = (*eos, *self.token_ids(stop_token_ids, "stop_token_ids"))
        if params.min_tokens > params.max_tokens:
            raise AdmissionError(f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({params.max_tokens})",
                                 "min_tokens")
        if params.logit_bias:
            self.token_ids([t for t, _ in params.logit_bias], "logit_bias")
        if params.allowed_token_ids:
            self.token_ids(params.allowed_token_ids, "allowed_token_ids")
        if params.min_tokens:
            params = dataclasses.replace(params, stop_token_ids=tuple(dict.fromkeys(stop_ids)))
        return RouterRequest(prompt_ids, params, session_id(client_id), stop, stop_ids,
                             self.router.speculation(speculative), include_stop, skip_special)


def session_id(client_id: str) -> str:
    return f"{client_id}-{uuid.uuid4().hex[:8]}" if client_id else uuid.uuid4().hex
