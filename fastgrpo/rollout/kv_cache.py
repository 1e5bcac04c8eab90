"""A static KV cache the model's own attention modules write into, and the attention masks that go with it.

HF attention modules (transformers 5.x) call `cache.update(key, value, layer_idx, ...)` and attend over what it
returns, so this object is all the model needs: no weight copy, no engine-side model code. Layout per layer:
keys/values [N, H_kv, M, D] (gpt-fast style), N = prompts x generations, M = padded prompt length + new tokens.

Prefill runs the B distinct prompts once: `update` broadcasts each prompt's K/V into the rows of its group
(view [B, G, H_kv, M, D]) and hands the prompt K/V straight back for the prefill's own attention. Decode writes
one slot per step at `slot` (a device tensor, so a captured CUDA graph replays it) and returns the whole cache;
the mask hides empty slots. The buffers are allocated at the first update of each layer (its dtype, heads and
head dim come from the model) and freed with this object.

Shared prefix (`prefix_len` set, EngineConfig.shared_prefix): prefill stores each prompt's K/V once for its group,
in prefix_keys/prefix_values [B, H_kv, prefix_len, D] (slots >= P stay zero, hidden by `prefix_visible` [B,
prefix_len], which the engine sets), and keys/values hold only the generated tokens, [N, H_kv, max_len, D] with
max_len = S new tokens and `slot` counting from 0. `update` then returns the suffix alone; the decode attention
reads the prefix through `decode_kwargs(layer_idx)` (rollout/attention.py). Memory, per layer, for each of K and V,
in elements of H_kv x D: plain N x M with M = bucket(P + S); shared B x bucket(P) + N x S (bucket: rounded up to
EngineConfig.length_bucket). With N = B x G that saves about N x bucket(P) x (1 - 1/G).

FP8 (`fp8=True`, EngineConfig.kv_cache="fp8"): every buffer above holds e4m3 (1 byte an element instead of the
model's 2) and each stored vector of D gets one fp32 scale (ops/decode_attention.py's format, written by its
quantize_kv) in key_scales/value_scales [N, H_kv, M] (prefix_key_scales/prefix_value_scales [B, H_kv, prefix_len]):
bytes per slot and head 2 x (D + 4) instead of 2 x 2D, 0.52x for D = 128. The prefill quantizes the prompt's K/V
as it stores them but hands its own attention the unquantized ones (as vLLM does); a decode step quantizes its new
token's. Only the decode kernel reads this cache, with the scales as keywords (`decode_kwargs`). Its V buffers are
stored slot-major (the slots contiguous: [N, H_kv, D, M] in memory behind the same [N, H_kv, M, D] tensor), the
layout an 8-bit V needs as the kernel's MMA operand (kernels/decode_attention.py).
"""
from __future__ import annotations

import torch

from fastgrpo.ops.decode_attention import FP8, quantize_kv


