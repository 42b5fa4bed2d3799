"""Drafter training: loss terms by hand, anchors and labels, the target cache, a few steps of every method."""

from __future__ import annotations

import json
import math

import pytest
import torch

from drafter_worker.checkpoint import build_draft_model, load_drafter
from drafter_worker.config import default_config
from tests.conftest import VOCAB, make_model
from training import target_cache
from training.anchors import block_labels, sample_anchors
from training.drafter import DrafterTrainConfig, train
from training.drafter_losses import decay_weights, dspark_loss, soft_ce_loss, standin_loss, step_weights
from training.early_stop import EarlyStop, expected_accepted

TAPS = (0, 1, 2)


def test_dspark_loss_matches_hand_computation():
    # p_d = (0.5, 0.5) then (0.9, 0.1); p_t = (0.8, 0.2) at both slots; labels 0 then 1; z = 0
    p_d = torch.tensor([[[0.5, 0.5], [0.9, 0.1]]])
    p_t = torch.tensor([[[0.8, 0.2], [0.8, 0.2]]])
    weights = decay_weights(torch.ones(1, 2, dtype=torch.bool))  # 1, e^{-1/4}
    loss, terms = dspark_loss(p_d.log(), p_t.log(), torch.tensor([[0, 1]]), weights, torch.zeros(1, 2))
    w1 = math.exp(-0.25)
    ce = (-math.log(0.5) - w1 * math.log(0.1)) / (1 + w1)  # 1.3978
    l1 = (0.6 + w1 * 0.2) / (1 + w1)  # |0.5-0.8|+|0.5-0.2| = 0.6; |0.9-0.8|+|0.1-0.2| = 0.2
    conf = math.log(2)  # BCE(σ(0) = ½, any label) = log 2
    assert terms["ce"].item() == pytest.approx(ce, rel=1e-5)
    assert terms["l1"].item() == pytest.approx(l1, rel=1e-5)
    assert terms["conf"].item() == pytest.approx(conf, rel=1e-5)
    assert loss.item() == pytest.approx(0.1 * ce + 0.9 * l1 + conf, rel=1e-5)
    assert terms["accept"][0].tolist() == pytest.approx([0.7, 0.9])


def test_confidence_label_is_detached_and_masked_slots_do_not_count():
    draft = torch.randn(2, 3, 5, requires_grad=True)
    target = torch.randn(2, 3, 5).log_softmax(-1)
    conf = torch.randn(2, 3)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    loss, _ = dspark_loss(draft, target, torch.zeros(2, 3, dtype=torch.long), decay_weights(mask), conf,
                              mix=(0.0, 0.0, 1.0))
    loss.backward()
    assert torch.count_nonzero(draft.grad) == 0  # the soft label 1 − ½‖p_d − p_t‖₁ carries no gradient
    changed = target.clone()
    changed[0, 2] += 5.0  # a masked slot
    again, _ = dspark_loss(draft, changed, torch.zeros(2, 3, dtype=torch.long), decay_weights(mask), conf)
    full, _ = dspark_loss(draft, target, torch.zeros(2, 3, dtype=torch.long), decay_weights(mask), conf)
    assert again.item() == pytest.approx(full.item())


def test_soft_ce_and_step_weights():
    p_t = torch.tensor([[[0.25, 0.75]]])
    p_d = torch.tensor([[[0.5, 0.5]]])
    loss, _ = soft_ce_loss(p_d.log(), p_t.log(), torch.ones(1, 1))
    assert loss.item() == pytest.approx(-(0.25 * math.log(0.5) + 0.75 * math.log(0.5)), rel=1e-6)
    assert step_weights(torch.ones(1, 3, dtype=torch.bool))[0].tolist() == pytest.approx([1.0, 0.8, 0.64])


