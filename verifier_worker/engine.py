"""The verifier engine: `schedule → execute → update`, one ragged forward per step.

A step batches two kinds of work item: prefill chunks (prompt tokens, chunked under a token
budget so long prompts do not stall decoding) and verify items ([anchor, x1..xℓ] of one cycle;
ℓ = 0 is plain decoding). After the forward the acceptance rule runs per request, accepted
positions are committed and rejected ones rolled back by truncating the request's KV slot.

Invariant per running request: `tokens` holds every committed token; the cache holds all of
them except the last (the anchor), which the next verify item feeds.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services import processors
from services.compiled_step import CompiledStep
from services.errors import CapacityError, InvalidRequestError
from services.layers import RaggedLayout
from services.model import CausalLM
from services.sampling import accept_greedy, accept_stochastic, draft_q, logits_to_probs, sample
from services.types import DraftBlock, OutcomeKind, SamplingParams, StepOutput
from verifier_worker.kv_cache import KVCache
from verifier_worker.work import (
    EngineRequest,
    WorkItem,
    add_logprobs,
    first_token_row,
    grammar_masks,
    logit_positions,
    row_contexts,
    samples_first,
)

if TYPE_CHECKING:  # structured output's llguidance is imported at the first request that asks for it
    from services.grammar import GrammarTokenizer


@dataclass(frozen=True, slots=True)
class EngineConfig:
    num_slots: int = 8  # concurrent requests holding KV
    max_len: int = 1024  # positions per slot: prompt + output + drafts in flight
    max_batch_tokens: int = 256  # prefill token budget of one step (verify items always run)
    max_waiting: int = 256  # admitted requests waiting for a slot; beyond it add_request refuses
    # Run the step forward under torch.compile (services/compiled_step.py): one graph for every step,
    # compiled and warmed here, before the first request. Off: eager, no start-up cost.
    compile: bool = False


class Engine:
    def __init__(self, model: CausalLM, config: EngineConfig | None = None):
        self.model = model
        self.config = config or EngineConfig()
        cfg = model.config
        max_len = min(self.config.max_len, cfg.max_context)
        self.cache = KVCache(cfg, self.config.num_slots, max_len, model.dtype, model.device)
        fuse = getattr(model, "prepare_for_serving", None)
        if fuse is not None:
            fuse()
        self._forward = model  # what a step calls: the model, or its compiled step
        if self.config.compile:
            if not isinstance(model, CausalLM):
                raise ValueError("compile needs a CausalLM (not a tensor-parallel driver)")
            self._forward = CompiledStep(model, max_len, self.config.num_slots)
        self._running: OrderedDict[str, EngineRequest] = OrderedDict()
        self._waiting: deque[EngineRequest] = deque()
        self.last_batch_tokens = 0  # tokens in the last step's forward (the load board's batch_tokens)
        self._grammar: GrammarTokenizer | None = None

    # ---- requests -----------------------------------------------------------------------------
    @property
    def forward(self):
        """What a step calls with (ids, positions, layout, k, v, logit_rows): the model or its compiled step."""
        return self._forward

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    resume_ids: list[int] | tuple[int, ...] = (), share_prefix_of: str = "") -> None:
        """Admit a request; it prefills when a slot is free. Refuses bad input and a full queue.

        `resume_ids` are tokens already emitted elsewhere (a lost verifier): the prefill covers the prompt
        and all of them but the last, which becomes the anchor; `params.max_tokens` counts what is left.
        `share_prefix_of`: a running request with the same prompt (a sibling sample) whose cached prompt
        but its last position is copied when the slot is taken; only a hint (see `_share_prefix`).
        """
        if request_id in self._running or any(r.request_id == request_id for r in self._waiting):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not prompt_ids:
            raise InvalidRequestError("prompt is empty")
        tokens = [*prompt_ids, *resume_ids]
        self._check_vocab(tokens, "prompt")
        self._check_vocab([t for t, _ in params.logit_bias], "logit_bias")
        self._check_vocab(params.allowed_token_ids, "allowed_token_ids")
        self._check_vocab([t for w in params.bad_words for t in w], "bad_words")
        self._check_vocab(list(params.stop_token_ids), "stop")
        if len(tokens) + params.max_tokens > self.max_len:
            raise InvalidRequestError(
                f"prompt ({len(tokens)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context limit of {self.max_len} tokens"
            )
        # Those already waiting take the free slots first; only what is left over has to queue.
        if len(self._waiting) - self.cache.num_free_slots >= self.config.max_waiting:
            raise CapacityError(f"engine queue is full ({self.config.max_waiting} waiting)")
        grammar = None if params.grammar is None else self.grammar_tokenizer().start(params.grammar)
        if grammar is not None and resume_ids:
            grammar.commit(resume_ids)  # the output emitted elsewhere, already inside the grammar
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.model.device).manual_seed(params.seed)
        prefill_len = len(tokens) - 1 if resume_ids else len(tokens)
        self._waiting.append(EngineRequest(request_id, params, tokens, prefill_len, len(prompt_ids), generator,
                                           resumed=bool(resume_ids), share_from=share_prefix_of, grammar=grammar))

    def grammar_tokenizer(self) -> GrammarTokenizer:
        """The model's vocabulary for llguidance, built at the first structured-output request."""
        if self._grammar is None:
            from services.grammar import GrammarTokenizer  # here: llguidance's import costs a tier's start 1.7 s

            self._grammar = GrammarTokenizer(getattr(self.model, "source_dir", None), self.model.config.vocab_size)
        return self._grammar

    def submit(self, request_id: str, draft: DraftBlock | None = None) -> int:
        """Queue one cycle for the next step → the verify length ℓ actually used.

        ℓ is the block's length, cut only by the room left in the request's slot (a decision that
        depends on no draft token, so it keeps the output distribution).
        """
        req = self._running.get(request_id)
        if req is None or req.in_prefill:
            raise InvalidRequestError(f"request {request_id!r} is not ready to verify")
        if req.pending is not None:
            raise InvalidRequestError(f"request {request_id!r} already has a cycle in flight")
        draft = draft or DraftBlock(tokens=[])
        room = self.cache.room(request_id) - 1  # the anchor takes one position
        if room < 0:
            raise InvalidRequestError(f"request {request_id!r} reached the context limit")
        draft = draft.head(min(len(draft), room))
        self._check_draft(draft)
        req.pending = draft
        return len(draft)

    def release(self, request_id: str) -> None:
        """Forget a request wherever it is and free its slot. Unknown ids are ignored."""
        self._running.pop(request_id, None)
        self._waiting = deque(r for r in self._waiting if r.request_id != request_id)
        self.cache.free(request_id)

    def is_running(self, request_id: str) -> bool:
        """Holds a KV slot (prefilling or decoding)."""
        return request_id in self._running

    def is_ready(self, request_id: str) -> bool:
        """Prefilled and with no cycle in flight: `submit` will take the next cycle."""
        req = self._running.get(request_id)
        return req is not None and not req.in_prefill and req.pending is None

    def tokens(self, request_id: str) -> list[int]:
        return list(self._running[request_id].tokens)

    def num_tokens(self, request_id: str) -> int:
        """Committed tokens of a running request (no copy)."""
        return len(self._running[request_id].tokens)

    def params(self, request_id: str) -> SamplingParams:
        return self._running[request_id].params

    def num_emitted(self, request_id: str) -> int:
        """Tokens committed since the request's (re-)prefill, its first token included: what `params.max_tokens`
        counts."""
        req = self._running[request_id]
        return len(req.tokens) - req.prompt_len

    def has_work(self) -> bool:
        return bool(self._waiting) or any(r.in_prefill or r.pending is not None for r in self._running.values())

    def queued_cycles(self) -> list[str] | None:
        """Requests with a cycle queued for the next step; None while a prefill is waiting or under way."""
        if self._waiting or any(r.in_prefill for r in self._running.values()):
            return None
        return [r.request_id for r in self._running.values() if r.pending is not None]

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # ---- the step loop ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        items = self._schedule()
        self.last_batch_tokens = sum(len(it.new_tokens) for it in items)
        if not items:
            return []
        logits, features = self._execute(items)
        return self._update(items, logits, features)

    def _schedule(self) -> list[WorkItem]:
        while self._waiting and self.cache.has_free_slot():
            req = self._waiting.popleft()
            self.cache.allocate(req.request_id)
            self._running[req.request_id] = req
            self._share_prefix(req)
        items = []
        for req in self._running.values():
            if req.pending is not None:
                start = len(req.tokens) - 1
                items.append(WorkItem(req, [req.tokens[-1], *req.pending.tokens], start, req.pending))
        budget = self.config.max_batch_tokens - sum(len(it.new_tokens) for it in items)
        for req in self._running.values():
            if req.in_prefill and budget > 0:
                chunk = req.tokens[req.prefilled : min(req.prompt_len, req.prefilled + budget)]
                items.append(WorkItem(req, chunk, req.prefilled, None))
                budget -= len(chunk)
        return items

    def _share_prefix(self, req: EngineRequest) -> None:
        """Copy the sibling's cached prompt but its last position, when it is usable: running, past that
        point of its prefill, with the same tokens there. The last prompt position is computed here, so the
        first token is sampled from this request's own step with its own generator; whether a prefix is
        shared never depends on anything the output could (only on the prompt and the sibling's state)."""
        shared = req.prompt_len - 1
        src = self._running.get(req.share_from) if req.share_from else None
        if req.resumed or shared < 1 or src is None or src.prefilled < shared:
            return
        if src.tokens[:shared] != req.tokens[:shared]:
            return
        self.cache.copy_prefix(src.request_id, req.request_id, shared)
        req.prefilled = shared

    def _execute(self, items: list[WorkItem]) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids, positions, logit_rows = [], [], []
        layout = RaggedLayout(slots=[], starts=[], lens=[])
        for it in items:
            slot, start = self.cache.append(it.request.request_id, len(it.new_tokens))
            layout.slots.append(slot)
            layout.starts.append(start)
            layout.lens.append(len(it.new_tokens))
            row0 = len(ids)
            ids.extend(it.new_tokens)
            positions.extend(range(start, start + len(it.new_tokens)))
            wanted = logit_positions(it)
            if wanted:
                it.logit_offset = len(logit_rows)
                logit_rows.extend(row0 + k for k in wanted)
        dev = self.model.device
        out = self._forward(
            torch.tensor(ids, device=dev),
            torch.tensor(positions, device=dev),
            layout,
            self.cache.k,
            self.cache.v,
            torch.tensor(logit_rows, dtype=torch.long, device=dev),
        )
        return out.logits, out.features

    def _update(self, items: list[WorkItem], logits: torch.Tensor, features: torch.Tensor | None) -> list[StepOutput]:
        raw = logits  # logprobs are of the raw distribution (vLLM's raw_logprobs)
        logits = grammar_masks(items, processors.apply(logits, row_contexts(items)), raw)  # [M, V]
        argmax, probs = self._target_choices(items, logits)
        outputs, row = [], 0
        for it in items:
            feats = None if features is None else features[row : row + len(it.new_tokens)]
            row += len(it.new_tokens)
            if it.draft is None:
                outputs.append(self._finish_prefill_chunk(it, probs, argmax, feats))
            else:
                outputs.append(self._finish_verify(it, probs, argmax, feats))
            add_logprobs(it, outputs[-1], raw)
        return outputs

    def _target_choices(self, items: list[WorkItem], logits: torch.Tensor) -> tuple[list[int], SampledProbs | None]:
        """Greedy rows' argmax (-1 at the others) and the distributions of the rows that sample: neither is
        computed for rows that do not read it, which on a 262,144-token vocabulary was most of a batched step.
        Each row is computed on its own, so its result is the same bits whatever rows share its step."""
        params, rows, greedy, first, row = [], [], [], {}, 0
        for it in items:
            n = len(logit_positions(it))
            if n and it.request.params.greedy:
                greedy.extend(range(row, row + n))
            elif n:
                first[row] = len(rows)
                rows.extend(range(row, row + n))
                params.extend([it.request.params] * n)
            row += n
        dev = logits.device
        argmax = [-1] * row
        if greedy:
            picked = logits if len(greedy) == row else logits[torch.tensor(greedy, device=dev)]
            for r, token in zip(greedy, picked.argmax(-1).tolist(), strict=True):
                argmax[r] = token
        if not rows:
            return argmax, None
        sampled = logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows, device=dev)]
        probs = logits_to_probs(
            sampled,
            torch.tensor([p.temperature for p in params], device=dev),
            torch.tensor([p.top_k for p in params], device=dev),
            torch.tensor([p.top_p for p in params], device=dev),
            torch.tensor([p.min_p for p in params], device=dev),
            torch.tensor([p.typical_p for p in params], device=dev),
        )
        return argmax, SampledProbs(probs, first)

    def _finish_prefill_chunk(self, it: WorkItem, probs, argmax, feats) -> StepOutput:
        req = it.request
        req.prefilled += len(it.new_tokens)
        out = StepOutput(req.request_id, emitted=[], feature_start=it.start, features=feats)
        if samples_first(it):
            r = first_token_row(it)
            token = argmax[r] if req.params.greedy else int(sample(probs.rows(it, r, r + 1), req.generator)[0])
            req.tokens.append(token)
            if req.grammar is not None:
                req.grammar.commit([token])
            out.emitted, out.kind = [token], OutcomeKind.FIRST
        elif req.resumed and not req.in_prefill:
            out.kind = OutcomeKind.FIRST  # ready to verify from the given anchor; nothing new emitted
        return out

    def _finish_verify(self, it: WorkItem, probs, argmax, feats) -> StepOutput:
        req, draft = it.request, it.draft
        rows = slice(it.logit_offset, it.logit_offset + len(draft) + 1)
        if req.params.greedy:
            accepted, token, kind = accept_greedy(argmax[rows], draft.tokens)
        else:
            p = probs.rows(it, rows.start, rows.stop)  # [ℓ+1, V]
            q = draft_q(draft, p.shape[-1], p.device)
            accepted, token, kind = accept_stochastic(p, draft.tokens, q, req.generator)
        emitted = [*draft.tokens[:accepted], token]
        # Keep the anchor and the accepted drafts; the new anchor `token` is not cached yet.
        self.cache.truncate(req.request_id, it.start + 1 + accepted)
        req.tokens.extend(emitted)
        if req.grammar is not None:
            req.grammar.commit(emitted)
        req.pending = None
        return StepOutput(
            req.request_id,
            emitted=emitted,
            num_drafts=len(draft),
            num_accepted=accepted,
            kind=kind,
            feature_start=it.start,
            features=None if feats is None else feats[: accepted + 1],
        )

    # ---- validation ---------------------------------------------------------------------------
    def _check_vocab(self, ids: list[int], what: str) -> None:
        vocab = self.model.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"{what} token id {bad} outside the vocabulary [0, {vocab})")

    def _check_draft(self, draft: DraftBlock) -> None:
        self._check_vocab(draft.tokens, "draft")
        if draft.q_ids is None or not draft.tokens:
            return
        n = len(draft)
        if draft.q_probs is None or draft.q_ids.shape != draft.q_probs.shape or draft.q_ids.shape[0] != n:
            raise InvalidRequestError(f"sparse q must be two [{n}, K] tensors (ids, probs)")
        tokens = torch.tensor(draft.tokens, dtype=draft.q_ids.dtype)[:, None]
        q_of_token = torch.where(draft.q_ids == tokens, draft.q_probs, 0.0).sum(-1)  # [ℓ]
        if bool((q_of_token <= 0).any()):
            raise InvalidRequestError("a draft token lies outside its own q support (q(x) must be > 0)")


@dataclass(slots=True)
class SampledProbs:
    """fp32 target distributions of the sampling items' logits rows only ([R, V]), addressed by logits row."""

    probs: torch.Tensor  # [R, V]
    first: dict[int, int]  # an item's first logits row → its first row here (an item's rows are contiguous)

    def rows(self, it: WorkItem, start: int, stop: int) -> torch.Tensor:
        """Logits rows [start, stop) of item `it`, all of them its own."""
        base = it.logit_offset
        i = self.first[base] + start - base
        return self.probs[i : i + stop - start]
