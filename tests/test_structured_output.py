"""Structured output (services/grammar.py) inside verification: each verified row masked by the grammar state after
that row's own output, so constrained speculative output is constrained plain output token for token; the state
rolls back with rejected drafts; a constraint that does not compile is refused by name. Real parts: llguidance,
target v2 and its shipped DSpark drafter."""

from __future__ import annotations

import json

import llguidance
import pytest
import torch

from drafter_worker.checkpoint import drafter_config, load_drafter
from drafter_worker.drafter import Drafter
from in_process.generation import GenerationRequest, InProcessRouter
from router.scheduling.policy import Policy
from services.errors import InvalidRequestError
from services.grammar import GrammarTokenizer, compile_grammar
from services.loader import load_model
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from services.types import DraftBlock, Grammar, SamplingParams
from tests.chi2 import chisquare
from tests.conftest import make_engine

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "count": {"type": "integer"}},
          "required": ["name", "count"], "additionalProperties": False}
GRAMMARS = [Grammar("json_schema", json.dumps(SCHEMA)), Grammar("regex", r"(yes|no), because [a-z ]{1,30}\."),
            Grammar("choice", json.dumps(["print", "return", "yield"])),
            Grammar("grammar", 'start: "def " NAME "(" NAME "):"\nNAME: /[a-z_]{1,8}/')]
PROMPTS = ["<|user|>\nGive me a JSON object with a name and a count.<|end|>\n<|assistant|>\n", "def parse(",
           "The answer is"]


@pytest.fixture(scope="module")
def target():
    """Target v2 with the taps its shipped drafters read (without them a drafter has no context and drafts
    nothing)."""
    taps = drafter_config(resolve_model("dspark-target-v2-dspark")).tap_layers
    return load_model(resolve_model("dspark-target-v2"), "float32", "cpu", tap_layers=taps)


@pytest.fixture(scope="module")
def tok():
    return TextTokenizer.from_dir(resolve_model("dspark-target-v2"))


def _requests(tok, grammar, temperature=0.0, n=1):
    return [GenerationRequest(f"r{i}-{j}", tok.encode(p), SamplingParams(temperature=temperature, seed=j,
                                                                         max_tokens=40, grammar=grammar),
                              stop_token_ids=tok.eos_token_ids)
            for i, p in enumerate(PROMPTS) for j in range(n)]


