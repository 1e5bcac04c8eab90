"""Run the backbone on padded rows without their attention mask, where that changes no token the loss reads.

A batch of GRPO rows is [left padding | prompt | completion | right padding]. Given such a mask, transformers builds
a [B, 1, T, T] mask and SDPA leaves its causal flash path, which costs the update time, memory and a first-call
compile (measured in benchmarks/NOTES.md, "Padded rows without their mask"). When
each row's 1s are one run, rolling the row left by its left padding gives [prompt | completion | padding], whose
real tokens see exactly what the mask let them see under the causal mask alone: padding after a token never reaches
it. Position ids then start at 0 on every row's first real token, as the rollout engines number them; RoPE scores
depend only on distances, so the values are those of the masked forward up to rounding. The backbone then runs only
up to the longest row (rounded up to LENGTH_MULTIPLE): columns every row pads (a micro-batch of short completions in
a batch of long ones) cost nothing.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


# The rows run are cut to a multiple of this many columns past the longest row: a few shapes recur, where a
# length per micro-batch made each a new shape (slower on an H200: benchmarks/NOTES.md).
LENGTH_MULTIPLE = 128


class Unpadded(NamedTuple):
    """How the backbone runs a batch: with `mask` (None: the causal mask alone), on rows rolled left by `shift`,
    over their first `length` columns."""

    mask: torch.Tensor | None
    shift: torch.Tensor | None  # [B] long: the left padding of each row; None when no row has any
    length: int  # the columns the backbone runs: the longest row's real tokens, or all T with the mask


def padding_facts(attention_mask: torch.Tensor, target_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """0-dim tensors, for the caller's one host read: whether the mask can be dropped (every row's 1s are one run,
    and every target token t, predicted from position t - 1, has 1s at t - 1 and t), the most left padding of a row
    and the most real tokens of a row. target_mask [B, T]: the tokens whose log-probs are read (GRPO's
    completion_mask, SFT's response_mask)."""
    real, target = attention_mask.bool(), target_mask.bool()
    runs = real[:, 0].long() + (real[:, 1:] & ~real[:, :-1]).sum(1)  # runs: [B]
    seen = real[:, 1:] & real[:, :-1]  # position t - 1 and token t both real
    droppable = (runs <= 1).all() & ~(target[:, 1:] & ~seen).any()
    return droppable, _left_padding(real).max(), real.sum(1).max()


def as_given(attention_mask: torch.Tensor) -> Unpadded:
    """The rows as they are, with their mask."""
    return Unpadded(attention_mask, None, attention_mask.shape[1])


def unpadded(attention_mask: torch.Tensor, droppable: int, most_left_padding: int, longest: int) -> Unpadded:
    """The layout to run, from padding_facts' values read on the host."""
    if not droppable:
        return as_given(attention_mask)
    shift = _left_padding(attention_mask.bool()) if most_left_padding else None
    return Unpadded(None, shift, run_length(longest, attention_mask.shape[1]))


def run_length(longest: int, columns: int) -> int:
    """The columns the backbone runs for rows of at most `longest` real tokens in a batch of `columns`."""
    return min(-(-max(longest, 1) // LENGTH_MULTIPLE) * LENGTH_MULTIPLE, columns)


def run_backbone(backbone: torch.nn.Module, input_ids: torch.Tensor, layout: Unpadded) -> torch.Tensor:
    """last_hidden_state [B, length, H] of the (rolled) rows; read it back through take_columns / take_positions."""
    if layout.shift is None:
        input_ids = input_ids[:, :layout.length]
    else:
        input_ids = torch.gather(input_ids, 1, _source_columns(layout.shift, input_ids.shape[1], layout.length))
    return backbone(input_ids=input_ids, attention_mask=layout.mask, use_cache=False).last_hidden_state


def take_columns(hidden: torch.Tensor, layout: Unpadded, columns: slice) -> torch.Tensor:
    """hidden [B, W, H] of the batch's columns `columns` (a step-1 slice), as the unrolled rows hold them."""
    if layout.shift is None and columns.stop <= layout.length:
        return hidden[:, columns]
    wanted = torch.arange(columns.start, columns.stop, device=hidden.device).expand(hidden.shape[0], -1)
    if layout.shift is not None:
        wanted = wanted - layout.shift[:, None]
    # Columns outside a row's real tokens are its padding, never read: any index will do.
    index = wanted.clamp(0, layout.length - 1)[:, :, None].expand(-1, -1, hidden.shape[2])
    return torch.gather(hidden, 1, index)


def take_positions(hidden: torch.Tensor, layout: Unpadded, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """hidden [n, H] at the unrolled rows' (rows[i], columns[i]), real positions of the batch."""
    if layout.shift is not None:
        columns = columns - layout.shift[rows]
    return hidden[rows, columns]


def _left_padding(real: torch.Tensor) -> torch.Tensor:
    """[B] long: the 0s before each row's first 1 (0 for a row without any)."""
    return torch.where(real.any(1), real.int().argmax(1), 0).long()


def _source_columns(shift: torch.Tensor, T: int, length: int) -> torch.Tensor:
    """[B, length]: the column each rolled position takes; the left padding wraps round to the end of the row."""
    return (torch.arange(length, device=shift.device)[None, :] + shift[:, None]) % T
