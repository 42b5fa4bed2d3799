"""An OpenAI body → the router requests that serve it: one per prompt and sample, all checked before any runs.

A completions batch gives each prompt its choices in order; `n` (or `best_of`) samples of a prompt follow
vLLM's rules: sample j draws with seed + j when a seed is given, and the samples share one prefill (the first
prefills, the others copy its cached prompt on its replica: `router.session.PrefixShare`).
"""

from __future__ import annotations

import dataclasses

from router.api.admission import Admission
from router.api.errors import ApiError
from router.api.openai import MAX_BATCH, ChatCompletionRequest, CompletionRequest
from router.api.tools import ToolUse, family_of
from router.router import Router
from router.session import PrefixShare, RouterRequest
from services.tokenizer import TextTokenizer


class HttpAdmission:
    def __init__(self, router: Router, tokenizer: TextTokenizer, model: str, max_model_len: int):
        self.model, self.admit = model, Admission(router, tokenizer, max_model_len)

    def __call__(self, body: CompletionRequest | ChatCompletionRequest, request_id: str) -> list[list[RouterRequest]]:
        """Per prompt, its samples' router requests (ids `{id}`, `{id}-{i}` in a batch, `-{j}` per sample)."""
        if body.model != self.model:
            raise ApiError(400, f"model {body.model!r} does not exist; this server serves {self.model!r}",
                           "model", "model_not_found")
        use = self.tool_use(body)
        prompts = self._prompts(body, use)
        samples = body.samples()
        if len(prompts) * samples > MAX_BATCH:
            raise ApiError(400, f"{len(prompts)} prompts × {samples} samples: at most {MAX_BATCH} choices per "
                           "request", "n")
        spec = body.speculative.model_dump(exclude_none=True) if body.speculative else None
        forced = None if use is None else use.grammar()  # a call is required: the reply is masked to one
        bad_words = self.admit.bad_words(body.bad_words) if body.bad_words else ()
        groups = []
        for i, prompt_ids in enumerate(prompts):
            max_tokens = self.admit.max_tokens(body.wanted_tokens(), len(prompt_ids), body.prompt_param)
            params = body.sampling(max_tokens)
            if forced is not None:
                params = dataclasses.replace(params, grammar=forced)
            if bad_words:
                params = dataclasses.replace(params, bad_words=bad_words)
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            group = []
            for j in range(samples):
                seeded = params if params.seed is None else dataclasses.replace(params, seed=params.seed + j)
                group.append(self.admit(prompt_ids, seeded, rid if samples == 1 else f"{rid}-{j}", body.stops(),
                                        body.stop_token_ids or [], body.ignore_eos, spec,
                                        body.include_stop_str_in_output, body.skip_special_tokens))
            if samples > 1:
                share = PrefixShare(group[0].request_id)
                for req in group:
                    req.prefix = share
            groups.append(group)
        return groups

    def tool_use(self, body: CompletionRequest | ChatCompletionRequest) -> ToolUse | None:
        """The chat request's tools in the model's family (router/api/tools.py); None without tools or with
        tool_choice none."""
        if not isinstance(body, ChatCompletionRequest) or body.tool_mode() == "none":
            return None
        return ToolUse(list(body.tools), family_of(self.admit.tokenizer.chat_template), body.tool_mode(),
                       body.parallel_tool_calls)

    def _prompts(self, body: CompletionRequest | ChatCompletionRequest, use: ToolUse | None) -> list[list[int]]:
        """Each prompt's ids as the model sees them, cut to their last `truncate_prompt_tokens` (vLLM's rule)."""
        if isinstance(body, ChatCompletionRequest):
            family = family_of(self.admit.tokenizer.chat_template)
            turns = [m.as_turn(family) for m in body.messages]
            prompts = [self.admit.encode_chat(turns if use is None else use.offer(turns))]
        else:
            prompts = [self.admit.encode(p, "prompt", body.add_special_tokens) if isinstance(p, str)
                       else self.admit.token_ids(p, "prompt") for p in body.prompts()]
        keep = body.truncate_prompt_tokens
        if keep is None:
            return prompts
        keep = self.admit.max_model_len if keep == -1 else keep
        if keep == 0:
            raise ApiError(400, "truncate_prompt_tokens must be -1 or at least 1", "truncate_prompt_tokens")
        return [ids[-keep:] for ids in prompts]