def test_anchors_sit_inside_responses_and_labels_follow_the_shifted_layout():
    ids = torch.arange(100, 112)
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)
    anchors = sample_anchors(mask, 50, torch.Generator().manual_seed(0))
    assert anchors.tolist() == [3, 4, 5, 8, 9, 10]  # p and p+1 in a response
    labels, eval_mask = block_labels(ids, mask, torch.tensor([4, 9]), 4)
    assert labels[0].tolist() == [105, 106, 107, 108]  # slot k → anchor + k + 1
    assert eval_mask[0].tolist() == [True, True, False, False]  # stops at the first non-response label
    assert eval_mask[1].tolist() == [True, True, False, False]  # and at the end of the sequence
    assert labels[1].tolist()[:2] == [110, 111]


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    target = make_model(layers=3, taps=TAPS)
    g = torch.Generator().manual_seed(3)
    records = [{"domain": "code" if i % 2 else "chat", "id": f"s{i}",
                "prompt_ids": torch.randint(1, VOCAB, (5 + i,), generator=g).tolist(),
                "response_ids": torch.randint(1, VOCAB, (20 + 3 * i,), generator=g).tolist()} for i in range(6)]
    train_dir, val_dir = root / "train", root / "val"
    target_cache.build(target, records, train_dir, target="tiny", batch=4)
    target_cache.build(target, records[:3], val_dir, target="tiny", batch=2)
    return target, records, target_cache.TargetCache(train_dir), target_cache.TargetCache(val_dir), root


def test_target_cache_round_trip(caches):
    target, records, cache, _, _ = caches
    seq = cache[2]
    r = records[2]
    assert seq.ids.tolist() == r["prompt_ids"] + r["response_ids"]
    assert seq.loss_mask.tolist() == [False] * len(r["prompt_ids"]) + [True] * len(r["response_ids"])
    out = target.forward_dense(seq.ids[None])
    assert torch.allclose(seq.taps, out.features[0], atol=0.05)  # stored in bf16
    assert torch.allclose(seq.hidden, out.hidden[0], atol=0.05)
    assert cache.tap_layers == TAPS and len(cache) == 6


def test_a_cut_cache_build_resumes_at_its_first_missing_shard(caches, tmp_path):
    import shutil

    target, records, whole, _, _ = caches
    out = tmp_path / "sharded"
    target_cache.build(target, records[:5], out, target="tiny", batch=2, shard_sequences=2)  # shards of 2, 2, 1
    assert json.loads((out / "manifest.json").read_text())["shards"] == ["shard-000", "shard-001", "shard-002"]
    kept = (out / "shard-000" / "taps.npy").stat().st_mtime_ns
    shutil.rmtree(out / "shard-001")  # cut while building shard 1 (its .partial never renamed)
    (out / "shard-001.partial").mkdir()
    assert target_cache.build(target, records, out, target="tiny", batch=2, shard_sequences=2, only={2}) is None
    assert (out / "shard-002").is_dir() and not (out / "shard-001").exists()  # a second process's share
    target_cache.build(target, records, out, target="tiny", batch=2, shard_sequences=2)  # and a record more
    assert (out / "shard-000" / "taps.npy").stat().st_mtime_ns == kept  # a complete shard is not rebuilt
    assert not (out / "shard-001.partial").exists()
    cache = target_cache.TargetCache(out)
    assert len(cache) == len(whole) == 6 and cache.domains == whole.domains
    for i in (1, 2, 5):  # across shards, the same sequences as the flat build of the fixture
        a, b = cache[i], whole[i]
        assert torch.equal(a.ids, b.ids) and torch.equal(a.loss_mask, b.loss_mask)
        torch.testing.assert_close(a.taps, b.taps, atol=0.05, rtol=0)  # bf16; other batches, other padding
        response = a.loss_mask
        torch.testing.assert_close(a.lse[response], b.lse[response], atol=1e-3, rtol=0)
        assert bool(a.lse[~response].isnan().all())  # prompt rows have no target distribution stored


