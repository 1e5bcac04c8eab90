"""Rows that share a prompt run it once: the backbone of a GRPO pass reads each prompt once per group of rows.

A GRPO batch holds G completions of each prompt, so a forward over [B, P + L] runs every prompt G times. When
adjacent rows of a micro-batch hold the same prompt (the same ids and mask in every column before the first
completion column), each run of such rows becomes one packed row [prompt | completion 1 | ... | completion g]:
the prompt's tokens once, then one segment of L columns per row, position ids continuing the prompt in every
segment. Attention keeps each row's own context: the prompt attends causally to itself, and a segment's tokens to
the whole prompt and causally to their own segment (never to another row's). Norms, projections and MLPs work per
token, so every value the loss reads is what the unpacked forward computes, up to rounding; the gradient reaching
a prompt token is the sum of its rows' (autograd sums what the segments read of it). At prompt 256 and completion
1024, g = 8, the backbone runs 17.5% fewer tokens.

Packing needs every row's tokens to be one run ending its prompt at the batch's first completion column (the
layout row_layout drops the mask for), prompts of one length, and attention that is plain causal SDPA (no sliding
window, soft-cap or sinks): `supports` checks the model, `plan` the batch. Anything else runs unpacked.

The attention: the first packed call switches the model's attention implementation from "sdpa" to NAME, which is
transformers' SDPA attention (and SDPA's mask) for every call that does not pass PACKING_KWARG, and the packed
attention for those that do. It stays switched, because recomputed layers (activation checkpointing) call attention
again in the backward, after the forward has returned.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fastgrpo.hf.models import has_sliding_window, register_attention

NAME = "fastgrpo_shared_prompt_sdpa"
PACKING_KWARG = "fastgrpo_prompt_packing"
# Segment widths are rounded up to this: fewer distinct shapes across micro-batches, little padding per segment.
SEGMENT_MULTIPLE = 16


class Packing(NamedTuple):
    """How a micro-batch's rows are packed: `groups` packed rows, each the `prompt` real tokens of one prompt then
    `members` segments of `segment` columns; row r of the batch is segment member[r] of packed row group[r]."""

    groups: int
    members: int
    prompt: int
    segment: int
    first: int  # the batch column where every segment starts (its first completion column)
    group: torch.Tensor  # [B] long
    member: torch.Tensor  # [B] long
    rows: torch.Tensor  # [groups, members] long: the batch row of each segment (a missing one: its group's first)


class Layout(NamedTuple):
    """What the attention needs of a Packing (ints only: carried through the layers' keyword arguments)."""

    prompt: int
    members: int
    segment: int


def supports(config) -> bool:
    """Whether the model's attention can run packed: transformers' SDPA, causal, no sliding window, no soft-cap."""
    return (config._attn_implementation in ("sdpa", NAME) and getattr(config, "is_causal", True)
            and not has_sliding_window(config) and getattr(config, "attn_logit_softcapping", None) is None)


def device_facts(input_ids: torch.Tensor, attention_mask: torch.Tensor, first: torch.Tensor) -> list[torch.Tensor]:
    """What plan reads, as tensors for the caller's one host read: whether every row has the same number of real
    tokens before column `first` (0-dim) with its last one at first - 1 (0-dim), that number (0-dim), and whether
    each row's columns before `first` equal the previous row's ([B - 1] bool)."""
    real = attention_mask.bool()
    before = torch.arange(input_ids.shape[1], device=input_ids.device) < first  # [T]
    prompt = (real & before).sum(1)  # [B]
    last_real = real.gather(1, (first - 1).clamp(min=0).expand(real.shape[0], 1)).all()
    same = ((input_ids[1:] == input_ids[:-1]) & (real[1:] == real[:-1])) | ~before  # [B - 1, T]
    return [(prompt == prompt[0]).all(), last_real, prompt[0], same.all(1)]


def plan(facts: list[int], same: torch.Tensor, columns: int, first: int, longest: int,
         unpadded_length: int) -> Packing | None:
    """The packing of a micro-batch from device_facts' values (read on the host) and its last tensor (`same`, still
    on the device), or None where it cannot pack or would not run fewer tokens. columns: the batch's; longest: the
    most real tokens of a row; unpadded_length: the columns the unpacked backbone would run."""
    equal_prompts, ends_at_first, prompt, *same_as_previous = facts
    rows = len(same_as_previous) + 1
    if rows < 2 or not (equal_prompts and ends_at_first and prompt >= 1):
        return None
    run, members = 1, 1
    for flag in same_as_previous:
        run = run + 1 if flag else 1
        members = max(members, run)
    groups = rows - sum(same_as_previous)
    if members < 2 or packed_tokens(groups, members, prompt, longest, columns, first) >= rows * unpadded_length:
        return None
    segment = segment_length(prompt, longest, columns, first)
    return Packing(groups, members, prompt, segment, first, *_segment_indices(same, groups, members))


def segment_length(prompt: int, longest: int, columns: int, first: int) -> int:
    """The columns of each segment: the longest row's tokens after its prompt, rounded up, within the batch's."""
    return min(-(-max(longest - prompt, 1) // SEGMENT_MULTIPLE) * SEGMENT_MULTIPLE, columns - first)


def packed_tokens(groups: int, members: int, prompt: int, longest: int, columns: int, first: int) -> int:
    """The tokens the backbone runs for a packing (longest: the most real tokens of a row, prompt included)."""
    return groups * (prompt + members * segment_length(prompt, longest, columns, first))


def _segment_indices(same: torch.Tensor, groups: int, members: int) -> tuple[torch.Tensor, ...]:
    """(group [B], member [B], rows [groups, members]) from `same` [B - 1], on its device: no host copy (a copy
    to the device from pageable memory would wait for the GPU's queue)."""
    B = same.shape[0] + 1
    index = torch.arange(B, device=same.device)
    starts = torch.cat([same.new_ones(1), ~same])  # [B]: a row that starts a group
    group = starts.long().cumsum(0) - 1
    member = index - torch.where(starts, index, 0).cummax(0).values
    leaders = torch.zeros(groups, dtype=torch.long, device=same.device).scatter_reduce(
        0, group, index, "amin", include_self=False)
    rows = leaders[:, None].repeat(1, members)
    rows[group, member] = index
    return group, member, rows


def packed_inputs(input_ids: torch.Tensor, packing: Packing) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, position ids), both [groups, prompt + members x segment]. A group with fewer rows than `members` fills
    its missing segments with its first row's tokens, which nothing reads; so are the columns past a row's end."""
    T = input_ids.shape[1]
    device = input_ids.device
    p, g, L, first = packing.prompt, packing.members, packing.segment, packing.first
    segment_cols = (first + torch.arange(L, device=device)).clamp(max=T - 1)  # [L]
    prompt_ids = input_ids[packing.rows[:, 0], first - p:first]  # [groups, p]
    segment_ids = input_ids[packing.rows.reshape(-1)][:, segment_cols].reshape(packing.groups, g * L)
    positions = torch.cat([torch.arange(p, device=device), (p + torch.arange(L, device=device)).repeat(g)])
    return torch.cat([prompt_ids, segment_ids], 1), positions.expand(packing.groups, -1)


def take_columns(hidden: torch.Tensor, packing: Packing, columns: slice) -> torch.Tensor:
    """hidden [B, W, H] of the batch's columns `columns` (step 1, from first - 1 on) out of the packed hidden
    [groups, prompt + members x segment, H]: column first - 1 is the prompt's last token, a later one its row's
    segment. Columns past a row's end are its padding, never read: they take a column of their own segment."""
    p, L, first = packing.prompt, packing.segment, packing.first
    cols = torch.arange(columns.start, columns.stop, device=hidden.device)  # [W]
    offset = (cols - first).clamp(max=L - 1)  # [W]: -1 for the prompt's last token
    segment_col = p + packing.member[:, None] * L + offset[None, :]  # [B, W]
    col = torch.where(offset[None, :] < 0, p - 1, segment_col)
    flat = packing.group[:, None] * hidden.shape[1] + col  # [B, W]
    return hidden.reshape(-1, hidden.shape[2])[flat]


def layout(packing: Packing) -> Layout:
    return Layout(packing.prompt, packing.members, packing.segment)


def _is_placeholder(mask) -> bool:
    return isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-2:] == (1, 1)


def placeholder_mask(ids: torch.Tensor) -> torch.Tensor:
    """The attention_mask argument of a packed forward: transformers passes a 4D mask through as it is, instead of
    building one ([k, 1, T, T], or a packed-sequence mask from the restarting position ids) that the packed
    attention would not read."""
    return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=ids.device)


