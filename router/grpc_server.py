"""gRPC front of the router: `dspark.v1.Router.Generate` streams one chunk per cycle to gRPC clients."""

from __future__ import annotations

import contextlib
import uuid

import grpc

from protos import codec
from protos.dspark.v1 import dspark_pb2 as pb
from protos.dspark.v1 import dspark_pb2_grpc as rpc
from protos.status import abort_with
from router.router import Router
from router.session import RouterRequest
from services.errors import InvalidRequestError
from services.tokenizer import TextTokenizer


class RouterServicer(rpc.RouterServicer):
    def __init__(self, router: Router, tokenizer: TextTokenizer, max_model_len: int):
        self.router, self.tokenizer, self.max_model_len = router, tokenizer, max_model_len

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            req = self._request(request)
            self.router.speculation(req.speculative)
            self.router.check_capacity()
        except Exception as error:
            await abort_with(context, error)
        try:
            async with contextlib.aclosing(self.router.generate(req)) as chunks:
                async for c in chunks:
                    yield pb.GenerateChunk(request_id=req.request_id, token_ids=c.token_ids, text=c.text,
                                           finish_reason=str(c.finish_reason or ""), prompt_tokens=c.prompt_tokens,
                                           completion_tokens=c.completion_tokens, cycle=c.cycle)
        except Exception as error:
            await abort_with(context, error)

    def _request(self, msg: pb.GenerateRequest) -> RouterRequest:
        if bool(msg.prompt_ids) == bool(msg.prompt):
            raise InvalidRequestError("give exactly one of prompt_ids and prompt")
        ids = list(msg.prompt_ids) or self.tokenizer.encode(msg.prompt)
        if any(t >= self.tokenizer.vocab_size for t in ids):
            raise InvalidRequestError(f"prompt token ids must lie in [0, {self.tokenizer.vocab_size})")
        params = codec.params_from_pb(msg.params)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                                      f"context of {self.max_model_len} tokens")
        s = msg.speculative
        spec = {k: v for k, v in (("method", s.method), ("policy", s.policy), ("gamma", s.gamma),
                                  ("min_tokens_per_s", s.min_tokens_per_s)) if v} or None
        eos = () if msg.ignore_eos else tuple(self.tokenizer.eos_token_ids)
        return RouterRequest(ids, params, msg.request_id or uuid.uuid4().hex, tuple(msg.stop),
                             (*eos, *msg.stop_token_ids), spec)
