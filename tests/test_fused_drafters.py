"""Drafters on the CPU serving kernels (drafter_worker/fused_block.py, fused_chain.py): the kernel backbone
computes what the module backbone computes over the same context, the Markov head's one-call greedy steps pick
the module loop's tokens, chain rows compute the module's rows, a request's drafts do not depend on what shares
its batch, and the context cache grows."""

from __future__ import annotations

import pytest
import torch

from drafter_worker import fused_block
from drafter_worker.calibration import Calibration
from drafter_worker.context_cache import ContextCache
from drafter_worker.drafter import Drafter
from services import cpu_kernels
from services.sampling import densify, logits_to_probs, truncate_to_sparse
from services.types import SamplingParams
from tests.chi2 import chisquare
from tests.conftest import make_model
from tests.test_drafters import MASK, TAPS, draft_model

GAMMA = 5


@pytest.fixture(scope="module")
def target():
    return make_model(layers=3, taps=TAPS)


def _drafter(target, method: str, dtype: torch.dtype) -> Drafter:
    if not cpu_kernels.available(dtype):
        pytest.skip(f"no CPU kernel for {dtype} here")
    drafter = Drafter(draft_model(target, method).to(dtype))
    assert drafter.fused, "a plain draft model on the CPU drafts on the kernel"
    return drafter


def _contexts(drafter: Drafter, lengths: list[int], seed: int = 0) -> dict[str, list[int]]:
    """Commit random features for requests of `lengths` context positions → their token lists (anchor last)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, n in enumerate(lengths):
        rid = f"r{i}"
        feats = torch.randn(n, drafter.model.feature_width, generator=g)
        drafter.commit(rid, 0, feats)
        out[rid] = torch.randint(1, MASK, (n + 1,), generator=g).tolist()
        drafter.fold(rid, out[rid])
    return out


@pytest.mark.parametrize("method", ["dflash", "dspark"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_the_kernel_backbone_computes_the_module_backbone(target, method, dtype):
    drafter = _drafter(target, method, dtype)
    contexts = _contexts(drafter, [7, 19, 12])
    rids = list(contexts)
    anchors = torch.tensor([contexts[r][-1] for r in rids])
    anchor_pos = torch.tensor([len(contexts[r]) - 1 for r in rids])
    kv, mask = drafter.padded_context(rids)
    modules = drafter.model.backbone(anchors, anchor_pos, kv, mask, GAMMA).float()
    slots = torch.tensor([drafter.cache.slot(r) for r in rids])
    kernel = fused_block.backbone(drafter.model, drafter.cache, anchors, anchor_pos, slots, GAMMA).float()
    bound = 1e-5 if dtype == torch.float32 else 0.03
    assert kernel.shape == modules.shape == (3, GAMMA, drafter.model.config.hidden_size)
    assert ((kernel - modules).norm() / modules.norm()).item() < bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_the_one_call_markov_head_picks_the_module_loops_tokens(target, dtype):
    drafter = _drafter(target, "dspark", dtype)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(4, GAMMA, drafter.model.config.hidden_size, generator=g).to(dtype)
    anchors = torch.randint(1, MASK, (4,), generator=g)
    tokens, peaks, z = drafter.model.greedy_heads(h, anchors)
    k_tokens, k_peaks, k_z = fused_block.greedy_heads(drafter.model, h, anchors)
    assert k_tokens.tolist() == tokens.tolist()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(k_peaks, peaks, rtol=tol, atol=tol)
    torch.testing.assert_close(k_z, z, rtol=tol, atol=tol)


@pytest.mark.parametrize("method", ["dflash", "dspark", "eagle3", "mtp"])
@torch.no_grad()
def test_a_requests_fused_drafts_do_not_depend_on_its_batch(target, method):
    dtype = torch.bfloat16 if cpu_kernels.available(torch.bfloat16) else torch.float32
    alone, together = _drafter(target, method, dtype), _drafter(target, method, dtype)
    lengths = [11, 4, 23, 9]
    ctx_alone, ctx_together = _contexts(alone, lengths), _contexts(together, lengths)
    greedy = {rid: SamplingParams() for rid in ctx_alone}
    batch = together.propose(ctx_together, GAMMA, greedy)
    for rid in ctx_alone:
        one = alone.propose({rid: ctx_alone[rid]}, GAMMA, greedy)[rid]
        assert one.tokens == batch[rid].tokens
        assert one.confidences == batch[rid].confidences and one.peaks == batch[rid].peaks


def test_the_fused_path_can_be_turned_off(target, monkeypatch):
    monkeypatch.setenv("DSPARK_FUSED_DECODER", "0")
    assert not Drafter(draft_model(target, "dspark")).fused
    assert not Drafter(draft_model(target, "eagle3")).fused


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_chain_rows_on_the_kernel_compute_the_module_rows(target, method, dtype):
    """Context rows folded and a draft row run by the kernel give the outputs the module path's rows give."""
    drafter = _drafter(target, method, dtype)
    contexts = _contexts(drafter, [9])
    model, tokens = drafter.model, contexts["r0"]
    g = torch.Generator().manual_seed(0)
    taps = torch.randn(9, model.feature_width, generator=g).to(dtype)  # the features `_contexts` committed
    positions = torch.arange(9)[None]
    residual, q, k, v = model.project(model.context(taps[None]), torch.tensor(tokens[1:10])[None], positions)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]
    outs = model.finish(residual, q, k, v, causal)[0]  # [9, d] the module's context rows
    bound = 1e-5 if dtype == torch.float32 else 0.03
    got = drafter.last_out("r0").float()
    assert ((got - outs[-1].float()).norm() / outs[-1].float().norm()).item() < bound
    (ck, cv), = drafter.cache.read("r0", 9)
    for got, want in ((ck, k[0]), (cv, v[0])):
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < bound