def use_packed_attention(config) -> None:
    """Switch the model's attention implementation to NAME (once; see the module docstring)."""
    _register()
    if config._attn_implementation == "sdpa":
        config._attn_implementation = NAME


@functools.cache
def _register() -> None:
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    register_attention(NAME, shared_prompt_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def shared_prompt_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' SDPA attention, or with PACKING_KWARG (a Layout) the packed rows' attention.

    query: [k, Hq, T, D], key / value: [k, Hkv, T, D] of k packed rows -> ([k, T, Hq, D], None)."""
    packing = kwargs.get(PACKING_KWARG)
    if packing is None and query.shape[2] > 1 and _is_placeholder(attention_mask):
        # a packed forward whose layout did not reach attention: SDPA would let every token see every other
        raise RuntimeError(f"shared_prompt_attention: packed rows reached {type(module).__name__} without "
                           f"{PACKING_KWARG}: this architecture does not hand its keyword arguments to attention")
    if packing is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError("shared_prompt_attention: packed rows need plain causal attention (no sliding window, "
                         "soft-cap or sinks)")
    p, g, L = packing
    k = query.shape[0]

    def behind_prompt(t):  # [k, H, p + g L, D] -> [k g, H, p + L, D]: each segment behind its own prompt copy
        t = t.transpose(1, 2)  # [k, T, H, D]: the projections' layout, a token's heads side by side
        prompt = t[:, None, :p].expand(-1, g, -1, -1, -1)
        return torch.cat([prompt, t[:, p:].unflatten(1, (g, L))], 2).flatten(0, 1).transpose(1, 2)

    # Causal attention over [prompt | segment] rows: the shapes and kernel (flash, grouped K/V heads) of the unpacked
    # forward; the prompt's outputs are read from the first copy only. The copies are made in the [.., T, H, D]
    # layout, where each token's heads are one contiguous run (benchmarks/NOTES.md, fifty-second session).
    out = F.scaled_dot_product_attention(behind_prompt(query), behind_prompt(key), behind_prompt(value),
                                         is_causal=True, dropout_p=dropout, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    out = out.transpose(1, 2).unflatten(0, (k, g))  # [k, g, p + L, Hq, D]
    return torch.cat([out[:, 0, :p], *out[:, :, p:].unbind(1)], 1), None  # [k, p + g L, Hq, D]
