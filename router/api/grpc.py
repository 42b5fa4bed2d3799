"""gRPC front of the router: `dspark.v1.Router.Generate` streams one chunk per cycle to gRPC clients."""

from __future__ import annotations

import contextlib
import dataclasses

import grpc

from protos import codec, validate
from protos.dspark.v1 import dspark_pb2 as pb
from protos.dspark.v1 import dspark_pb2_grpc as rpc
from protos.status import abort_with
from protos.validate import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from router.api.admission import Admission
from router.router import Router
from router.session import RouterRequest
from services.errors import InvalidRequestError
from services.tokenizer import TextTokenizer


class RouterServicer(rpc.RouterServicer):
    def __init__(self, router: Router, tokenizer: TextTokenizer, max_model_len: int):
        self.router, self.admit = router, Admission(router, tokenizer, max_model_len)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            req = self._request(request)
        except Exception as error:
            await abort_with(context, error)
        client_id = request.request_id or req.request_id
        try:
            async with contextlib.aclosing(self.router.generate(req)) as chunks:
                async for c in chunks:
                    yield pb.GenerateChunk(request_id=client_id, token_ids=c.token_ids, text=c.text,
                                           finish_reason=str(c.finish_reason or ""), prompt_tokens=c.prompt_tokens,
                                           completion_tokens=c.completion_tokens, cycle=c.cycle,
                                           logprobs=codec.logprobs_to_pb(c.logprobs))
        except Exception as error:
            await abort_with(context, error)

    def _request(self, msg: pb.GenerateRequest) -> RouterRequest:
        if bool(msg.prompt_ids) == bool(msg.prompt):
            raise InvalidRequestError("give exactly one of prompt_ids and prompt")
        ids = self.admit.token_ids(msg.prompt_ids, "prompt") or self.admit.encode(msg.prompt, "prompt")
        params = validate.params(msg.params)
        # The one length rule: no max_tokens (0 on the wire) asks for the rest of the context, as over HTTP.
        wanted = msg.params.max_tokens or None
        params = dataclasses.replace(params, max_tokens=self.admit.max_tokens(wanted, len(ids), "prompt"))
        s = msg.speculative
        spec = {k: v for k, v in (("method", s.method), ("policy", s.policy), ("gamma", s.gamma),
                                  ("min_tokens_per_s", s.min_tokens_per_s)) if v}
        if s.HasField("ahead"):
            spec["ahead"] = s.ahead
        spec = spec or None
        if len(msg.stop) > MAX_STOP_STRINGS or not all(msg.stop):
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} non-empty stop strings")
        if len(msg.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
        return self.admit(ids, params, msg.request_id, tuple(msg.stop), msg.stop_token_ids, msg.ignore_eos, spec)
