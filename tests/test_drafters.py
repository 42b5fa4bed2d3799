"""Draft models through the engine: greedy output equals plain greedy; block layout and context rules."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from drafter_worker.checkpoint import build_draft_model
from drafter_worker.config import DrafterConfig, HeadType, Method, default_config
from drafter_worker.drafter import Drafter
from in_process.generation import GenerationRequest, InProcessRouter
from router.scheduling.policy import Policy
from services.types import SamplingParams
from tests.conftest import VOCAB, make_engine, make_model, random_prompts

TAPS = (0, 1, 2)
MASK = VOCAB - 1


@pytest.fixture(scope="module")
def target():
    return make_model(layers=3, taps=TAPS)


def draft_model(target, method: str, head: str = "markov", seed: int = 0, mask: int = MASK):
    torch.manual_seed(seed)
    cfg = default_config(method, "tiny", TAPS, mask, head)
    model = build_draft_model(cfg, target)
    with torch.no_grad():  # random but not degenerate: the Markov projection starts at zero otherwise
        for p in model.parameters():
            if p.requires_grad and p.dim() >= 2:
                p.normal_(0.0, 0.2)
    return model.eval()


def requests(max_tokens: int = 30, temperature: float = 0.0) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", prompt, SamplingParams(temperature=temperature, max_tokens=max_tokens - 2 * i,
                                                              seed=i))
            for i, prompt in enumerate(random_prompts(5))]


@pytest.fixture(scope="module")
def plain(target):
    return InProcessRouter(make_engine(target), policy=Policy.NONE).generate(requests())


METHODS = [("mtp", "markov"), ("eagle3", "markov"), ("dflash", "markov"), ("dspark", "markov"),
           ("dspark", "gated"), ("dspark", "rnn")]


@pytest.mark.parametrize(("method", "head"), METHODS)
def test_greedy_through_engine_equals_plain(target, plain, method, head):
    drafter = Drafter(draft_model(target, method, head))
    # 3 slots for 5 requests of different lengths, prompts chunked: batched drafting of unequal contexts.
    engine = make_engine(target, num_slots=3, max_batch_tokens=10)
    gamma = 1 if method == "mtp" else 4
    spec = InProcessRouter(engine, drafter, Policy.FIXED, gamma).generate(requests())
    for s, p in zip(spec, plain, strict=True):
        assert s.token_ids == p.token_ids, f"{method}/{head} diverged on {s.request_id}"
    assert sum(r.draft_tokens for r in spec) > 0
    assert not drafter._contexts, "released sessions keep no draft context"


def test_sampled_drafts_come_with_their_q(target):
    drafter = Drafter(draft_model(target, "dspark"), max_q=8)
    engine = make_engine(target)
    blocks = []

    class Spy(Drafter):
        def propose(self, contexts, gamma, params=None):
            out = drafter.propose(contexts, gamma, params)
            blocks.extend(out.values())
            return out

        def commit(self, *args):
            drafter.commit(*args)

        def release(self, rid):
            drafter.release(rid)

    spy = Spy.__new__(Spy)
    InProcessRouter(engine, spy, Policy.FIXED, 3).generate(requests(12, temperature=1.0))
    sampled = [b for b in blocks if len(b)]
    assert sampled
    for block in sampled:
        assert block.q_ids.shape == (len(block), 8)
        assert torch.allclose(block.q_probs.sum(-1), torch.ones(len(block)))
        for k, token in enumerate(block.tokens):
            assert token in block.q_ids[k].tolist()  # x_k was drawn from q'_k
        assert all(0.0 < c < 1.0 for c in block.confidences)


def _context_taps(target, tokens):
    out = target.forward_dense(torch.tensor([tokens]))
    return out.features[0]  # [S, T*d]


@torch.no_grad()
def test_block_queries_never_see_context_at_or_after_the_anchor(target):
    model = draft_model(target, "dspark")
    tokens = random_prompts(3)[2]
    taps = _context_taps(target, tokens)[None]  # [1, S, T*d]
    s = taps.shape[1]
    anchor = 12
    positions = torch.arange(s)[None]
    mask = (torch.arange(s) < anchor)[None]

    def slots(t):
        kv = model.context_kv(t, positions)
        return model.backbone(torch.tensor([tokens[anchor]]), torch.tensor([anchor]), kv, mask, 5)

    base = slots(taps)
    later = taps.clone()
    later[:, anchor:] += torch.randn_like(later[:, anchor:])  # the anchor's own features and beyond
    assert torch.equal(slots(later), base)
    earlier = taps.clone()
    earlier[:, anchor - 1] += 1.0
    assert not torch.allclose(slots(earlier), base)


@pytest.mark.parametrize("method", ["dflash", "dspark", "eagle3"])
@torch.no_grad()
def test_incremental_drafting_matches_the_training_layout(target, method):
    """Drafts from per-cycle context commits equal the training-time forward over the whole sequence at the
    same anchor: slot k predicts anchor + k + 1 from context strictly before the anchor."""
    model = draft_model(target, method)
    drafter = Drafter(model)
    tokens = random_prompts(4)[3]  # 30 tokens
    taps = _context_taps(target, tokens)
    gamma, cut = 4, 10
    greedy = {"r": SamplingParams()}
    # commit features in two uneven chunks, drafting between them, as cycles do
    drafter.commit("r", 0, taps[:cut])
    drafter.propose({"r": tokens[: cut + 1]}, gamma, greedy)
    anchor = 20
    drafter.commit("r", cut, taps[cut:anchor])
    block = drafter.propose({"r": tokens[: anchor + 1]}, gamma, greedy)["r"]
    assert drafter.context_length("r") == anchor  # only context K/V persist: no block rows, no draft rows
    seq = torch.tensor(tokens[: anchor + 1] + block.tokens)  # the drafted continuation, teacher-forced
    full_taps = _context_taps(target, seq.tolist())[None]
    if model.dconfig.method.is_block:
        s = full_taps.shape[1]
        kv = model.context_kv(full_taps, torch.arange(s)[None])
        h = model.backbone(seq[anchor:anchor + 1], torch.tensor([anchor]), kv, (torch.arange(s) < anchor)[None],
                           gamma)
        logits, _ = model.teacher_forced(h, seq[anchor:anchor + gamma][None])
    else:
        outs = model.unrolled(full_taps, seq[None], gamma)
        logits = torch.stack([model.logits(outs[k][0, anchor - 1 + k]) for k in range(gamma)])[None]
    assert logits[0].argmax(-1).tolist() == block.tokens


def test_second_propose_is_unaffected_by_the_first(target):
    drafter = Drafter(draft_model(target, "dspark"))
    tokens = random_prompts(3)[2]
    drafter.commit("r", 0, _context_taps(target, tokens)[:15])
    first = drafter.propose({"r": tokens[:16]}, 5, {"r": SamplingParams()})["r"].tokens
    again = drafter.propose({"r": tokens[:16]}, 5, {"r": SamplingParams()})["r"].tokens
    assert first == again and len(first) == 5


def test_commit_out_of_order_is_refused(target):
    drafter = Drafter(draft_model(target, "dflash"))
    drafter.commit("r", 0, torch.zeros(4, 3 * target.config.hidden_size))
    with pytest.raises(ValueError, match="start at 6"):
        drafter.commit("r", 6, torch.zeros(2, 3 * target.config.hidden_size))


def test_config_rejects_inconsistent_settings():
    with pytest.raises(ValueError, match="block_size 1"):
        DrafterConfig(Method.MTP, "t", (1,), block_size=3)
    with pytest.raises(ValueError, match="mask_token_id"):
        DrafterConfig(Method.DFLASH, "t", (1,))
    with pytest.raises(ValueError, match="unknown drafter config keys"):
        DrafterConfig.from_dict({"method": "dflash", "target": "t", "tap_layers": [1], "typo": 1})
    cfg = DrafterConfig(Method.DSPARK, "t", (1,), mask_token_id=3, head="rnn", markov_rank=4)
    assert cfg.head is HeadType.RNN


def test_compiled_greedy_blocks_draft_what_eager_drafts(target, plain):
    """`Drafter(compile=True)`: the greedy block in one compiled graph proposes the eager drafter's tokens
    (fp32, the same cycles and acceptances) and the output is still plain greedy."""
    runs = []
    for compile_ in (False, True):
        model = draft_model(target, "dspark", "rnn")
        engine = make_engine(target, num_slots=3, max_batch_tokens=10)
        runs.append(InProcessRouter(engine, Drafter(model, compile=compile_), Policy.FIXED, 4).generate(requests()[:3]))
    eager, compiled = runs
    assert [r.token_ids for r in compiled] == [r.token_ids for r in plain[:3]]
    assert [(r.cycles, r.accepted_tokens) for r in compiled] == [(r.cycles, r.accepted_tokens) for r in eager]


def _training_batch(target) -> tuple[torch.Tensor, torch.Tensor]:
    """Three right-padded sequences as a training batch holds them: taps [3, S, T*d], ids [3, S]."""
    seqs = [random_prompts(4)[3], random_prompts(3)[1], random_prompts(4)[0]]
    width = max(len(t) for t in seqs)
    taps = torch.zeros(len(seqs), width, target.config.hidden_size * len(TAPS))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, t in enumerate(seqs):
        taps[b, : len(t)] = _context_taps(target, t)
        ids[b, : len(t)] = torch.tensor(t)
    return taps, ids


@pytest.mark.parametrize("layout", ["anchor", "fill_in"])
@torch.no_grad()
def test_packed_training_backbone_equals_the_per_block_one(target, layout):
    """Training runs a sequence's blocks as one attention problem over its context; each block's states are
    those of the per-anchor backbone drafting uses (sequences with different anchor counts, one with none)."""
    model = draft_model(target, "dspark")
    model.dconfig = dataclasses.replace(model.dconfig, layout=layout)
    taps, ids = _training_batch(target)
    width = ids.shape[1]
    seq, anchors = torch.tensor([0, 0, 0, 2, 2]), torch.tensor([3, 9, 17, 1, 11])  # sequence 1: no block
    kv = model.context_kv(taps, torch.arange(width).expand(len(ids), width))
    packed = model.backbone_packed(ids[seq, anchors], anchors, seq, kv, 4)
    mask = torch.arange(width)[None] < anchors[:, None]
    per_block = model.backbone(ids[seq, anchors], anchors, [(k[seq], v[seq]) for k, v in kv], mask, 4)
    torch.testing.assert_close(packed, per_block, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
@torch.no_grad()
def test_anchored_training_time_test_equals_the_whole_unroll(target, method):
    """Training unrolls only the anchors' chains past step 0; each chain's rows are those of the whole-sequence
    training-time test at the same (anchor, step)."""
    model = draft_model(target, method)
    taps, ids = _training_batch(target)
    seq, anchors = torch.tensor([0, 0, 0, 2, 2]), torch.tensor([3, 9, 17, 1, 11])  # sequence 1: no chain
    steps = model.dconfig.block_size
    outs = model.unrolled(taps, ids, steps)
    whole = torch.stack([outs[k][seq, anchors - 1 + k] for k in range(steps)], dim=1)
    # fp32 to 1e-4: the two run GEMMs of different row counts, which MKL sums in different orders (2.7e-5 seen on
    # an AMX Xeon); a wrong row or step would be off by the activations' own size
    torch.testing.assert_close(model.unrolled_at(taps, ids, seq, anchors, steps), whole, atol=1e-4, rtol=1e-4)
