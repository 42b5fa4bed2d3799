"""Structured output on llguidance: a request's grammar state, and the masks of the rows it verifies.

Exact under speculation, as the logits processors are (services/processors.py): a verify item [anchor, x1..xℓ]
has ℓ + 1 rows, and row k is masked to what the grammar allows after the committed output and x1..xk — the
state plain decoding would be in — never reading x_{k+1}, the token the row decides about. `RequestGrammar`
keeps the state of the committed output; `masks` advances a copy of it through the drafts (a draft the grammar
forbids ends the walk: its row masks it out, so it is rejected there and later rows are never read), then rolls
back; `commit` advances it by what a cycle emitted. Greedy constrained speculative output is then constrained
plain output token for token, and sampled output follows the masked target distribution (the rejection test
runs against it).

Cost on Gemma's 262,144-token vocabulary (a JSON schema, `benchmarks/grammar_engines.py`, Xeon with AMX): a mask
0.26 ms mean (the first 4.9 ms, later ones ~0.1), a compile 1.2 ms, against a 30 ms target step; the tokenizer's
token trie is built once a process per model (4–5 s for Gemma's) and cached.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path

import llguidance
import numpy as np
import torch

# llguidance's numpy helpers, not its torch ones: llguidance.torch compiles a kernel we do not use at import,
# which imports torch's compiler (3.3 s of every router's and tier's start)
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from services.errors import InvalidRequestError
from services.tokenizer import TextTokenizer
from services.types import Grammar, GrammarKind

# JSON as json.dumps writes it: ", " and ": " between items, no other whitespace — else a model may pad an object
# with newlines until max_tokens (llguidance's default allows any run of it). A schema's own "x-guidance" wins.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@functools.lru_cache(maxsize=4)
def _tokenizer(model_dir: str) -> tuple[llguidance.LLTokenizer, frozenset[int]]:
    """A model's vocabulary for llguidance (its EOS ids as the model's tokenizer says), built once a process."""
    eos = TextTokenizer.from_dir(model_dir).eos_token_ids
    return llguidance.LLTokenizer(str(Path(model_dir) / "tokenizer.json"), eos_token=list(eos)), frozenset(eos)


def compile_grammar(grammar: Grammar) -> str:
    """The request's constraint → llguidance's grammar; a constraint it cannot read is refused by name."""
    try:
        if grammar.kind is GrammarKind.JSON_SCHEMA:
            return llguidance.LLMatcher.grammar_from_json_schema(grammar.text, defaults=JSON_LAYOUT)
        if grammar.kind is GrammarKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(grammar.text)
        if grammar.kind is GrammarKind.CHOICE:
            choices = json.loads(grammar.text)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
                raise ValueError("choice takes a non-empty list of strings")
            return llguidance.grammar_from("choice", grammar.text)
        return llguidance.grammar_from("grammar", grammar.text)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"{grammar.kind}: {exc}") from exc


class GrammarTokenizer:
    """A model's vocabulary as llguidance sees it (its tokenizer.json, its EOS ids), and the logits width."""

    def __init__(self, model_dir: str | Path | None, vocab_size: int):
        path = None if model_dir is None else Path(model_dir) / "tokenizer.json"
        if path is None or not path.is_file():
            raise InvalidRequestError("structured output needs the model's tokenizer (tokenizer.json), which this "
                                      "verifier was not given")
        self.lltok, self.eos = _tokenizer(str(path.parent))
        self.vocab_size = vocab_size  # the logits' width; ids past the tokenizer's are never allowed

    def start(self, grammar: Grammar) -> RequestGrammar:
        """A request's grammar at the start of its output; a grammar that does not compile → 400 by name."""
        matcher = llguidance.LLMatcher(self.lltok, compile_grammar(grammar))
        if matcher.is_error():
            raise InvalidRequestError(f"{grammar.kind}: {matcher.get_error()}")
        return RequestGrammar(matcher, self.lltok.vocab_size, self.vocab_size, self.eos)


class RequestGrammar:
    """One request's grammar state over its committed output."""

    def __init__(self, matcher: llguidance.LLMatcher, tokenizer_vocab: int, vocab_size: int,
                 eos: frozenset[int] = frozenset()):
        self.matcher, self.vocab_size, self.eos = matcher, vocab_size, eos
        self._bits = allocate_token_bitmask(1, tokenizer_vocab)  # [1, ⌈V'/32⌉] int32

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens allowed next in the matcher's current state."""
        fill_next_token_bitmask(self.matcher, self._bits)
        # [⌈V'/32⌉] int32 words, bit j of word w = token 32 w + j: as little-endian bytes, numpy's C unpacking
        # puts the bits in token order (a torch shift-and-mask over 262,144 bits took 1.5 ms a row)
        allowed = np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")
        out = np.zeros(self.vocab_size, dtype=np.bool_)
        n = min(self.vocab_size, len(allowed))
        out[:n] = allowed[:n]
        return torch.from_numpy(out)

    def masks(self, drafts: Sequence[int]) -> torch.Tensor:
        """[ℓ + 1, V] bool: row k allows what the grammar allows after the committed output and drafts[:k]."""
        rows, consumed = [self.allowed()], 0
        for token in drafts:
            if not rows[-1][token]:
                break  # forbidden here: its row rejects it, and no later row is read
            if token in self.eos:  # allowed: the grammar is complete, and after it so is every later row's state
                rows.append(self._only_eos())  # (not consumed: llguidance's rollback does not undo a stop)
                break
            if not self.matcher.consume_token(token):
                break
            consumed += 1
            rows.append(self.allowed())
        rows.extend(rows[-1:] * (len(drafts) + 1 - len(rows)))
        if consumed:
            self.matcher.rollback(consumed)
        return torch.stack(rows)

    def _only_eos(self) -> torch.Tensor:
        """[V] bool: what a complete grammar allows (the end of sequence only)."""
        out = torch.zeros(self.vocab_size, dtype=torch.bool)
        out[[t for t in self.eos if t < self.vocab_size]] = True
        return out

    def advance(self, token: int) -> bool:
        """Consume one token tentatively (a draft): False, and nothing consumed, if the grammar forbids it or ends
        with it (an end of sequence is never consumed tentatively: llguidance's rollback does not undo a stop)."""
        return token not in self.eos and not self.matcher.is_stopped() and self.matcher.consume_token(token)

    def rollback(self, count: int) -> None:
        """Undo the last `count` tokens `advance` consumed."""
        if count:
            self.matcher.rollback(count)

    def commit(self, tokens: Sequence[int]) -> None:
        """The tokens a cycle emitted (each allowed by its masked row; past a complete grammar only EOS is, which
        an `ignore_eos` request keeps generating and the grammar need not read)."""
        for token in tokens:
            if self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"grammar refused emitted token {token}: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but EOS may follow."""
        return self.matcher.is_stopped()
