"""The acceptance rule of speculative decoding, as pure functions.

Vocabulary (docs/design.md §1):
- target distribution p_k: the target's next-token distribution at draft position k, after the
  request's temperature, top-k and top-p (the distribution the output must follow exactly);
- draft distribution q_k: what the drafter sampled x_k from. Drafters send it *sparse and
  truncated* (support ids + probs); rejection sampling is exact for any q, so truncation costs
  acceptance, never correctness. No q means one-hot at x_k (greedy or deterministic drafters);
- accepted: drafts with u_k < min(1, p_k(x_k) / q_k(x_k)), i.i.d. uniforms u_k;
- recovered: at the first rejection j, a token from norm(max(0, p_j − q_j));
- bonus: when all ℓ drafts pass, a token from p_{ℓ+1}.
A cycle emits accepted + 1 tokens. Greedy (temperature 0) is exact match with the target argmax.

One fp32 path (`logits_to_probs`, `sample`) serves the target, the drafters' q and the bonus token.
"""

from __future__ import annotations

import torch

from services.types import DraftBlock, OutcomeKind, TokenLogprobs

_RESIDUAL_EPS = 1e-12


def logits_to_probs(
    logits: torch.Tensor,  # [M, V]
    temperature: torch.Tensor,  # [M] fp32; 0 = greedy (one-hot at the argmax)
    top_k: torch.Tensor,  # [M] int64; 0 = off
    top_p: torch.Tensor,  # [M] fp32; 1 = off
    min_p: torch.Tensor | None = None,  # [M] fp32; 0 = off
    typical_p: torch.Tensor | None = None,  # [M] fp32; 1 = off
) -> torch.Tensor:
    """[M, V] fp32 probabilities after temperature, then min-p, then top-k, then top-p (vLLM's order), then
    locally typical sampling (Hugging Face's `typical_p`, after its top-k and top-p too). Each row is decided by
    its own parameters and logits alone, so it gets the same bits whatever rows share its call."""
    out, left = None, torch.ones(temperature.shape, dtype=torch.bool, device=logits.device)
    for family, chosen in ((_top_k_probs, _within_top_k(temperature, top_k, typical_p)),
                           (_nucleus_probs, _nucleus_alone(temperature, top_k, top_p, typical_p))):
        if not bool(chosen.any()):
            continue
        every = bool(chosen.all())
        picked = None if every else chosen.nonzero().squeeze(-1)
        probs, unresolved = family(*(_rows(t, picked) for t in (logits, temperature, top_k, top_p, min_p)))
        if every and not bool(unresolved.any()):
            return probs
        out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device) if out is None else out
        done = torch.arange(len(chosen), device=logits.device)[chosen][~unresolved]
        out[done] = probs[~unresolved]
        left[done] = False
    if out is None:
        return _masked_probs(logits, temperature, top_k, top_p, min_p, typical_p)
    if bool(left.any()):
        slow = left.nonzero().squeeze(-1)
        out[slow] = _masked_probs(*(_rows(t, slow) for t in (logits, temperature, top_k, top_p, min_p, typical_p)))
    return out