def test_the_context_cache_grows_in_slots_and_length():
    cache = ContextCache(layers=2, max_len=600, slots=2, length=8)  # its shape from the first write
    written = {}
    for i in range(5):  # past 2 slots, then 4
        rid = f"r{i}"
        n = 10 + 100 * i  # past the first length, up to 410
        kv = [(torch.randn(1, n, 4), torch.randn(1, n, 4)) for _ in range(2)]
        cache.write(rid, 0, kv)
        written[rid] = kv
    assert cache.k[0].shape[0] >= 5 and cache.length >= 410
    for rid, kv in written.items():
        n = kv[0][0].shape[1]
        for (k, v), (rk, rv) in zip(kv, cache.read(rid, n), strict=True):
            assert torch.equal(k, rk) and torch.equal(v, rv)
    (k, _), _ = cache.padded(["r1", "r0"], [110, 10])[0]
    assert k.shape == (2, 1, 110, 4) and torch.equal(k[1, :, :10], written["r0"][0][0])
    cache.release("r0")
    assert cache.slot("new") == 0  # a released slot serves the next request
    with pytest.raises(ValueError, match="beyond"):
        cache.fit(601)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_folding_on_the_kernel_writes_the_modules_context(target, dtype):
    """Context rows folded by the kernel (`fused_block.fold`) hold the keys and values `context_kv` computes."""
    drafter = _drafter(target, "dspark", dtype)
    contexts = _contexts(drafter, [13])
    g = torch.Generator().manual_seed(5)
    taps = torch.randn(4, drafter.model.feature_width, generator=g)
    drafter.commit("r0", 13, taps)
    drafter.fold("r0", contexts["r0"] + [1, 2, 3, 4])
    assert drafter.context_length("r0") == 17
    expected = drafter.model.context_kv(taps[None].to(dtype), torch.arange(13, 17)[None])
    bound = 1e-5 if dtype == torch.float32 else 0.03
    for (k, v), (ek, ev) in zip(drafter.cache.read("r0", 17), expected, strict=True):
        for got, want in ((k[:, 13:], ek[0]), (v[:, 13:], ev[0])):
            assert ((got.float() - want.float()).norm() / want.float().norm()).item() < bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_the_sampled_markov_block_sends_the_q_it_draws_from(target, dtype):
    """Each step's q' (ids, probs) is the module head's distribution after temperature, top-k and top-p, truncated
    to max_q and renormalised, at the token the kernel drew before; and the tokens follow q' (χ², 6,000 draws)."""
    drafter = _drafter(target, "dspark", dtype)
    model = drafter.model
    g = torch.Generator().manual_seed(3)
    rows = 6000
    h = torch.randn(1, GAMMA, model.config.hidden_size, generator=g).to(dtype).expand(rows, -1, -1).contiguous()
    anchors = torch.full((rows,), 11)
    temps, top_k = torch.full((rows,), 0.8), torch.full((rows,), 40)
    top_p = torch.full((rows,), 0.9)
    uniform = torch.rand(rows, GAMMA, generator=g, dtype=torch.float64)
    tokens, peaks, _, ids, probs = fused_block.sampled_heads(model, h, anchors, temps, top_k, top_p, uniform, 16)
    assert ids.shape == probs.shape == (rows, GAMMA, 16)
    _, base, state = model.heads_start(h[:1])
    prev = anchors[:1]
    for k in range(GAMMA):
        logits, _, state = model.head_step(base[:, k], h[:1, k], prev, state)
        want_ids, want = truncate_to_sparse(logits_to_probs(logits, temps[:1], top_k[:1], top_p[:1]), 16)
        got = dict(zip(ids[0, k].tolist(), probs[0, k].tolist(), strict=True))
        for i, p in zip(want_ids[0].tolist(), want[0].tolist(), strict=True):
            assert got.get(i, 0.0) == pytest.approx(p, abs=2e-3 if dtype == torch.bfloat16 else 1e-5)
        assert peaks[0, k].item() == pytest.approx(probs[0, k, 0].item())
        prev = tokens[:1, k]
    assert all(len(set(step.tolist())) == len(step) for step in ids[0]), "an id sent twice in one q'"
    q0 = dict(zip(ids[0, 0].tolist(), probs[0, 0].tolist(), strict=True))
    support = [i for i, p in q0.items() if p > 0]
    counts = torch.bincount(tokens[:, 0], minlength=model.config.vocab_size)
    assert int(counts.sum()) == int(counts[support].sum()), "a token outside q'"
    expected = torch.tensor([q0[i] for i in support]) * rows
    assert chisquare(counts[support].double().numpy(), expected.double().numpy()).pvalue > 1e-3


