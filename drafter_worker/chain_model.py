"""EAGLE-3 and MTP draft models: one causal layer, autoregressive over its own hidden states.

Row j pairs a hidden of position j with the embedding of token j+1 and predicts token j+2. Context rows
use the target's fused features fc(concat taps); draft rows use the layer's own output of the row before.
In a cycle with anchor position a, the last context row (a−1, the anchor's embedding) predicts x_1 and
draft row a+k−2 predicts x_k; only context rows keep their keys and values between cycles.

Training-time test (EAGLE-3): step t unrolls the chain t rows past its context. Row j at step t then sees
step-0 keys of rows ≤ j−t (the context) and the step-s key of row j−t+s for s = 1..t (its own chain).
"""

from __future__ import annotations

import torch

from drafter_worker.base import DraftModelBase
from drafter_worker.config import DrafterConfig, Method
from drafter_worker.layers import ChainLayer, ContextProjection
from services.layers import RMSNorm
from services.model_config import ModelConfig


class ChainDraftModel(DraftModelBase):
    def __init__(self, dcfg: DrafterConfig, cfg: ModelConfig, embed: torch.Tensor):
        super().__init__(dcfg, cfg, embed)
        self.context = ContextProjection(cfg, len(dcfg.tap_layers), norm=False)
        self.layer = ChainLayer(cfg, mtp=dcfg.method is Method.MTP, norm_before_residual=dcfg.norm_before_residual)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def project(self, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor):
        """Rows (hidden [..., n, d], token_{j+1} [..., n]) at positions [..., n] → residual [..., n, d],
        q [..., H, n, Dh], k, v [..., Hkv, n, Dh]."""
        residual, attn_in = self.layer.inputs(self.embed_tokens(next_tokens), hidden)
        rope = self.rotary().gather(positions, residual.dtype)
        attn = self.layer.self_attn
        return residual, attn.queries(attn_in, rope), *attn.keys_values(attn_in, rope)

    def finish(self, residual: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Attend q [B, H, n, Dh] over k, v [B, Hkv, m, Dh] (mask [B, 1, n, m]) → row outputs [B, n, d]."""
        return self.layer.finish(residual, self.layer.self_attn.attend(q, k, v, mask))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Row outputs [..., d] → logits over the draft vocabulary [..., Vd]."""
        return self.lm_head(self.norm(out))

    def unrolled(self, taps: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test over whole sequences: taps [B, S, T*d], ids [B, S] → the row outputs [B, S, d]
        of steps 0..steps−1; row j of every step predicts token j+2."""
        b, s = ids.shape
        device = ids.device
        positions = torch.arange(s, device=device).expand(b, s)
        next_tokens = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # [B, S]; the last row has no label anyway
        hidden = self.context(taps)  # [B, S, d]
        rows = torch.arange(s, device=device)
        keys, values, outs = [], [], []
        for t in range(steps):
            residual, q, k, v = self.project(hidden, next_tokens, positions)
            keys.append(k)
            values.append(v)
            if t == 0:
                mask = (rows[None, :] <= rows[:, None])[None, None]  # causal [1, 1, S, S]
                out = self.finish(residual, q, k, v, mask)
            else:
                out = self.layer.finish(residual, self._ttt_attention(q, keys, values, t))
            outs.append(out)
            hidden = torch.cat([out[:, :1], out[:, :-1]], dim=1)  # row j now carries step t's row j−1
        return outs

    def unrolled_at(self, taps: torch.Tensor, ids: torch.Tensor, seq: torch.Tensor, anchors: torch.Tensor,
                    steps: int) -> torch.Tensor:
        """`unrolled` read where training scores it: step k's row a−1+k for each anchor a → [A, steps, d]
        (`seq` [A], ascending, and `anchors` [A] as in a training batch). Step 0 runs over whole sequences
        (it is every chain's context); from step 1 on only the anchors' own chains run, since row a−1+k of
        step k sees step-0 keys of rows ≤ a−1 and the keys of its own chain only. The chains of a sequence
        are one attention problem over its step-0 keys: a tenth of the rows of `unrolled` at 48 anchors."""
        b, s = ids.shape
        device = ids.device
        next_tokens = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # [B, S]
        rows = torch.arange(s, device=device)
        residual, q, k0, v0 = self.project(self.context(taps), next_tokens, rows.expand(b, s))
        out = self.finish(residual, q, k0, v0, (rows[None, :] <= rows[:, None])[None, None])  # [B, S, d]
        out = out[seq, (anchors - 1).clamp(0, s - 1)]  # [A, d] step 0's row a−1
        counts = torch.bincount(seq, minlength=b)  # [B] chains per sequence
        rank = torch.arange(len(seq), device=device) - (torch.cumsum(counts, 0) - counts)[seq]
        per = int(counts.max())
        place = seq * per + rank  # [A] slot of each chain in the padded [B, per] layout
        start = torch.zeros(b * per, dtype=torch.long, device=device).index_copy(0, place, anchors).view(b, per)
        context = rows[None, None, :] < start[:, :, None]  # [B, per, S] step-0 rows ≤ a−1 (padding: none)
        own = torch.eye(per, dtype=torch.bool, device=device).expand(b, per, per)  # a chain sees its own keys
        attn = self.layer.self_attn
        keys, values, mask, picked = [k0], [v0], [context], [out]
        for t in range(1, steps):
            r = (anchors - 1 + t).clamp(max=s - 1)  # [A] this step's row of each chain
            res_t, q_t, k_t, v_t = self.project(out[:, None], next_tokens[seq, r][:, None], r[:, None])
            keys.append(_padded(k_t, place, b, per))  # [B, Hkv, per, Dh]
            values.append(_padded(v_t, place, b, per))
            mask.append(own)
            o = attn.attend(_padded(q_t, place, b, per), torch.cat(keys, 2), torch.cat(values, 2),
                            torch.cat(mask, 2)[:, None])  # [B, per, d]
            out = self.layer.finish(res_t[:, 0], o.reshape(b * per, -1)[place])  # [A, d]
            picked.append(out)
        return torch.stack(picked, dim=1)  # [A, steps, d]

    def _ttt_attention(self, q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                       t: int) -> torch.Tensor:
        """Step-t rows: step-0 keys of rows ≤ j−t plus the diagonal keys of steps 1..t → [B, S, d]."""
        attn = self.layer.self_attn
        rep = attn.n_heads // attn.n_kv
        s = q.shape[2]
        scale = attn.head_dim ** -0.5
        rows = torch.arange(s, device=q.device)
        k0, v0 = keys[0].repeat_interleave(rep, 1), values[0].repeat_interleave(rep, 1)  # [B, H, S, Dh]
        scores0 = (q @ k0.transpose(-1, -2)) * scale  # [B, H, S, S]
        scores0 = scores0.masked_fill(rows[None, :] > (rows[:, None] - t), float("-inf"))
        diag_v = []
        diag_scores = []
        for step in range(1, t + 1):
            shift = t - step  # row j reads the step-s row j − (t − s)
            ks = _shift_rows(keys[step].repeat_interleave(rep, 1), shift)
            diag_v.append(_shift_rows(values[step].repeat_interleave(rep, 1), shift))
            diag_scores.append((q * ks).sum(-1) * scale)  # [B, H, S]
        scores = torch.cat([scores0, torch.stack(diag_scores, dim=-1)], dim=-1)  # [B, H, S, S + t]
        probs = torch.softmax(scores, dim=-1)
        o = probs[..., :s] @ v0 + (probs[..., s:, None] * torch.stack(diag_v, dim=-2)).sum(-2)  # [B, H, S, Dh]
        return attn.o_proj(o.transpose(1, 2).flatten(2))


def _shift_rows(x: torch.Tensor, shift: int) -> torch.Tensor:
    """x [B, H, S, Dh] moved `shift` rows later (row j gets row j − shift; the first rows repeat row 0)."""
    if shift == 0:
        return x
    return torch.cat([x[:, :, :1].expand(-1, -1, shift, -1), x[:, :, :-shift]], dim=2)


def _padded(x: torch.Tensor, place: torch.Tensor, b: int, per: int) -> torch.Tensor:
    """Per-chain x [A, heads, 1, Dh] → [B, heads, per, Dh], chain i at row place[i] % per of its sequence."""
    flat = x.new_zeros(b * per, *x.shape[1:]).index_copy(0, place, x)  # [B·per, heads, 1, Dh]
    return flat.view(b, per, x.shape[1], x.shape[3]).transpose(1, 2)