def _rows(t: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or rows is None else t[rows]


def _masked_probs(logits, temperature, top_k, top_p, min_p, typical_p) -> torch.Tensor:
    """`logits_to_probs` by masking the whole vocabulary (every filter, greedy rows, and tied top-k rows)."""
    greedy = temperature <= 0
    logits = logits.float()
    scaled = logits / torch.where(greedy, 1.0, temperature).unsqueeze(-1)
    if min_p is not None and bool((min_p > 0).any()):
        scaled = _min_p(scaled, scaled.max(-1, keepdim=True).values, min_p)
    filtered = ((top_k > 0) | (top_p < 1)) & ~greedy  # [M] rows whose sort changes something
    if bool(filtered.all()):
        scaled = _filter_top_k_top_p(scaled, top_k, top_p)
    elif bool(filtered.any()):  # sort only those rows (each row is filtered on its own: the same bits)
        rows = filtered.nonzero().squeeze(-1)
        scaled = scaled.index_copy(0, rows, _filter_top_k_top_p(scaled[rows], top_k[rows], top_p[rows]))
    if typical_p is not None and bool(((typical_p < 1) & ~greedy).any()):
        rows = ((typical_p < 1) & ~greedy).nonzero().squeeze(-1)
        scaled = scaled.index_copy(0, rows, _filter_typical(scaled[rows], typical_p[rows]))
    probs = torch.softmax(scaled, dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(-1), one_hot, probs)
    return probs


def _filter_typical(logits: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Keep the tokens whose surprisal is closest to the distribution's entropy until they hold `mass` [M] of it
    (Meister et al.; Hugging Face's TypicalLogitsWarper, keeping at least one token)."""
    logp = logits.log_softmax(-1)  # [M, V]
    entropy = -(logp * logp.exp()).nansum(-1, keepdim=True)  # [M, 1]; −inf · 0 rows are NaN, dropped
    shifted = (-logp - entropy).abs()  # [M, V]
    sorted_shifted, order = shifted.sort(dim=-1)
    cumulative = logits.gather(-1, order).softmax(-1).cumsum(-1)  # [M, V]
    last = (cumulative < mass.unsqueeze(-1)).sum(-1, keepdim=True).clamp(max=logits.shape[-1] - 1)  # [M, 1]
    drop_sorted = sorted_shifted > sorted_shifted.gather(-1, last)
    drop_sorted[:, 0] = False
    return logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


_TOPK_AT_MOST = 4096  # top-k alone, up to this k: a partial selection, not a sort of the whole vocabulary


def _within_top_k(temperature, top_k, typical_p) -> torch.Tensor:
    """[M] bool: sampled rows with top-k (at most _TOPK_AT_MOST) and no typical-p: every token they can draw is
    among their k largest logits, so min-p, top-k and top-p are decided there."""
    within = (temperature > 0) & (top_k > 0) & (top_k <= _TOPK_AT_MOST)
    return within if typical_p is None else within & (typical_p >= 1)


def _top_k_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """→ [M, V] probabilities from each row's k largest logits alone (min-p, top-k, top-p in `_masked_probs`'
    order), and [M] the rows whose k-th largest is tied with the next (every tied token is kept: `_masked_probs`
    decides those rows).

    The masked path writes, exponentiates and normalises every logit of the vocabulary, and with top-p sorts it;
    on Gemma's 262,144 ids, 8 rows with top-k 40 and top-p 0.95 took 145 ms, longer than the step that verified
    them. Rows are taken by their k, so each softmax runs over exactly its row's k values: a row's bits do not
    depend on the rows beside it (they may differ from the masked path's in the last place).
    """
    vocab = logits.shape[-1]
    k_of = top_k.clamp(max=vocab)  # [M]
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    tied = torch.zeros(k_of.shape, dtype=torch.bool, device=logits.device)
    for k in k_of.unique().tolist():
        rows = (k_of == k).nonzero().squeeze(-1)  # [n]
        values, ids = (logits if len(rows) == len(k_of) else logits[rows]).topk(min(k + 1, vocab), dim=-1)
        values = values.float() / temperature[rows].unsqueeze(-1)  # [n, k(+1)] largest first (T > 0 keeps order)
        if k < vocab:  # a masked (−inf) k-th largest is no tie: every token below it has probability 0 anyway
            tied[rows] = (values[:, k] == values[:, k - 1]) & values[:, k - 1].isfinite()
        kept = values[:, :k]  # [n, k]
        if min_p is not None and bool((min_p[rows] > 0).any()):
            kept = _min_p(kept, kept[:, :1], min_p[rows])  # the row's largest is its first
        if bool((top_p[rows] < 1).any()):
            kept = _top_p(kept.flip(-1), top_p[rows]).flip(-1)
        probs[rows.unsqueeze(-1), ids[:, :k]] = kept.softmax(-1)
    return probs, tied


_NUCLEUS_K = 1024  # top-p alone: the largest logits a row's nucleus is looked for in before the whole row is sorted


def _nucleus_alone(temperature, top_k, top_p, typical_p) -> torch.Tensor:
    """[M] bool: sampled rows with top-p and no top-k or typical-p."""
    alone = (temperature > 0) & (top_k <= 0) & (top_p < 1)
    return alone if typical_p is None else alone & (typical_p >= 1)


def _nucleus_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """→ [M, V] top-p probabilities (after min-p) from each row's _NUCLEUS_K largest logits, and [M] the rows whose
    nucleus is not inside them (`_masked_probs` sorts those).

    A token is kept when the mass before it (largest first) is below top_p: the masked path's "ascending
    cumulative mass above 1 − top_p". A row whose K largest hold at least top_p (+1e-4 for rounding) keeps none
    beyond them. Sorting 262,144 ids took 17 ms a row here, the K largest 1 ms.
    """
    vocab = logits.shape[-1]
    scaled = logits.float() / temperature.unsqueeze(-1)  # [M, V]
    if min_p is not None and bool((min_p > 0).any()):
        scaled = _min_p(scaled, scaled.max(-1, keepdim=True).values, min_p)
    values, ids = scaled.topk(min(_NUCLEUS_K, vocab), dim=-1)  # [M, K] largest first
    mass = (values - scaled.logsumexp(-1, keepdim=True)).exp()  # [M, K] shares of the whole row
    before = mass.cumsum(-1) - mass  # [M, K]
    unresolved = mass.sum(-1) < top_p + 1e-4  # [M]
    kept = values.masked_fill(before >= top_p.unsqueeze(-1), float("-inf"))
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return probs.scatter_(-1, ids, kept.softmax(-1)), unresolved


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    if bool((top_p >= 1).all()) and bool((top_k > 0).all()) and int(top_k.max()) <= _TOPK_AT_MOST:
        # The same k-th largest logit as the sort below finds, and the same mask (ties at it kept); the sort's
        # top-p step would then drop only tokens whose probability is already exactly 0. A 262,144-token row
        # (Gemma) sorted took half of a batch-64 sampled step.
        k = top_k.clamp(max=vocab)  # [M]
        kth = logits.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1).unsqueeze(-1))  # [M, 1]
        return logits.masked_fill(logits < kth, float("-inf"))
    # Sort once ascending; mask the tail below the k-th largest, then the low-mass prefix beyond top_p.
    sorted_logits, order = logits.sort(dim=-1)  # [M, V] ascending
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # [M]
    kth = sorted_logits.gather(-1, (vocab - k).unsqueeze(-1))  # [M, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    sorted_logits = _top_p(sorted_logits, top_p)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _min_p(scaled: torch.Tensor, largest: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """scaled [M, N] logits (after temperature), largest [M, 1] the row's largest → those whose probability is
    below min_p · the largest's at −inf: p < min_p · p_max ⇔ logit < max logit + log(min_p)."""
    floor = largest + min_p.clamp_min(1e-30).log().unsqueeze(-1)  # [M, 1]
    return scaled.masked_fill((min_p > 0).unsqueeze(-1) & (scaled < floor), float("-inf"))


def _top_p(ascending: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """ascending [M, N] logits, smallest first → the low-mass prefix whose cumulative mass is at most 1 − top_p
    at −inf (the most likely token always kept)."""
    drop = ascending.softmax(-1).cumsum(-1) <= (1 - top_p).unsqueeze(-1)  # [M, N]
    drop[:, -1] = False
    return ascending.masked_fill(drop, float("-inf"))


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of probs [M, V] → [M] int64, by inverting each row's CDF at one uniform.

    torch.multinomial draws V exponentials per row (a fifth of a batch-64 step on CPU); one uniform per row
    draws the same distribution. The CDF is fp64 so that rounding cannot drop mass, and `right=True` returns
    the first index whose CDF exceeds u: never a zero-probability token (its CDF equals its left neighbour's).
    """
    cdf = probs.double().cumsum(-1)  # [M, V]
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64, device=probs.device)  # [M, 1]
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)  # [M]
    return picked.clamp_max(probs.shape[-1] - 1)


def truncate_to_sparse(probs: torch.Tensor, max_k: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncate each row of probs [γ, V] to its top `max_k` support, renormalised.

    Returns (ids [γ, K], probs [γ, K]) with K = min(max_k, V): the q' a drafter samples from and sends.
    """
    top_probs, top_ids = probs.float().topk(min(max_k, probs.shape[-1]), dim=-1)
    return top_ids, top_probs / top_probs.sum(-1, keepdim=True)


def densify(ids: torch.Tensor, probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Sparse q (ids [γ, K], probs [γ, K]) → dense [γ, V] fp32. Added, not written: with an id given twice a
    write would keep one of its entries (torch leaves which unspecified) and could erase the drafted token's mass,
    making its acceptance certain; a drafter's ids are distinct, but this rule cannot be broken by one that is not."""
    return torch.zeros(ids.shape[0], vocab_size, dtype=torch.float32, device=probs.device).scatter_add_(
        -1, ids.long(), probs.float()
    )


def draft_q(draft: DraftBlock, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Dense q [ℓ, V] of a draft block; one-hot at the tokens when the block carries no q."""
    if draft.q_ids is None or draft.q_probs is None:
        tokens = torch.tensor(draft.tokens, dtype=torch.long, device=device)
        return torch.zeros(len(draft), vocab_size, device=device).scatter_(-1, tokens[:, None], 1.0)
    return densify(draft.q_ids.to(device), draft.q_probs.to(device), vocab_size)


def accept_greedy(target_argmax: list[int], draft_tokens: list[int]) -> tuple[int, int, OutcomeKind]:
    """Exact match. target_argmax [ℓ+1], draft [ℓ] → (accepted, next token, kind)."""
    for k, token in enumerate(draft_tokens):
        if token != target_argmax[k]:
            return k, target_argmax[k], OutcomeKind.RECOVERED
    return len(draft_tokens), target_argmax[len(draft_tokens)], OutcomeKind.BONUS


def accept_stochastic(
    p: torch.Tensor,  # [ℓ+1, V] fp32 target distributions at the anchor and each draft
    draft_tokens: list[int],  # [ℓ]
    q: torch.Tensor,  # [ℓ, V] fp32 draft distributions
    generator: torch.Generator | None = None,
) -> tuple[int, int, OutcomeKind]:
    """Leviathan et al. rejection sampling → (accepted, next token, kind). Output follows p exactly."""
    n = len(draft_tokens)
    if n:
        x = torch.tensor(draft_tokens, dtype=torch.long, device=p.device)  # [ℓ]
        p_x = p[:n].gather(-1, x[:, None]).squeeze(-1)  # [ℓ]
        q_x = q.gather(-1, x[:, None]).squeeze(-1)  # [ℓ]
        u = torch.rand(n, generator=generator, device=p.device)  # [ℓ]
        rejected = (u * q_x >= p_x).nonzero()
        if rejected.numel():
            j = int(rejected[0, 0])
            residual = (p[j] - q[j]).clamp_min(0)  # [V]
            mass = residual.sum()
            dist = residual / mass if mass > _RESIDUAL_EPS else p[j]
            return j, int(sample(dist[None], generator)[0]), OutcomeKind.RECOVERED
    return n, int(sample(p[n : n + 1], generator)[0]), OutcomeKind.BONUS


def token_logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int], top: int) -> TokenLogprobs:
    """fp32 log-softmax of logits [M, V] at `rows`: each row's log-probability of its token and its `top` best."""
    lp = torch.log_softmax(logits[rows].float(), dim=-1)  # [n, V]
    chosen = lp.gather(-1, torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None]).squeeze(-1)  # [n]
    if top:
        values, ids = lp.topk(top, dim=-1)  # [n, top]
        return TokenLogprobs(chosen.tolist(), ids.tolist(), values.tolist())
    return TokenLogprobs(chosen.tolist(), [[] for _ in tokens], [[] for _ in tokens])
