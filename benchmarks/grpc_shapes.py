"""gRPC shape benchmark: per-message cost of one long-lived bidi stream against unary calls (grpc.aio, loopback).

The wire contract carries each request's cycles on one bidirectional stream (Verifier.Verify, Drafter.Draft)
because cancelling the stream is how a tier learns that a client went away and frees its KV slot or draft
context. gRPC's performance guide warns that in gRPC Python streaming RPCs are much slower than unary ones
(they create extra threads to receive and send messages; it suggests asyncio may do better), so this
measures what the stream costs per cycle on grpc.aio before we build on it.

Shapes, each for --messages round trips over 127.0.0.1 after a warm-up:
  unary      one unary call per message on one reused channel
  bidi       one stream, ping-pong: write a request, read its reply
  unary x8   8 coroutines, each making sequential unary calls on the shared channel
  bidi x8    8 coroutines, one ping-pong stream each, on the shared channel

Payloads are real dspark.v1 messages, serialized once and sent as bytes through generic handlers (no extra
.proto): "spec" is a VerifyRequest with 7 drafts and a sparse q (width 64, fp32) answered by a VerifyReply
with 8 tokens and bf16 features [8, 768] (12 KB); "greedy" has 7 drafts without q and features [1, 768].
The server runs in its own process so that its event loop does not share the client's GIL. Measurement is
interleaved in rounds over all shapes so a slow spell on a noisy VM hits them alike.

    python benchmarks/grpc_shapes.py [--messages 2000] [--json benchmarks/results/grpc-shapes-cpu.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import time

import google.protobuf
import grpc
import numpy as np
from rich.console import Console
from rich.table import Table

from protos.dspark.v1 import dspark_pb2 as pb

SERVICE = "bench.Shapes"
WARMUP = 200
ROUNDS = 4  # chunks per shape, interleaved across shapes
CONCURRENCY = 8
VOCAB = 151_936  # a Qwen-size vocabulary, so token ids take realistic varint widths
HIDDEN = 768
SHAPES = [("unary", 1), ("bidi", 1), ("unary", CONCURRENCY), ("bidi", CONCURRENCY)]


def payloads() -> dict[str, tuple[bytes, bytes]]:
    """(request, reply) bytes per case, as the router and the verifier put them on the wire."""
    rng = np.random.default_rng(0)
    drafts = rng.integers(0, VOCAB, 7).tolist()
    trace = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    probs = rng.random((7, 64), dtype=np.float32)
    q = pb.SparseQ(width=64, token_ids=rng.integers(0, VOCAB, 7 * 64).tolist(),
                   probs=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[7, 64],
                                   data=(probs / probs.sum(1, keepdims=True)).tobytes()))
    cases = {}
    for case, draft, rows in [("spec", pb.DraftBlock(tokens=drafts, q=q, confidences=[0.9] * 7), 8),
                              ("greedy", pb.DraftBlock(tokens=drafts), 1)]:
        req = pb.VerifyRequest(request_id="req-000042", cycle=17, draft=draft,
                               feature_dtype=pb.DTYPE_BFLOAT16, traceparent=trace)
        # Feature content does not matter to protobuf (bytes are copied as is), only its size does.
        features = pb.Tensor(dtype=pb.DTYPE_BFLOAT16, shape=[rows, HIDDEN], data=rng.bytes(rows * HIDDEN * 2))
        reply = pb.VerifyReply(request_id="req-000042", cycle=17, emitted=[*drafts[:rows - 1], 7], num_drafts=7,
                               num_accepted=rows - 1,
                               outcome=pb.OUTCOME_BONUS if rows == 8 else pb.OUTCOME_RECOVERED,
                               feature_start=300, features=features, committed=300 + rows)
        cases[case] = (req.SerializeToString(), reply.SerializeToString())
    return cases


def serve(replies: dict[str, bytes], port_pipe) -> None:
    """Server process: for each case, a unary and a bidi method that answer every request with its reply."""

    def unary(reply):
        async def handle(request, context):
            return reply
        return grpc.unary_unary_rpc_method_handler(handle)

    def stream(reply):
        async def handle(requests, context):
            async for _ in requests:
                yield reply
        return grpc.stream_stream_rpc_method_handler(handle)

    async def main():
        handlers = {}
        for case, reply in replies.items():
            handlers[f"unary_{case}"] = unary(reply)
            handlers[f"bidi_{case}"] = stream(reply)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
        port_pipe.send(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def split(n: int, k: int) -> list[int]:
    """n as k near-equal parts, so any --messages works."""
    return [n // k + (i < n % k) for i in range(k)]


async def unary_worker(call, request: bytes, n: int, lat: list[int]) -> None:
    for _ in range(n):
        t0 = time.perf_counter_ns()
        await call(request)
        lat.append(time.perf_counter_ns() - t0)


async def bidi_worker(call, request: bytes, n: int, lat: list[int]) -> None:
    stream = call()  # opened by the first write, so the first round trip pays for it as a session's would
    for _ in range(n):
        t0 = time.perf_counter_ns()
        await stream.write(request)
        await stream.read()
        lat.append(time.perf_counter_ns() - t0)
    await stream.done_writing()
    if await stream.code() != grpc.StatusCode.OK:
        raise RuntimeError(f"stream ended with {await stream.code()}")


async def run_chunk(channel, case, shape, conc, request, n, lat) -> float:
    """Run n round trips split over conc coroutines; the seconds it took."""
    # Bytes in, bytes out: no serializers, the payloads are serialized already.
    if shape == "unary":
        call, worker = channel.unary_unary(f"/{SERVICE}/unary_{case}"), unary_worker
    else:
        call, worker = channel.stream_stream(f"/{SERVICE}/bidi_{case}"), bidi_worker
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(call, request, k, lat) for k in split(n, conc)))
    return time.perf_counter() - t0


async def measure(port: int, cases: dict[str, tuple[bytes, bytes]], messages: int) -> list[dict]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await channel.unary_unary(f"/{SERVICE}/unary_spec")(cases["spec"][0])
        if reply != cases["spec"][1]:
            raise RuntimeError("server answered with an unexpected payload")
        lat = {(c, s, k): [] for c in cases for s, k in SHAPES}
        secs = dict.fromkeys(lat, 0.0)
        for case, shape, conc in lat:
            await run_chunk(channel, case, shape, conc, cases[case][0], WARMUP, [])
        for n in split(messages, ROUNDS):
            for (case, shape, conc), samples in lat.items():
                secs[case, shape, conc] += await run_chunk(channel, case, shape, conc, cases[case][0], n, samples)
    rows = []
    for (case, shape, conc), samples in lat.items():
        us = np.array(samples) / 1000
        rows.append({"payload": case, "shape": shape, "concurrency": conc, "messages": len(samples),
                     "request_bytes": len(cases[case][0]), "reply_bytes": len(cases[case][1]),
                     "p50_us": round(float(np.percentile(us, 50)), 1),
                     "p99_us": round(float(np.percentile(us, 99)), 1),
                     "msgs_per_s": round(len(samples) / secs[case, shape, conc], 1)})
    for row in rows:  # throughput against unary at the same payload and concurrency
        base = next(r for r in rows if (r["payload"], r["shape"], r["concurrency"]) ==
                    (row["payload"], "unary", row["concurrency"]))
        row["vs_unary"] = round(row["msgs_per_s"] / base["msgs_per_s"], 2)
    return rows


def print_table(rows: list[dict]) -> None:
    table = Table(title="gRPC shapes, grpc.aio over 127.0.0.1 (per message round trip)")
    for name in ["payload", "req/reply B", "shape", "conc", "p50 µs", "p99 µs", "msg/s", "vs unary"]:
        table.add_column(name, justify="left" if name in ("payload", "shape") else "right")
    for r in rows:
        table.add_row(r["payload"], f"{r['request_bytes']}/{r['reply_bytes']}", r["shape"], str(r["concurrency"]),
                      f"{r['p50_us']:.0f}", f"{r['p99_us']:.0f}", f"{r['msgs_per_s']:.0f}", f"{r['vs_unary']:.2f}")
    Console().print(table)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=2000, help="measured round trips per shape and payload")
    p.add_argument("--json", default="benchmarks/results/grpc-shapes-cpu.json", help="write the results here")
    args = p.parse_args()
    if args.messages < ROUNDS * CONCURRENCY:
        p.error(f"--messages must be at least {ROUNDS * CONCURRENCY}")

    cases = payloads()
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    server = ctx.Process(target=serve, args=({c: rep for c, (_, rep) in cases.items()}, send), daemon=True)
    server.start()
    try:
        if not recv.poll(30):
            raise RuntimeError("server process did not report its port")
        rows = asyncio.run(measure(recv.recv(), cases, args.messages))
    finally:
        server.terminate()
        server.join()

    print_table(rows)
    machine = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
               "loadavg_1m": round(os.getloadavg()[0], 2), "grpc": grpc.__version__,
               "protobuf": google.protobuf.__version__}
    with open(args.json, "w") as f:
        json.dump({"machine": machine, "messages": args.messages, "warmup": WARMUP, "rounds": ROUNDS,
                   "results": rows}, f, indent=2)
        f.write("\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
