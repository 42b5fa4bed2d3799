"""The draft vocabulary from the target's rollouts: the most frequent response tokens, coverage per domain
against a direct count, and the saved d2t mapping back to exactly the chosen target ids."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from cli.main import main
from training.draft_vocab import coverage, frequency_d2t, rollout_counts

ROWS = [{"domain": "code", "response_ids": [5, 5, 5, 7, 9]}, {"domain": "chat", "response_ids": [7, 7, 3, 1]},
        {"domain": "math", "response_ids": [5, 2, 2]}]


def test_the_most_frequent_tokens_are_kept_and_map_back_exactly():
    counts = rollout_counts(ROWS, 12)
    assert counts.tolist() == [0, 1, 2, 1, 0, 4, 0, 3, 0, 1, 0, 0]
    d2t = frequency_d2t(counts, 3)
    assert (torch.arange(3) + d2t).tolist() == [2, 5, 7]  # target ids, increasing


def test_coverage_per_domain_equals_a_direct_count():
    d2t = frequency_d2t(rollout_counts(ROWS, 12), 3)
    kept = {2, 5, 7}
    expected = {r["domain"]: sum(t in kept for t in r["response_ids"]) / len(r["response_ids"]) for r in ROWS}
    expected["all"] = sum(t in kept for r in ROWS for t in r["response_ids"]) / 12
    assert coverage(d2t, ROWS, 12) == {k: round(v, 4) for k, v in sorted(expected.items())}


def test_the_cli_saves_d2t_and_reports_held_out_coverage(tmp_path, capsys):
    train, held = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    held.write_text(json.dumps({"domain": "code", "response_ids": [5, 11]}) + "\n")
    out = tmp_path / "d2t.safetensors"
    assert main(["data", "draft-vocab", "--rollouts", str(train), "--held-out", str(held), "--size", "3", "20",
                 "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["coverage"]["3"]["held_out"] == {"all": 0.5, "code": 0.5}
    assert report["coverage"]["20"]["held_out"]["all"] == 1.0  # vocabulary 12 (largest id + 1): everything
    assert (torch.arange(3) + load_file(out)["d2t"]).tolist() == [2, 5, 7]


# ---- drafting over a draft vocabulary: every method, lossless, never outside it, shared tensors -------------

METHODS = [("mtp", "markov"), ("eagle3", "markov"), ("dflash", "markov"), ("dspark", "markov"), ("dspark", "gated")]


def _reduced_setup():
    from in_process.generation import GenerationRequest, InProcessRouter
    from router.scheduling.policy import Policy
    from services.types import SamplingParams
    from tests.conftest import VOCAB, make_engine, make_model, random_prompts

    target = make_model(layers=3, taps=(0, 1, 2))
    reqs = [GenerationRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=28)) for i, p in
            enumerate(random_prompts(4))]
    plain = InProcessRouter(make_engine(target), policy=Policy.NONE).generate(reqs)
    # the draft vocabulary: the target's own most frequent output tokens, fewer than it uses (some stay outside)
    emitted = torch.tensor([t for r in plain for t in r.token_ids])
    counts = torch.bincount(emitted, minlength=VOCAB).double() + torch.rand(VOCAB) * 0.1
    d2t = frequency_d2t(counts, max(4, int((counts >= 1).sum()) // 2))
    return target, reqs, plain, d2t


def _reduced_drafter(target, d2t, method, head):
    from drafter_worker.checkpoint import build_draft_model
    from drafter_worker.config import default_config
    from tests.conftest import VOCAB

    torch.manual_seed(0)
    model = build_draft_model(default_config(method, "tiny", (0, 1, 2), VOCAB - 1, head, len(d2t)), target, d2t=d2t)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.dim() >= 2:
                p.normal_(0.0, 0.2)
    return model.eval()


def test_every_method_drafts_inside_its_vocabulary_and_stays_plain_greedy():
    from drafter_worker.drafter import Drafter
    from in_process.generation import InProcessRouter
    from router.scheduling.policy import Policy
    from tests.conftest import make_engine

    target, reqs, plain, d2t = _reduced_setup()
    hot = set((torch.arange(len(d2t)) + d2t).tolist())
    emitted = {t for r in plain for t in r.token_ids}
    assert emitted - hot, "some target tokens lie outside the draft vocabulary"
    for method, head in METHODS:
        model = _reduced_drafter(target, d2t, method, head)
        assert model.lm_head.weight.shape[0] == len(d2t) and model.shares_head
        assert model.embed_tokens.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()  # shared

        class Spy(Drafter):
            drafted: list[int]

            def propose(self, contexts, gamma, params=None):
                out = super().propose(contexts, gamma, params)
                self.drafted.extend(t for block in out.values() for t in block.tokens)
                return out

        spy = Spy(model)
        spy.drafted = []
        engine = make_engine(target, num_slots=3, max_batch_tokens=10)
        spec = InProcessRouter(engine, spy, Policy.FIXED, 1 if method == "mtp" else 4).generate(reqs)
        drafted = spy.drafted
        assert [s.token_ids for s in spec] == [p.token_ids for p in plain], f"{method}/{head} diverged"
        assert drafted and set(drafted) <= hot, f"{method}/{head} drafted outside its vocabulary"
        assert sum(s.draft_tokens for s in spec) > 0


def test_sampled_drafts_and_their_q_are_target_ids_inside_the_vocabulary():
    from drafter_worker.drafter import Drafter
    from services.types import SamplingParams

    target, reqs, _, d2t = _reduced_setup()
    hot = set((torch.arange(len(d2t)) + d2t).tolist())
    for method, head in METHODS:
        drafter = Drafter(_reduced_drafter(target, d2t, method, head), max_q=8)
        prompt = reqs[1].prompt_ids
        out = target.forward_dense(torch.tensor([prompt]))
        drafter.commit("a", 0, out.features[0, :-1])
        block = drafter.propose({"a": prompt}, 4, {"a": SamplingParams(temperature=1.0, seed=3)})["a"]
        assert block.tokens and set(block.tokens) <= hot
        assert set(block.q_ids.flatten().tolist()) <= hot
        for k, token in enumerate(block.tokens):  # each draft is one of the ids its q was sent with
            assert token in block.q_ids[k].tolist()


def test_a_shared_head_is_not_stored_and_comes_back_from_the_target(tmp_path):
    from drafter_worker.checkpoint import load_drafter, save_drafter

    target, _, _, d2t = _reduced_setup()
    model = _reduced_drafter(target, d2t, "dspark", "markov")
    save_drafter(model, tmp_path / "d", torch.float32)
    stored = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert "lm_head.weight" not in stored and "embed_tokens.weight" not in stored
    assert stored["seq_head.markov_embed.weight"].shape[0] == len(d2t) + 1  # + the row of any outside token
    loaded, _ = load_drafter(tmp_path / "d", target, "float32")
    hot = torch.arange(len(d2t)) + d2t
    torch.testing.assert_close(loaded.lm_head.weight, target.lm_head.weight[hot])
    assert torch.equal(loaded.d2t, d2t) and loaded.draft_ids(hot).tolist() == list(range(len(d2t)))