@pytest.mark.parametrize("method", ["mtp", "eagle3", "dflash", "dspark"])
def test_a_few_training_steps_of_every_method(caches, method):
    target, _, cache, val, root = caches
    dcfg = default_config(method, "tiny", TAPS, VOCAB - 1)
    run_dir, out = root / f"run-{method}", root / f"out-{method}"
    cfg = DrafterTrainConfig(run_dir=run_dir, out_dir=out, steps=2, batch_sequences=2, anchors_per_sequence=4,
                             eval_every=2, checkpoint_every=1)
    train(dcfg, target, cache, val, cfg, log=lambda _: None)
    resumed = DrafterTrainConfig(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}, "steps": 3})
    train(dcfg, target, cache, val, resumed, log=lambda _: None)
    log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3]  # the second run resumed at step 2
    assert all(math.isfinite(r["loss"]) for r in log)
    assert len(log[-1]["val"]["accept@k"]) == dcfg.block_size
    model, calibration = load_drafter(out, target, "float32")
    assert model.dconfig == dcfg and calibration is None
    assert torch.equal(model.lm_head.weight, target.lm_head.weight)  # shared, not stored


def test_the_cached_lse_gives_the_log_softmax_and_a_draft_vocabulary_its_rows(caches):
    """log p_t from the cache's log-sum-exp equals the log-softmax over the whole vocabulary, so a drafter over
    a draft vocabulary trains on the target's own probabilities of its ids (not renormalised over them)."""
    from training.draft_vocab import frequency_d2t
    from training.drafter import make_batch, target_logp

    target, _, cache, _, _ = caches
    assert cache[0].lse is not None and cache.manifest["version"] == 2
    batch = make_batch(cache, [0, 3], 4, 3, torch.Generator().manual_seed(0), torch.device("cpu"))
    rows = batch.anchors[:, None] + torch.arange(3)
    full = build_draft_model(default_config("dspark", "tiny", TAPS, VOCAB - 1), target)
    expected = target_logp(full, batch, rows)  # log-softmax of the full head
    d2t = frequency_d2t(torch.rand(VOCAB, generator=torch.Generator().manual_seed(2)), VOCAB // 3)
    reduced = build_draft_model(default_config("dspark", "tiny", TAPS, VOCAB - 1, draft_vocab_size=len(d2t)),
                                target, d2t=d2t)
    got = target_logp(reduced, batch, rows)  # [A, 3, Vd]
    torch.testing.assert_close(got, expected[..., torch.arange(len(d2t)) + d2t], atol=2e-2, rtol=0)
    assert bool((got.exp().sum(-1) < 1).all())  # the mass outside the draft vocabulary stays out


def test_a_cache_whose_lse_runs_over_a_draft_vocabulary_renormalises_over_it(caches, tmp_path):
    """lse_ids: the log-sum-exp over those head rows only, so exp(log p_t) sums to 1 over the draft vocabulary and
    equals the full softmax renormalised there; the manifest names it; a shard of the other kind is rebuilt; the
    CLI refuses to train a drafter over another vocabulary on it."""
    from cli.drafters import _check_lse_vocab
    from training.draft_vocab import frequency_d2t
    from training.drafter import make_batch, target_logp

    target, records, full_cache, _, _ = caches
    d2t = frequency_d2t(torch.rand(VOCAB, generator=torch.Generator().manual_seed(7)), VOCAB // 3)
    ids = d2t + torch.arange(len(d2t))
    out = tmp_path / "vd"
    target_cache.build(target, records, out, target="tiny", batch=4, lse_ids=ids)
    cache = target_cache.TargetCache(out)
    assert cache.lse_vocab == target_cache.lse_vocab_name(ids) != "full" and full_cache.lse_vocab == "full"
    reduced = build_draft_model(default_config("dspark", "tiny", TAPS, VOCAB - 1, draft_vocab_size=len(d2t)),
                                target, d2t=d2t)
    gen = torch.Generator().manual_seed(0)
    batch = make_batch(cache, [1, 4], 4, 3, gen, torch.device("cpu"))
    rows = batch.anchors[:, None] + torch.arange(3)
    got = target_logp(reduced, batch, rows)
    torch.testing.assert_close(got.exp().sum(-1), torch.ones(got.shape[:2]), atol=5e-3, rtol=0)  # bf16 hidden
    logits = target.head_logits(batch.hidden[batch.seq[:, None], rows]).float()
    torch.testing.assert_close(got, logits[..., ids].log_softmax(-1), atol=2e-2, rtol=0)
    before = (out / "shard-000" / "taps.npy").stat().st_mtime_ns
    target_cache.build(target, records, out, target="tiny", batch=4)  # asked for the full lse: rebuilt
    assert (out / "shard-000" / "taps.npy").stat().st_mtime_ns != before
    assert target_cache.TargetCache(out).lse_vocab == "full"
    _check_lse_vocab(cache, d2t)  # the same vocabulary trains
    other = frequency_d2t(torch.rand(VOCAB, generator=torch.Generator().manual_seed(8)), VOCAB // 3)
    for wrong in (None, other):
        with pytest.raises(SystemExit, match="draft vocabulary"):
            _check_lse_vocab(cache, wrong)


@pytest.mark.parametrize("method", ["mtp", "eagle3", "dflash", "dspark"])
def test_training_over_a_draft_vocabulary_exports_only_its_own_weights(caches, method):
    from training.draft_vocab import frequency_d2t

    target, _, cache, val, root = caches
    d2t = frequency_d2t(torch.rand(VOCAB, generator=torch.Generator().manual_seed(5)), VOCAB // 2)
    dcfg = default_config(method, "tiny", TAPS, VOCAB - 1, draft_vocab_size=len(d2t))
    cfg = DrafterTrainConfig(run_dir=root / f"run-vd-{method}", out_dir=root / f"out-vd-{method}", steps=3,
                             batch_sequences=2, anchors_per_sequence=4, eval_every=3, checkpoint_every=1)
    with pytest.raises(ValueError, match="needs its d2t"):
        train(dcfg, target, cache, val, cfg, log=lambda _: None)
    train(dcfg, target, cache, val, cfg, log=lambda _: None, d2t=d2t)
    log = [json.loads(line) for line in (cfg.run_dir / "log.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) for r in log) and log[-1]["val"]["expected_accepted"] > 0
    model, _ = load_drafter(cfg.out_dir, target, "float32")
    hot = torch.arange(len(d2t)) + d2t
    assert torch.equal(model.lm_head.weight, target.lm_head.weight[hot])  # the target's rows, not stored
    assert model.dconfig.draft_vocab_size == len(d2t)


def test_a_run_resumes_on_a_fresh_machine_from_its_mirror(caches):
    """The run directory gone (a fresh machine), the committed mirror resumes the run at its step with its log and
    best weights; the weights then follow the uninterrupted run's closely (only the moments were rounded)."""
    import shutil

    target, _, cache, val, root = caches
    dcfg = default_config("dspark", "tiny", TAPS, VOCAB - 1)
    base = dict(batch_sequences=2, anchors_per_sequence=4, eval_every=2, checkpoint_every=1, mirror_every=2)
    whole = DrafterTrainConfig(run_dir=root / "run-whole", out_dir=root / "out-whole", steps=6, **base)
    train(dcfg, target, cache, val, whole, log=lambda _: None)
    mirror = root / "mirror"
    first = DrafterTrainConfig(run_dir=root / "run-a", out_dir=root / "out-a", steps=6, mirror_dir=mirror, **base)
    train(dcfg, target, cache, val, DrafterTrainConfig(**{**{f: getattr(first, f) for f in first.__dataclass_fields__},
                                                         "steps": 4}), log=lambda _: None)
    assert torch.load(mirror / "resume.pt", weights_only=True)["step"] == 4
    shutil.rmtree(first.run_dir)
    fresh = DrafterTrainConfig(**{**{f: getattr(first, f) for f in first.__dataclass_fields__},
                                  "run_dir": root / "run-b", "out_dir": root / "out-b"})
    train(dcfg, target, cache, val, fresh, log=lambda _: None)
    log = [json.loads(line) for line in (fresh.run_dir / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]  # steps 1-4 came with the mirror
    assert json.loads((fresh.run_dir / "best.json").read_text())["last_step"] == 6
    a, _ = load_drafter(whole.out_dir, target, "float32")
    b, _ = load_drafter(fresh.out_dir, target, "float32")
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa, pb, rtol=1e-2, atol=1e-3), name


def test_expected_accepted_is_the_chain_of_slot_rates():
    assert expected_accepted([0.5, 0.5, 1.0]) == pytest.approx(0.5 + 0.25 + 0.25)
    assert expected_accepted([0.0, 1.0]) == 0.0
    assert expected_accepted([]) == 0.0


def test_early_stop_keeps_the_best_weights_and_counts_across_a_resume(tmp_path):
    model = torch.nn.Linear(2, 2)
    keeper = EarlyStop.load(tmp_path, patience=2)
    with torch.no_grad():
        model.weight.fill_(1.0)
    assert not keeper.update(tmp_path, model, 10, 1.0)  # best
    with torch.no_grad():
        model.weight.fill_(2.0)
    assert not keeper.update(tmp_path, model, 20, 0.9)  # worse: 1 since best
    resumed = EarlyStop.load(tmp_path, patience=2)  # a killed run re-evaluates step 20: not counted twice
    assert not resumed.update(tmp_path, model, 20, 0.9) and resumed.since == 1
    assert resumed.update(tmp_path, model, 30, 1.0005)  # within min_delta of the best: not better, stop
    assert EarlyStop.load(tmp_path, patience=2).stopped
    assert resumed.restore_best(tmp_path, model) == 10 and torch.all(model.weight == 1.0)


def test_training_stops_early_and_exports_the_best_step(caches):
    target, _, cache, val, root = caches
    dcfg = default_config("dspark", "tiny", TAPS, VOCAB - 1)
    run_dir, out = root / "run-early", root / "out-early"
    cfg = DrafterTrainConfig(run_dir=run_dir, out_dir=out, steps=40, batch_sequences=2, anchors_per_sequence=4,
                             eval_every=1, checkpoint_every=1, lr=0.5, patience=2)  # lr 0.5 diverges: no new best
    train(dcfg, target, cache, val, cfg, log=lambda _: None)
    log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    scores = [r["val"]["expected_accepted"] for r in log]
    best = json.loads((run_dir / "best.json").read_text())
    assert best["stopped"] and len(log) < 40 and len(log) == best["best_step"] + 2
    assert best["best"] == max(scores)
    train(dcfg, target, cache, val, cfg, log=lambda _: None)  # a rerun of a stopped run trains no further
    assert len((run_dir / "log.jsonl").read_text().splitlines()) == len(log)


def test_the_stand_in_term_is_relative_and_masked():
    ctx = torch.tensor([[[2.0, 0.0], [0.0, 1.0]]])  # [1, 2, 2]
    h = torch.tensor([[[1.0, 0.0], [5.0, 5.0]]])
    assert standin_loss(h, ctx, torch.tensor([[True, False]])) == pytest.approx(0.25)  # ‖(−1, 0)‖² / ‖(2, 0)‖²
    assert standin_loss(ctx, ctx, torch.ones(1, 2, dtype=torch.bool)) == 0.0


def test_stand_in_fine_tune_starts_from_the_export_and_closes_the_gap(caches):
    """`init_from` starts at the exported weights; training with the stand-in term brings the block's states
    closer to the context rows they stand in for when drafting ahead."""
    target, _, cache, val, root = caches
    dcfg = default_config("dflash", "tiny", TAPS, VOCAB - 1)
    base = DrafterTrainConfig(run_dir=root / "run-base", out_dir=root / "out-base", steps=3, batch_sequences=2,
                              anchors_per_sequence=4, eval_every=3)
    exported = train(dcfg, target, cache, val, base, log=lambda _: None)
    copy = DrafterTrainConfig(run_dir=root / "run-copy", out_dir=root / "out-copy", steps=0, init_from=exported)
    same = load_drafter(train(dcfg, target, cache, val, copy, log=lambda _: None), target, "float32")[0]
    trained = load_drafter(exported, target, "float32")[0]
    pairs = zip(same.state_dict().values(), trained.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    tune = DrafterTrainConfig(run_dir=root / "run-tune", out_dir=root / "out-tune", steps=30, batch_sequences=2,
                              anchors_per_sequence=4, eval_every=30, lr=3e-3, standin_weight=1.0,
                              init_from=exported)
    train(dcfg, target, cache, val, tune, log=lambda _: None)
    log = [json.loads(line) for line in (root / "run-tune" / "log.jsonl").read_text().splitlines()]
    first, last = log[0]["standin"], sum(r["standin"] for r in log[-5:]) / 5
    assert last < 0.7 * first
    assert "standin" not in json.loads((root / "run-base" / "log.jsonl").read_text().splitlines()[0])


@pytest.mark.parametrize("method", ["dspark", "eagle3"])
def test_tap_scaled_training_sees_unit_taps_and_exports_a_drafter_of_raw_taps(caches, method):
    """Training scales tap i by 1 / RMS_i; a run from an export unfolds the scale into fc and export folds it
    back: 0 steps from an export give the export again, and the held-out figures do not move."""
    from training import tap_scale

    target, _, cache, val, root = caches
    scale = tap_scale.measure(cache, len(TAPS))
    seq = cache[0]
    scaled = tap_scale.apply(seq.taps[seq.loss_mask], scale).view(-1, len(TAPS), target.config.hidden_size)
    assert scaled.pow(2).mean((0, 2)).tolist() == pytest.approx([1.0] * len(TAPS), rel=0.5)  # one sequence of 64
    dcfg = default_config(method, "tiny", TAPS, VOCAB - 1)
    base = DrafterTrainConfig(run_dir=root / f"ts-base-{method}", out_dir=root / f"ts-out-{method}", steps=2,
                              batch_sequences=2, anchors_per_sequence=4, eval_every=2)
    exported = train(dcfg, target, cache, val, base, log=lambda _: None)
    again = DrafterTrainConfig(run_dir=root / f"ts-again-{method}", out_dir=root / f"ts-again-out-{method}",
                               steps=0, init_from=exported, tap_scale=True)
    same = load_drafter(train(dcfg, target, cache, val, again, log=lambda _: None), target, "float32")[0]
    trained = load_drafter(exported, target, "float32")[0]
    for (name, a), b in zip(same.state_dict().items(), trained.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
    assert json.loads((root / f"ts-again-{method}" / "tap_scale.json").read_text())["scale"] == pytest.approx(
        scale.tolist())
    tuned = DrafterTrainConfig(run_dir=root / f"ts-tune-{method}", out_dir=root / f"ts-tune-out-{method}", steps=1,
                               batch_sequences=2, anchors_per_sequence=4, eval_every=1, lr=0.0, init_from=exported,
                               tap_scale=True)
    train(dcfg, target, cache, val, tuned, log=lambda _: None)
    first = json.loads((root / f"ts-tune-{method}" / "log.jsonl").read_text().splitlines()[0])["val"]
    raw = json.loads((root / f"ts-base-{method}" / "log.jsonl").read_text().splitlines()[-1])["val"]
    assert first["loss"] == pytest.approx(raw["loss"], rel=1e-3)  # scaled taps, unfolded fc: the same function


def test_mtp_unrolled_two_steps_trains_on_its_own_output_and_still_serves_one(caches):
    """`unroll`: MTP-1 trained over two training-time-test steps (the second reads its own output, as a block
    drafted ahead does); validation and the export keep its block of one. Block drafters refuse it."""
    target, _, cache, val, root = caches
    dcfg = default_config("mtp", "tiny", TAPS, VOCAB - 1)
    cfg = DrafterTrainConfig(run_dir=root / "run-mtp2", out_dir=root / "out-mtp2", steps=2, batch_sequences=2,
                             anchors_per_sequence=4, eval_every=2, unroll=2)
    train(dcfg, target, cache, val, cfg, log=lambda _: None)
    log = [json.loads(line) for line in (root / "run-mtp2" / "log.jsonl").read_text().splitlines()]
    assert len(log[-1]["val"]["accept@k"]) == 1 and all(math.isfinite(r["loss"]) for r in log)
    assert load_drafter(root / "out-mtp2", target, "float32")[0].dconfig.block_size == 1
    with pytest.raises(ValueError, match="chain drafters"):
        train(default_config("dflash", "tiny", TAPS, VOCAB - 1), target, cache, val, cfg, log=lambda _: None)