@torch.no_grad()
def test_a_max_q_beyond_the_draft_vocabulary_sends_each_id_once(target):
    """q' has min(max_q, V_draft) columns, as `truncate_to_sparse`: wider, a column could only repeat an id, and a
    repeated id with mass 0 once erased the drafted token's q in verification (acceptance certain, output biased)."""
    model = _drafter(target, "dspark", torch.float32).model
    vocab, rows = model.draft_vocab, 4
    h = torch.randn(rows, GAMMA, model.config.hidden_size)
    knobs = (torch.full((rows,), 1.0), torch.zeros(rows, dtype=torch.long), torch.ones(rows))
    uniform = torch.rand(rows, GAMMA, dtype=torch.float64)
    _, _, _, ids, probs = fused_block.sampled_heads(model, h, torch.full((rows,), 11), *knobs, uniform, vocab + 8)
    assert ids.shape == probs.shape == (rows, GAMMA, vocab)
    assert all(len(set(step.tolist())) == vocab for row in ids for step in row)
    dense = densify(ids[0], probs[0], model.config.vocab_size)
    assert torch.allclose(dense.sum(-1), torch.ones(GAMMA))


def test_a_repeated_id_adds_its_mass_in_the_dense_q():
    dense = densify(torch.tensor([[2, 5, 2]]), torch.tensor([[0.5, 0.5, 0.0]]), 8)
    assert dense[0, 2] == 0.5 and dense[0, 5] == 0.5


@torch.no_grad()
def test_a_calibration_fitted_at_t1_calibrates_sampled_blocks_only(target):
    """A calibration fitted at a sampling temperature is applied to sampled drafts; greedy drafts keep the head's
    own σ(z) (a T = 1 fit makes greedy drafts look worse than they are)."""
    model = draft_model(target, "dspark")
    calibration = Calibration(position_temperatures=[2.0] * GAMMA, position_biases=[-1.0] * GAMMA,
                              serving_temperature=1.0)
    blocks = {}
    for t in (0.0, 1.0):
        plain, calibrated = Drafter(model), Drafter(model, calibration)
        ctx_plain, ctx_cal = _contexts(plain, [8]), _contexts(calibrated, [8])
        params = {"r0": SamplingParams(temperature=t, seed=1)}
        blocks[t] = (plain.propose(ctx_plain, GAMMA, params)["r0"], calibrated.propose(ctx_cal, GAMMA, params)["r0"])
    assert blocks[0.0][1].confidences == blocks[0.0][0].confidences  # greedy: raw
    assert blocks[1.0][1].confidences != blocks[1.0][0].confidences  # sampled: calibrated


@torch.no_grad()
def test_fits_at_t0_and_t1_shipped_together_each_calibrate_their_own_rows(target):
    """calibration.json with a T = 1 fit and a T = 0 fit beside it: greedy drafts get the T = 0 one, sampled ones
    the T = 1 one, and neither is the head's raw σ(z)."""
    model = draft_model(target, "dspark")
    sampled = Calibration(position_temperatures=[2.0] * GAMMA, position_biases=[-1.0] * GAMMA, serving_temperature=1.0)
    greedy = Calibration(position_temperatures=[0.5] * GAMMA, position_biases=[1.0] * GAMMA, serving_temperature=0.0)
    both = sampled.beside(greedy)
    assert both.for_rows(True) is greedy and both.for_rows(False) is both
    assert greedy.beside(sampled).greedy is greedy  # whichever is fitted second, both stay
    for t, fit in ((0.0, greedy), (1.0, sampled)):
        plain, calibrated = Drafter(model), Drafter(model, both)
        params = {"r0": SamplingParams(temperature=t, seed=1)}
        raw = plain.propose(_contexts(plain, [8]), GAMMA, params)["r0"]
        got = calibrated.propose(_contexts(calibrated, [8]), GAMMA, params)["r0"]
        z = torch.logit(torch.tensor(raw.confidences, dtype=torch.float64))
        torch.testing.assert_close(torch.tensor(got.confidences, dtype=torch.float64), fit.apply(z), atol=1e-4, rtol=0)
