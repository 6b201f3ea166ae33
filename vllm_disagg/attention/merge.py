# SPDX-License-Identifier: Apache-2.0
"""Exact merge of partial attention results (Lamina section 4.2.2).

For disjoint key sets I1, I2 with A = softmax-weighted values and S = sum of exp(logits):
A(I) = (A1*S1 + A2*S2) / (S1 + S2). We carry LSE = log S instead of S, so the merge never
overflows: weights are exp(lse_i - max(lse1, lse2)). An empty key set has LSE = -inf and A = 0.

`partial_attention` is the plain-torch reference that also returns the LSE; the server uses it
for the "previous tokens" half of send-Q-early (the vLLM CPU kernel returns no LSE) and the
client uses it for the one new token.
"""

from __future__ import annotations

import torch


def merge_attn_states(
    out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions. out*: [..., H, D]; lse*: [..., H] (natural log).

    Computed in float32 whatever the input dtype; returns (out in out1's dtype, lse float32).
    """
    l1 = lse1.float()
    l2 = lse2.float()
    m = torch.maximum(l1, l2)
    # Both empty: m = -inf; use 0 so the weights are exp(-inf) = 0 instead of NaN.
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    w1 = torch.exp(l1 - m_safe)
    w2 = torch.exp(l2 - m_safe)
    total = w1 + w2
    denom = torch.where(total > 0, total, torch.ones_like(total))
    out = (out1.float() * w1.unsqueeze(-1) + out2.float() * w2.unsqueeze(-1)) / denom.unsqueeze(-1)
    lse = m_safe + torch.log(total)
    return out.to(out1.dtype), lse


def partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    key_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries over a key set, with its LSE (GQA: query head h reads KV head h // G).

    q: [B, Hq, D]; k, v: [B, L, Hkv, D]; key_mask: [B, L] bool (True = key present) or None.
    Returns out [B, Hq, D] (zeros where no key) and lse [B, Hq] (-inf where no key).
    """
    bsz, hq, _ = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    qf = q.float().view(bsz, hkv, group, -1)
    logits = torch.einsum("bhgd,blhd->bhgl", qf, k.float()) * scale
    if key_mask is not None:
        logits = logits.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [B, Hkv, G]
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(logits - lse_safe.unsqueeze(-1))
    out = torch.einsum("bhgl,blhd->bhgd", probs, v.float())
    return out.reshape(bsz, hq, -1).to(q.dtype), lse.reshape(bsz, hq)
