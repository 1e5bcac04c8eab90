"""The attention the engine plugs into HF's attention interface for a rollout: SDPA without repeating K/V.

HF's sdpa path repeats each K/V head for its G query heads when a mask is given (repeat_kv), which at decode
writes and re-reads G copies of the whole cache per layer: Qwen2.5-1.5B (G=6), 64 rows x 1280 slots: 0.5 GB per
layer, ~28 GB per step, 10x the weights. For one query token the G query heads of a K/V head are instead laid out
as G query rows of one head ([N, H_kv, G, D]), so every row reads the shared cache once. Multi-token calls
(prefill) use SDPA's enable_gqa. Masks are the engine's bool [N, 1, Q, M].
"""
from __future__ import annotations

import functools

import torch.nn.functional as F

from fastgrpo.hf.models import register_attention

NAME = "fastgrpo_rollout_sdpa"


def grouped_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query: [N, Hq, Q, D], key/value: [N, Hkv, M, D], attention_mask: [N, 1, Q, M] bool -> ([N, Q, Hq, D], None)."""
    N, Hq, Q, D = query.shape
    Hkv = key.shape[1]
    if Q == 1:
        # query head h reads K/V head h // G (HF's repeat_kv order), so [N, Hq, 1, D] -> [N, Hkv, G, D]
        q = query.reshape(N, Hkv, Hq // Hkv, D)
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
        out = out.reshape(N, Hq, 1, D)
    else:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=Hq != Hkv
        )
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def registered_name() -> str:
    """Register grouped_sdpa with transformers once, on first use; returns the name to set as the implementation."""
    register_attention(NAME, grouped_sdpa)
    return NAME