class StaticKVCache:
    def __init__(self, num_generations: int, max_len: int, device: torch.device, prefix_len: int | None = None,
                 fp8: bool = False):
        self.num_generations = num_generations
        self.max_len = max_len
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.prefilling = True
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # slot: [1], the decode write position
        # shared prefix (None: every row holds its prompt's copy)
        self.prefix_len = prefix_len
        self.prefix_keys: dict[int, torch.Tensor] = {}
        self.prefix_values: dict[int, torch.Tensor] = {}
        self.prefix_visible: torch.Tensor | None = None  # [B, prefix_len] bool, set by the engine
        # fp8 (EngineConfig.kv_cache): keys/values in e4m3, each vector's fp32 scale in these, [N, H_kv, M] (prefix
        # [B, H_kv, prefix_len]); empty otherwise
        self.fp8 = fp8
        self.key_scales: dict[int, torch.Tensor] = {}
        self.value_scales: dict[int, torch.Tensor] = {}
        self.prefix_key_scales: dict[int, torch.Tensor] = {}
        self.prefix_value_scales: dict[int, torch.Tensor] = {}

    @property
    def shares_prefix(self) -> bool:
        return self.prefix_len is not None

    def row_stores(self) -> tuple[dict[int, torch.Tensor], ...]:
        """The per-layer buffers indexed by row, first dim N (rollout/compaction.py gathers them)."""
        return self.keys, self.values, self.key_scales, self.value_scales

    def prefix_stores(self) -> tuple[dict[int, torch.Tensor], ...]:
        """The per-layer buffers indexed by prompt, first dim B (empty without a shared prefix)."""
        return self.prefix_keys, self.prefix_values, self.prefix_key_scales, self.prefix_value_scales

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key, value: [B, H_kv, P, D] when prefilling, [N, H_kv, 1, D] when decoding
        if not self.prefilling:
            return self.layer(layer_idx).update(key, value, layer_idx)
        if layer_idx not in self.keys:
            self._allocate(key, layer_idx)
        if self.shares_prefix:
            self._store_prefix(self.prefix_keys, self.prefix_key_scales, key, layer_idx)
            self._store_prefix(self.prefix_values, self.prefix_value_scales, value, layer_idx)
        else:
            self._store_prompt(self.keys, self.key_scales, key, layer_idx)
            self._store_prompt(self.values, self.value_scales, value, layer_idx)
        return key, value  # the prefill attends over its own K/V, in the model's dtype whatever the cache's

    def _allocate(self, states: torch.Tensor, layer_idx: int) -> None:
        """This layer's zeroed buffers, for states [B, H, P, D] of the model's dtype and heads."""
        B, H, _, D = states.shape
        dtype = FP8 if self.fp8 else states.dtype
        shapes = [(self.row_stores(), B * self.num_generations, self.max_len)]
        if self.shares_prefix:
            shapes.append((self.prefix_stores(), B, self.prefix_len))
        for (keys, values, key_scales, value_scales), rows, slots in shapes:
            keys[layer_idx] = torch.zeros(rows, H, slots, D, dtype=dtype, device=states.device)
            # fp8: V's slots contiguous ([rows, H, D, slots] in memory), what the decode kernel reads an 8-bit V
            # fastest as (kernels/decode_attention.py); the tensor is [rows, H, slots, D] like the others
            values[layer_idx] = (torch.zeros(rows, H, D, slots, dtype=dtype, device=states.device).transpose(2, 3)
                                 if self.fp8 else torch.zeros(rows, H, slots, D, dtype=dtype, device=states.device))
            if self.fp8:  # scale 0: an unwritten slot dequantizes to 0 (the kernel never loads one anyway)
                for store in (key_scales, value_scales):
                    store[layer_idx] = torch.zeros(rows, H, slots, dtype=torch.float32, device=states.device)

    def _store_prompt(self, store, scales, states: torch.Tensor, layer_idx: int) -> None:
        B, H, P, D = states.shape
        G = self.num_generations
        states, scale = self._encode(states)
        # each prompt's K/V copied to the G rows of its group
        store[layer_idx].view(B, G, H, self.max_len, D)[:, :, :, :P] = states[:, None]
        if scale is not None:
            scales[layer_idx].view(B, G, H, self.max_len)[:, :, :, :P] = scale[:, None]

    def _store_prefix(self, store, scales, states: torch.Tensor, layer_idx: int) -> None:
        P = states.shape[2]
        states, scale = self._encode(states)
        store[layer_idx][:, :, :P] = states
        if scale is not None:
            scales[layer_idx][:, :, :P] = scale

    def _encode(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return quantize_kv(states) if self.fp8 else (states, None)

    def layer(self, layer_idx: int) -> LayerCache:
        """One layer's decode buffers, as a cache that needs no layer index (rollout/regional.py)."""
        kwargs = {}
        if self.shares_prefix:
            kwargs.update(prefix_k=self.prefix_keys[layer_idx], prefix_v=self.prefix_values[layer_idx],
                          prefix_visible=self.prefix_visible)
        if self.fp8:
            kwargs.update(k_scale=self.key_scales[layer_idx], v_scale=self.value_scales[layer_idx])
        if self.fp8 and self.shares_prefix:
            kwargs.update(prefix_k_scale=self.prefix_key_scales[layer_idx],
                          prefix_v_scale=self.prefix_value_scales[layer_idx])
        return LayerCache(self.keys[layer_idx], self.values[layer_idx], self.slot, kwargs)

    def decode_kwargs(self, layer_idx: int) -> dict[str, torch.Tensor]:
        """The decode_attention keywords of one layer: its shared prefix, its fp8 scales (rollout/attention.py)."""
        return self.layer(layer_idx).decode_kwargs(layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise RuntimeError("StaticKVCache: pass position_ids explicitly; the cache keeps no sequence length")

    def nbytes(self) -> int:
        stores = (*self.row_stores(), *self.prefix_stores())
        return sum(t.numel() * t.element_size() for store in stores for t in store.values())


class LayerCache:
    """The decode half of StaticKVCache for one layer: writes at `slot` into its own buffers and ignores the layer
    index it is handed, so a compiled decoder layer traces the same code for every layer (an int index read by the
    trace would be specialized on: one recompile per layer)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor, kwargs: dict):
        self.keys, self.values, self.slot = keys, values, slot  # keys, values: [N, H_kv, M, D]; slot: [1]
        self._kwargs = kwargs  # decode_attention's prefix_* and *_scale keywords of this layer

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key, value: [N, H_kv, 1, D]
        if "k_scale" not in self._kwargs:
            self.keys.index_copy_(2, self.slot, key)
            self.values.index_copy_(2, self.slot, value)
            return self.keys, self.values
        for states, store, scales in ((key, self.keys, self._kwargs["k_scale"]),
                                      (value, self.values, self._kwargs["v_scale"])):
            states, scale = quantize_kv(states)
            if torch.compiler.is_compiling():
                # index_put_ on the e4m3 cache itself (Inductor stores e4m3). Through a dtype view the write was not
                # made in place when the Triton decode kernel read the cache after it: a whole-cache copy per layer
                # and step (H100 profile)
                store[:, :, self.slot] = states
            else:  # eager index_copy_ has no float8 kernels (CPU or CUDA): the e4m3 bytes go as uint8
                store.view(torch.uint8).index_copy_(2, self.slot, states.view(torch.uint8))
            scales.index_copy_(2, self.slot, scale)
        return self.keys, self.values

    def decode_kwargs(self, layer_idx: int) -> dict[str, torch.Tensor]:
        return self._kwargs


def attention_masks(config, visible: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor, dtype):
    """The attention_mask argument for the model: 4D masks [N, 1, Q, M], one per layer type where it has them.

    visible: [N, M] bool, slots that hold a real token; query_pos: [Q] slot of each query; key_pos: [M] slot ids.
    Sliding-window layers also hide keys `window` or more slots behind the query (HF's rule). Models with
    `config.layer_types` (qwen2, qwen3, gemma2, gemma3) take a dict by layer type; the others (llama, mistral, gemma,
    phi3) take one tensor, windowed when `config.sliding_window` is set. "eager" attention adds the mask, "sdpa"
    takes it as bool.
    """
    causal = key_pos[None, :] <= query_pos[:, None]  # [Q, M]
    # a query slot always sees itself: left-pad queries would otherwise have no key and produce NaN
    causal = (causal & visible[:, None, :]) | (key_pos[None, :] == query_pos[:, None])  # [N, Q, M]
    window = getattr(config, "sliding_window", None)
    windowed = causal & (key_pos[None, :] > query_pos[:, None] - window) if window else causal

    def fmt(mask):
        mask = mask[:, None]  # [N, 1, Q, M]
        if config._attn_implementation == "eager":
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
        return mask

    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return fmt(windowed)
    return {kind: fmt(windowed if kind == "sliding_attention" else causal) for kind in set(layer_types)}