def test_row_masks_equal_a_matcher_walked_token_by_token(target, tok):
    # llguidance's own torch helpers are the reference, imported here: their import compiles a kernel (1.9 s of
    # every pytest-xdist worker's collection)
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    gt = GrammarTokenizer(target.source_dir, target.config.vocab_size)
    grammar = gt.start(GRAMMARS[0])
    committed = tok.encode('{"name": "ab', add_special_tokens=False)
    grammar.commit(committed)
    drafts = [*tok.encode('cd", "count": 7}', add_special_tokens=False), 17, 18]  # the last two: not JSON
    masks = grammar.masks(drafts)
    assert masks.shape == (len(drafts) + 1, target.config.vocab_size)
    for k in range(len(drafts) + 1):
        ref = llguidance.LLMatcher(gt.lltok, compile_grammar(GRAMMARS[0]))
        prefix = committed + drafts[:k]
        if not all(ref.consume_token(t) for t in prefix):
            break  # rows past a forbidden draft are never read
        words = allocate_token_bitmask(1, gt.lltok.vocab_size)
        fill_next_token_bitmask(ref, words)  # a fresh matcher walked to this row's output, token by token
        bits = torch.tensor([bool((int(words[0, t // 32]) >> (t % 32)) & 1) for t in range(target.config.vocab_size)])
        assert torch.equal(masks[k], bits), f"row {k}"
        assert all(bool(bits[t]) == (ref.validate_tokens([t]) == 1) for t in drafts[k:k + 1])  # the draft it decides
    again = grammar.masks([])  # rolled back: the state is the committed output's
    assert torch.equal(again[0], masks[0])


def test_an_end_of_sequence_draft_after_a_complete_grammar_leaves_the_state_as_it_was(target, tok):
    """A draft that ends a complete grammar is not walked through (llguidance's rollback does not undo a stop: it
    took the token before it instead, and the next commit failed): rows after it allow the end of sequence only."""
    gt = GrammarTokenizer(target.source_dir, target.config.vocab_size)
    grammar = gt.start(GRAMMARS[0])
    grammar.commit(tok.encode('{"name": "ab", "count": 7}', add_special_tokens=False))
    eos = tok.eos_token_ids[-1]
    before = grammar.masks([])[0]
    masks = grammar.masks([eos, 100, eos])
    assert masks[0][eos] and masks[1].sum() == len(set(tok.eos_token_ids)) and masks[1][eos]
    assert torch.equal(grammar.masks([])[0], before)  # nothing consumed
    assert not grammar.advance(eos)
    grammar.commit([eos, eos])  # what a cycle that accepted it emits
    assert grammar.done


class _Junk:
    """A drafter that drafts the target's next tokens from its own greedy run, then garbage: some drafts the
    grammar forbids, some it allows but the target does not pick."""

    def __init__(self, seed=0):
        self.gen = torch.Generator().manual_seed(seed)

    def commit(self, *_):
        pass

    def release(self, _):
        pass

    def propose(self, contexts, gamma, params=None):
        return {rid: DraftBlock(tokens=torch.randint(1, 8192, (gamma,), generator=self.gen).tolist())
                for rid in contexts}


@pytest.mark.parametrize("grammar", GRAMMARS, ids=[g.kind.value for g in GRAMMARS])
def test_constrained_speculative_greedy_is_constrained_plain_and_valid(target, tok, grammar):
    plain = InProcessRouter(make_engine(target, max_len=256)).generate(_requests(tok, grammar))
    drafter, _ = load_drafter("dspark-target-v2-dspark", target, "float32")
    for proposer in (Drafter(drafter), _Junk()):
        engine = make_engine(target, max_len=256)
        spec = InProcessRouter(engine, proposer, Policy.FIXED, 5).generate(_requests(tok, grammar))
        assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    matcher = llguidance.LLMatcher(GrammarTokenizer(target.source_dir, target.config.vocab_size).lltok,
                                   compile_grammar(grammar))
    for result in plain:
        ids = [t for t in result.token_ids if t not in tok.eos_token_ids]
        matcher.reset()
        assert all(matcher.consume_token(t) for t in ids), tok.decode(ids)
        if result.token_ids[-1] in tok.eos_token_ids:  # finished: the grammar was complete
            assert matcher.is_accepting(), tok.decode(ids)
    if grammar.kind == "json_schema":
        done = [r for r in plain if r.token_ids[-1] in tok.eos_token_ids]
        assert done and all(set(json.loads(tok.decode(r.token_ids[:-1]))) == {"name", "count"} for r in done)


@pytest.mark.parametrize("method", ["dspark", "dflash", "eagle3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_constrained_drafter_drafts_only_what_the_grammar_allows_and_changes_no_output(target, tok, method,
                                                                                        temperature):
    """Drafting under the grammar (drafter_worker/constrained.py): every draft of every block is one the grammar
    allows after the committed output and the drafts before it; the output is the one unconstrained drafting
    gives (greedy: token for token; the drafts differ, the verifier's rule does not)."""
    gt = GrammarTokenizer(target.source_dir, target.config.vocab_size)
    grammar = GRAMMARS[0]
    model, calibration = load_drafter(f"dspark-target-v2-{method}", target, "float32")
    committed: dict[str, list[int]] = {}
    blocks = []

    def observe(rid, block, out):
        if block:
            blocks.append((list(committed[rid]), list(block.tokens)))

    def on_tokens(rid, new):
        committed.setdefault(rid, []).extend(new)

    runs = {}
    for constrained in (True, False):
        committed.clear()
        blocks.clear()
        router = InProcessRouter(make_engine(target, max_len=256, num_slots=8), Drafter(model, calibration),
                                 Policy.FIXED, 7, observer=observe, constrained_drafting=constrained)
        runs[constrained] = (router.generate(_requests(tok, grammar, temperature, n=2), on_tokens), list(blocks))
    (on, on_blocks), (off, off_blocks) = runs[True], runs[False]
    assert on_blocks and all(len(b) > 0 for _, b in on_blocks)
    for output, drafts in on_blocks:
        walker = gt.start(grammar)
        walker.commit(output)
        assert all(walker.matcher.consume_token(t) for t in drafts), tok.decode(output + drafts)
    forbidden = 0
    for output, drafts in off_blocks:  # unconstrained, the same drafter proposes what the grammar forbids
        walker = gt.start(grammar)
        walker.commit(output)
        forbidden += not all(walker.matcher.consume_token(t) for t in drafts)
    assert forbidden > 0
    if temperature == 0.0:
        assert [r.token_ids for r in on] == [r.token_ids for r in off]
    assert sum(r.accepted_tokens for r in on) > 0


def test_sampled_constrained_output_stays_inside_the_grammar_under_speculation(target, tok):
    drafter, _ = load_drafter("dspark-target-v2-dspark", target, "float32")
    grammar = GRAMMARS[1]
    spec = InProcessRouter(make_engine(target, max_len=256, num_slots=8), Drafter(drafter), Policy.FIXED, 5).generate(
        _requests(tok, grammar, temperature=1.0, n=3))
    matcher = llguidance.LLMatcher(GrammarTokenizer(target.source_dir, target.config.vocab_size).lltok,
                                   compile_grammar(grammar))
    for result in spec:
        matcher.reset()
        assert all(matcher.consume_token(t) for t in result.token_ids if t not in tok.eos_token_ids)


@pytest.mark.parametrize(("grammar", "message"), [
    (Grammar("json_schema", '{"type": "object", "properties": '), "json_schema"),
    (Grammar("regex", "(unclosed"), "regex"),
    (Grammar("choice", '"not a list"'), "choice"),
    (Grammar("grammar", "start: undefined_rule"), "grammar"),
])
def test_a_constraint_that_does_not_compile_is_refused_by_name(target, grammar, message):
    engine = make_engine(target)
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request("bad", [1, 2, 3], SamplingParams(grammar=grammar))
    assert engine.num_waiting == 0  # nothing admitted


class _SampledJunk(_Junk):
    """Drafts random tokens with a flat q over a few of them: the residual path runs often."""

    def propose(self, contexts, gamma, params=None):
        out = {}
        for rid in contexts:
            ids = torch.randint(1, 8192, (gamma, 4), generator=self.gen)
            q = torch.full((gamma, 4), 0.25)
            out[rid] = DraftBlock(tokens=ids[:, 0].tolist(), q_ids=ids, q_probs=q)
        return out


@pytest.mark.slow
def test_sampled_constrained_speculative_output_follows_the_masked_target(target, tok):
    """χ² of the first and second tokens at T = 1 against the exact masked target distribution, with drafts the
    grammar forbids, allows and prefers."""
    from services.grammar import RequestGrammar

    grammar, n, vocab = Grammar("regex", "[a-d]{1,3}-[a-d]{1,3}"), 1500, target.config.vocab_size
    gt = GrammarTokenizer(target.source_dir, vocab)
    prompt = tok.encode("Pick letters:")
    reqs = [GenerationRequest(f"r{i}", prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=2, grammar=grammar))
            for i in range(n)]
    engine = make_engine(target, num_slots=64, max_len=32, max_batch_tokens=512, max_waiting=4096)
    out = InProcessRouter(engine, _SampledJunk(), Policy.FIXED, 3).generate(reqs)

    def masked(prefix: list[int]) -> torch.Tensor:
        state: RequestGrammar = gt.start(grammar)
        state.commit(prefix)
        logits = target.forward_dense(torch.tensor([prompt + prefix])).logits[0, -1].float()
        return logits.masked_fill(~state.masks([])[0], float("-inf")).softmax(-1)

    with torch.no_grad():
        p1 = masked([])
        p2 = torch.zeros(vocab, dtype=torch.float64)
        for t1 in p1.nonzero()[:, 0].tolist():
            p2 += float(p1[t1]) * masked([t1]).double()
    for expected, observed in ((p1.double(), [r.token_ids[0] for r in out]), (p2, [r.token_ids[1] for r in out])):
        counts = torch.bincount(torch.tensor(observed), minlength=vocab).double()
        assert counts[expected == 0].sum() == 0, "a token the grammar forbids"
        keep = expected * n >= 5
        obs, exp = counts[keep].tolist(), (expected[keep] * n).tolist()
        if expected[~keep].sum() > 0:
            obs, exp = [*obs, float(counts[~keep].sum())], [*exp, float(expected[~keep].sum() * n)]
        assert chisquare(obs, [e * sum(obs) / sum(exp) for e in exp]).pvalue > 1e-3


def test_logprobs_stay_those_of_the_raw_distribution_under_a_grammar(target, tok):
    """The masks are applied in place unless a request of the step reads the raw rows for its logprobs (vLLM's
    raw_logprobs): then they are the unconstrained target's."""
    grammar = GRAMMARS[2]  # a choice: most of the vocabulary is masked
    prompt = tok.encode(PROMPTS[1])
    req = GenerationRequest("lp", prompt, SamplingParams(max_tokens=2, grammar=grammar, logprobs=0))
    (out,) = InProcessRouter(make_engine(target, max_len=256)).generate([req])
    with torch.no_grad():
        raw = target.forward_dense(torch.tensor([prompt + out.token_ids[:1]])).logits[0].float().log_softmax(-1)
    expected = [float(raw[len(prompt) - 1, out.token_ids[0]]), float(raw[len(prompt), out.token_ids[1]])]
    assert out.logprobs is not None
    torch.testing.assert_close(torch.tensor(out.logprobs.logprobs), torch.tensor(expected), atol=1e-4, rtol=0)
