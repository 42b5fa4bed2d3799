"""Shared fixtures: tiny random fp32 models built by the tests themselves."""

from __future__ import annotations

import os
import secrets

import pytest
import torch

from cluster.ray_local import AUTH_ENV, use_loopback
from services.layers import RaggedLayout
from services.model import CausalLM, ForwardOutput
from training.data.build import DataConfig, build
from training.tiny_model import random_model, tiny_config
from verifier_worker.engine import Engine, EngineConfig
from verifier_worker.kv_cache import KVCache

VOCAB = 96

# Ray in tests: every node on 127.0.0.1 (set before anything imports ray), token authentication on purpose.
use_loopback()
os.environ.setdefault(AUTH_ENV, "token")
# ... and a token for it. Only a new local `ray.init()` writes ~/.ray/auth_token; the head of a
# `ray.cluster_utils.Cluster` does not, so on a machine that never ran Ray its GCS aborts at start ("couldn't find
# an authentication token") and the driver reports a 30 s timeout waiting for the GCS port file. That was the
# fresh-machine failure of tests/test_ray_pools.py (a rerun passed only because test_serve_app's ray.init had
# written the token by then). One token per test session, inherited by every Ray process the tests start.
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))

# `make test` runs the suite on parallel workers (pytest-xdist), then the tests marked `alone` by themselves: those
# that start a Ray cluster (a second local `ray.init` on one machine joins the first one's cluster), time faults across
# hosts, or load the machine on purpose (the soak). Each worker keeps to one torch thread, or the workers' thread
# pools would contend for the cores; one worker more than cores keeps them busy while a worker waits on a tier
# process or a socket (on the 2-vCPU EPYC here: 459 s for that part on three workers, 487 s on two).
ALONE = {"test_gpu_placement.py", "test_multihost.py", "test_ray_pools.py", "test_serve_app.py", "test_soak.py"}
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in ALONE:
            item.add_marker(pytest.mark.alone)


def pytest_ignore_collect(collection_path, config):
    # Either phase of `make test` leaves the other phase's files unimported: collecting the whole suite to
    # deselect all but the `alone` files cost that phase about 15 s here (torch, transformers, openai,
    # hypothesis and every test module imported for nothing).
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    phase = config.getoption("markexpr")
    if phase == "alone" and collection_path.name not in ALONE:
        return True
    if phase == "not alone" and collection_path.name in ALONE:
        return True
    return None


def pytest_sessionstart(session):
    # The CPU kernels are built (or found in torch's cache) before any test starts a tier process, so no
    # process start waits for the build (services/cpu_kernels.py).
    from services import cpu_kernels
    cpu_kernels.build()


def unique_graphs() -> int:
    """How many graphs torch.compile has built in this process. torch._dynamo loads on use: importing it cost 2.25 s
    of each pytest-xdist worker's collection, and only the compile tests read it."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(1234)


def make_model(vocab: int = VOCAB, layers: int = 2, hidden: int = 64, seed: int = 0,
               taps: tuple[int, ...] = ()) -> CausalLM:
    # std 0.15 gives peaked, repetitive greedy output: drafts get accepted often, so the
    # accept, reject and bonus paths all run.
    model = random_model(tiny_config(vocab, eos_id=0, layers=layers, hidden=hidden), seed=seed, std=0.15)
    model = model.float()
    model.tap_layers = taps
    return model


@pytest.fixture(scope="session")
def tiny_model() -> CausalLM:
    return make_model(taps=(0, 1))


def make_engine(model: CausalLM, **kw) -> Engine:
    defaults = {"num_slots": 4, "max_len": 160, "max_batch_tokens": 24}
    return Engine(model, EngineConfig(**{**defaults, **kw}))


async def started_verifier(model: CausalLM):
    """A started in-process VerifierService over `model` with room for 256 batch tokens and no batch window."""
    from verifier_worker.service import VerifierService

    service = VerifierService(make_engine(model, max_batch_tokens=256), batch_window_s=0.0)
    await service.start()
    return service


def random_prompts(n: int, vocab: int = VOCAB, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (3 + 9 * i,), generator=g).tolist() for i in range(n)]


def build_small_corpus(root) -> dict:
    """A quick corpus build: 60 documents per file-backed source, 200 math problems, small vocabulary."""
    cfg = DataConfig(out_dir=root / "data", eval_dir=root / "eval", limit=60, math_problems=200, eval_prompts=20,
                     vocab_size=1024)
    return build(cfg) | {"root": root}


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> dict:
    return build_small_corpus(tmp_path_factory.mktemp("corpus"))


@torch.no_grad()
def full_forward(model: CausalLM, tokens: list[int] | torch.Tensor) -> ForwardOutput:
    """One cached forward over a whole sequence from position 0, logits and features at every row."""
    ids = torch.as_tensor(tokens).tolist()
    return _cached_forward(model, [ids], torch.arange(len(ids)))


@torch.no_grad()
def next_token_logits(model: CausalLM, prefixes: list[list[int]]) -> torch.Tensor:
    """[B, V]: the logits after each prefix, in one batched forward that computes the vocabulary head at the B last
    rows only (a real model's head is most of its forward when every row pays for it)."""
    return _cached_forward(model, prefixes, torch.tensor([len(p) for p in prefixes]).cumsum(0) - 1).logits


def _cached_forward(model: CausalLM, sequences: list[list[int]], rows: torch.Tensor) -> ForwardOutput:
    """The sequences from position 0, each in its own cache slot, in one ragged forward; logits at `rows`."""
    lens = [len(p) for p in sequences]
    cache = KVCache(model.config, len(sequences), max(lens), model.dtype, model.device)
    slots = [cache.allocate(str(i)) for i in range(len(sequences))]
    for i, n in enumerate(lens):
        cache.append(str(i), n)
    ids = torch.tensor([t for p in sequences for t in p], dtype=torch.long)
    pos = torch.cat([torch.arange(n) for n in lens])
    return model(ids, pos, RaggedLayout(slots, [0] * len(sequences), lens), cache.k, cache.v, rows)
