"""The attention the engine plugs into HF's attention interface for a rollout: SDPA without repeating K/V.

HF's sdpa path repeats each K/V head for its G query heads when a mask is given (repeat_kv), which at decode
writes and re-reads G copies of the whole cache per layer: Qwen2.5-1.5B (G=6), 64 rows x 1280 slots: 0.5 GB per
layer, ~28 GB per step, 10x the weights. For one query token the G query heads of a K/V head are instead laid out
as G query rows of one head ([N, H_kv, G, D]), so every row reads the shared cache once. Multi-token calls
(prefill) use SDPA's enable_gqa. Masks are the engine's bool [N, 1, Q, M].

With EngineConfig(attention="triton") the engine passes the filled cache length (a device tensor [1]) as the
keyword LENGTH_KWARG, which HF hands through to this function; a one-token call then runs the Triton
flash-decoding kernel (fastgrpo.ops.decode_attention), which reads only slots < length instead of all M. The mask
row [N, M] is its `visible` (sliding windows are already in it). Soft-capped or sink attention stays on SDPA.

With EngineConfig(shared_prefix=True) or EngineConfig(kv_cache="fp8") the engine also passes its StaticKVCache as
CACHE_KWARG, whose `decode_kwargs(module.layer_idx)` are the kernel's extra keywords for the layer: with a shared
prefix key/value are the per-row suffixes only and the kernel reads the group's prompt K/V once per group; with fp8
key/value are e4m3 and the keywords carry their scales. Neither call has an SDPA fallback (the suffix alone is not
the row's context; SDPA cannot read e4m3), so attention the kernel cannot run is an error there; the engine only
shares prefixes where the kernel runs, and refuses an fp8 cache for models kept on "eager" attention.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fastgrpo.hf.models import register_attention, unwrap_peft
from fastgrpo.ops.decode_attention import decode_attention

NAME = "fastgrpo_rollout_sdpa"
LENGTH_KWARG = "fastgrpo_decode_length"
CACHE_KWARG = "fastgrpo_decode_cache"


def grouped_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query: [N, Hq, Q, D], key/value: [N, Hkv, M, D], attention_mask: [N, 1, Q, M] bool -> ([N, Q, Hq, D], None)."""
    N, Hq, Q, D = query.shape
    Hkv = key.shape[1]
    length = kwargs.get(LENGTH_KWARG)
    cache = kwargs.get(CACHE_KWARG)  # the engine's cache, when the kernel needs more of it than key/value
    if Q == 1 and length is not None and _kernel_fits(attention_mask, kwargs):
        q = query.reshape(N, Hkv, Hq // Hkv, D)
        extra = cache.decode_kwargs(module.layer_idx) if cache is not None else {}
        # the engine's cache is zero-allocated and written with the model's K/V only, which are finite (its left
        # pads' too, hidden as they are: a non-finite value there would now reach its row's output)
        out = decode_attention(q, key, value, attention_mask[:, 0, 0], length, scaling, v_finite=cache is not None,
                               **extra)
        out = out.reshape(N, Hq, 1, D)
    elif Q == 1 and cache is not None:
        raise NotImplementedError("grouped_sdpa: a shared prefix or an fp8 cache needs the decode kernel (a bool "
                                  "mask, no soft-cap or sinks, the filled length)")
    elif Q == 1:
        # query head h reads K/V head h // G (HF's repeat_kv order), so [N, Hq, 1, D] -> [N, Hkv, G, D]
        q = query.reshape(N, Hkv, Hq // Hkv, D)
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
        out = out.reshape(N, Hq, 1, D)
    else:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=Hq != Hkv
        )
    return out.transpose(1, 2).contiguous(), None


def _kernel_fits(attention_mask, kwargs) -> bool:
    """The decode kernel takes a bool mask [N, 1, 1, M] and plain softmax attention (no soft-cap, no sinks)."""
    plain = kwargs.get("softcap") is None and kwargs.get("s_aux") is None
    return plain and isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool


def rollout_attention(model) -> str | None:
    """The attention implementation a rollout runs `model` with: its own where that is eager (it takes the engine's
    masks), eager where its transformers class has no SDPA attention (gemma2: its attention soft-caps the scores,
    which grouped_sdpa and the decode kernel do not, on whatever implementation it was loaded with: flash_attention_2,
    flex_attention), else grouped_sdpa (registered_name)."""
    if model.config._attn_implementation == "eager":
        return None
    return registered_name() if type(unwrap_peft(model))._supports_sdpa else "eager"


@functools.cache
def registered_name() -> str:
    """Register grouped_sdpa with transformers once, on first use; returns the name to set as the implementation."""
    register_attention(NAME, grouped_sdpa)
    return NAME
