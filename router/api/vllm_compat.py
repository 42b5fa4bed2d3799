"""What vLLM's and SGLang's clients read besides the OpenAI routes: vLLM-shaped `/tokenize` and `/detokenize`,
SGLang's `/server_info` (the speculative settings and the mean acceptance length), behind the API key like /v1.

The counts match what the server feeds the model: `/tokenize` adds the BOS token the server adds (a client's
own tokenizer may not), so a client can size prompts against `max_model_len` exactly.
"""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import Field

from router.api.errors import ApiError, documented
from router.api.openai import ChatMessage, TokenId, TokenizedText, _Body
from router.router import Router
from services.errors import InvalidRequestError
from services.tokenizer import TextTokenizer

ROUTES = ("/tokenize", "/detokenize", "/server_info")  # guarded by the API key, as /v1 is


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: TokenizedText | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)


class TokenizeResponse(_Body):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Body):
    prompt: str


def add_routes(app: FastAPI, router: Router, tokenizer: TextTokenizer, model: str, max_model_len: int) -> None:
    def check(name: str | None) -> None:
        if name is not None and name != model:
            raise ApiError(400, f"model {name!r} does not exist; this server serves {model!r}", "model",
                           "model_not_found")

    @app.post("/tokenize", response_model=TokenizeResponse, responses=documented(400, 401, 413))
    async def tokenize(body: TokenizeRequest):
        check(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give prompt or messages", "prompt")
        if body.messages is None:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:  # what the chat route feeds the model (the template's own BOS kept)
            try:
                ids = tokenizer.chat_ids([m.as_turn() for m in body.messages], body.add_generation_prompt)
            except InvalidRequestError as e:
                raise ApiError(400, str(e), "messages") from e
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=documented(400, 401, 413))
    async def detokenize(body: DetokenizeRequest):
        check(body.model)
        if any(t >= tokenizer.vocab_size for t in body.tokens):
            raise ApiError(400, f"token ids must lie in [0, {tokenizer.vocab_size})", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/server_info", responses=documented(401))
    async def server_info() -> dict[str, object]:
        spec = router.config.default
        drafts, accepted = router.metrics.totals()
        return {"model_path": model, "served_model_name": model, "max_model_len": max_model_len,
                "speculative_algorithm": spec.method, "speculative_policy": str(spec.policy),
                "speculative_num_draft_tokens": spec.gamma + 1, "speculative_methods": sorted(router.methods),
                "avg_spec_accept_length": round(1 + accepted / drafts, 4) if drafts else None}
