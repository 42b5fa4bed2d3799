"""n samples of one prompt with one shared prefill, against n independent requests of the same prompt.

One run, alternating rounds, the shipped target in this process behind the router core (`Router` over a
`VerifierService`, plain decoding, T = 1, seeds 0..n-1): arm `shared` sends the n requests as one prompt's
samples (`PrefixShare`: the first prefills, the others copy its cached prompt); arm `independent` sends the
same n requests without it. Reported: prompt positions the engine computed, time to every sample's first
token, and time to the last token, as ratios shared / independent.

    python benchmarks/samples.py [--n 4] [--prompt-tokens 480] [--max-tokens 32] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from benchmarks.harness import cpu_model
from router.router import Router
from router.session import PrefixShare, RouterRequest
from services.types import SamplingParams
from verifier_worker.main import verifier_service
from verifier_worker.service import LocalVerifier
from verifier_worker.settings import VerifierSettings


async def _arm(service, n: int, prompt: list[int], max_tokens: int, shared: bool, tag: str) -> dict:
    counting = _Counting(service)
    router = Router(counting, None, set())
    share = PrefixShare(f"{tag}0") if shared else None
    reqs = [RouterRequest(prompt, SamplingParams(temperature=1.0, seed=j, max_tokens=max_tokens), f"{tag}{j}",
                          prefix=share) for j in range(n)]
    started = time.perf_counter()
    firsts: list[float] = []

    async def run(req: RouterRequest) -> None:
        async for chunk in router.generate(req):
            if chunk.token_ids and len(firsts) < n and chunk.cycle == 0:
                firsts.append(time.perf_counter() - started)

    await asyncio.gather(*(run(r) for r in reqs))
    return {"ttft_all_s": max(firsts), "total_s": time.perf_counter() - started,
            "prompt_positions": counting.positions}


class _Counting:
    """The in-process verifier tier, counting the prompt positions its prefills computed."""

    def __init__(self, service):
        self.inner, self.positions = LocalVerifier(service), 0

    async def prefill(self, call):
        done = await self.inner.prefill(call)
        self.positions += len(call.prompt_ids) - done.feature_start
        return done

    def __getattr__(self, name):
        return getattr(self.inner, name)


async def main_async(args) -> dict:
    torch.set_num_threads(args.threads)
    service = verifier_service(VerifierSettings(threads=args.threads, num_slots=args.n, max_len=1024,
                                                max_batch_tokens=512, profile=False))
    await service.start()
    vocab = service.engine.model.config.vocab_size
    prompt = torch.randint(3, vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    runs: dict[str, list[dict]] = {"shared": [], "independent": []}
    for r in range(args.rounds + 1):  # round 0 warms up
        for arm in ("shared", "independent") if r % 2 else ("independent", "shared"):
            out = await _arm(service, args.n, prompt, args.max_tokens, arm == "shared", f"{arm}{r}-")
            if r:
                runs[arm].append(out)
    await service.stop()
    med = {arm: {k: statistics.median(o[k] for o in outs) for k in outs[0]} for arm, outs in runs.items()}
    ratios = {k: med["shared"][k] / med["independent"][k] for k in med["shared"]}
    return {"cpu": cpu_model(), "n": args.n, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
            "rounds": args.rounds, "median": med, "shared_over_independent": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=480)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
