"""Rotary scalings whose frequencies depend on the sequence's length, against a decode over a KV cache.

HF's "longrope" (Phi-3.5, Phi-4-mini) rotates every position with its short factors while a forward's longest
sequence is at most original_max_position_embeddings long, and every position with its long factors past it. HF's
forward over one prompt + completion so uses one set for the whole row, by the row's final length. The engine
cannot: its prefill picks the set by the call's longest prompt (a short row that then stops below the threshold
gets the long factors), and a decode step past the threshold switches its new token only, while the K/V already
cached keep the short rotation (attention then mixes two rotations, not a function of the distance any more):
other tokens and log-probs, 3e-3 off on a tiny Phi-3 (tests/test_rollout_variants.py). A rollout is exact when no
row can straddle the threshold: the longest prompt + max_new_tokens within it, or every prompt already past it.

"dynamic" NTK rescales past max_position_embeddings only, which requests.check_lengths already refuses to reach.
Both make HF's per-call rope update a no-op after the prefill, which rollout/rope_step.py skips in the decode steps.
"""
from __future__ import annotations


def check_rope_switch(config, prompt_lengths: list[int], max_new_tokens: int) -> None:
    """Refuse a rollout whose rows could straddle a longrope threshold of `config` (module docstring)."""
    shortest, longest = min(prompt_lengths), max(prompt_lengths)
    for limit in _longrope_thresholds(config):
        if longest + max_new_tokens > limit >= shortest:
            raise ValueError(
                f"rope_parameters['original_max_position_embeddings'] {limit}: longrope switches every position to "
                f"its long factors past it, which the K/V already cached cannot follow; prompts of {shortest} to "
                f"{longest} tokens + max_new_tokens {max_new_tokens} cross it: keep the longest prompt + "
                f"max_new_tokens <= {limit}, or every prompt longer than {limit}")


def _longrope_thresholds(config) -> list[int]:
    """original_max_position_embeddings of each longrope parameter set (one per layer type where there are several)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    per_layer_type = bool(params) and all(isinstance(v, dict) for v in params.values())  # gemma3's form
    sets = params.values() if per_layer_type else [params]
    # the key HF's longrope update reads (modeling_rope_utils.dynamic_rope_update)
    return [p["original_max_position_embeddings"] for p in sets if (p.get("rope_type") or p.get("type")) == "longrope"]
