"""Which rows of a GRPO batch share micro-batches: a prompt's rows side by side, or rows by length.

Two layouts make a micro-batch's backbone run fewer tokens: fastgrpo.loss.shared_prompts packs adjacent rows of one
prompt into one row with the prompt once, and fastgrpo.loss.row_layout runs a micro-batch only to its longest row.
Rows by prompt get the first, rows by length the second; which one runs fewer tokens depends on the batch (a long
prompt and completions of like lengths: by prompt; a short prompt and completions from a few tokens to thousands:
by length), so `micro_batch_order` counts both, as those modules would run them, and takes the smaller; for a model
that cannot pack (shared_prompts.supports), rows by length.
"""
from __future__ import annotations

import torch

from fastgrpo.hf.models import backbone_and_head
from fastgrpo.loss.row_layout import run_length
from fastgrpo.loss.shared_prompts import packed_tokens, supports


def micro_batch_order(rows: torch.Tensor, batch: dict, group_size: int, micro: int, model) -> torch.Tensor:
    """rows (of batch, a GRPO batch whose group_size completions of each prompt are rows side by side) in the order
    whose micro-batches of `micro` rows run `model`'s backbone on fewer tokens: prompts_then_lengths, or by length
    (always by length where the model cannot pack). One host read where it can."""
    mask = batch["attention_mask"]
    lengths = mask.sum(1)
    by_length = rows[lengths[rows].argsort(stable=True)]
    if not supports(backbone_and_head(model)[0].config):
        return by_length
    B, columns = mask.shape
    column = torch.arange(columns, device=mask.device)
    first = torch.where(batch["completion_mask"].bool().any(0), column, columns).min()  # the completions' column
    prompts = (mask * (column < first)).sum(1)
    by_prompt = prompts_then_lengths(rows, lengths, group_size, B)
    values = torch.cat([lengths, prompts, by_prompt, by_length, first.reshape(1)]).tolist()
    n = len(rows)
    lengths_, prompts_ = values[:B], values[B:2 * B]
    orders = values[2 * B:2 * B + n], values[2 * B + n:2 * B + 2 * n]
    shape = (columns, values[-1], group_size, micro)
    packed = backbone_tokens(orders[0], lengths_, prompts_, *shape, pack=True)
    return by_prompt if packed < backbone_tokens(orders[1], lengths_, prompts_, *shape, pack=False) else by_length


def backbone_tokens(order: list[int], lengths: list[int], prompts: list[int], columns: int, first: int,
                    group_size: int, micro: int, pack: bool) -> int:
    """The tokens the backbone runs over micro-batches of `micro` rows taken in `order` (batch rows; lengths /
    prompts: each row's real tokens, and those before the completions' first column). pack: a micro-batch whose rows
    have one prompt length runs packed where that is fewer tokens (rows of one prompt: row // group_size)."""
    total = 0
    for start in range(0, len(order), micro):
        part = order[start:start + micro]
        longest = max(lengths[row] for row in part)
        tokens = len(part) * run_length(longest, columns)
        prompt = prompts[part[0]]
        if pack and prompt >= 1 and all(prompts[row] == prompt for row in part):
            groups, runs, run = 1, [1], 1
            for previous, row in zip(part, part[1:]):
                run = run + 1 if previous // group_size == row // group_size else 1
                groups += run == 1
                runs.append(run)
            if max(runs) >= 2:
                tokens = min(tokens, packed_tokens(groups, max(runs), prompt, longest, columns, first))
        total += tokens
    return total


def prompts_then_lengths(rows: torch.Tensor, lengths: torch.Tensor, group_size: int, batch_rows: int) -> torch.Tensor:
    """rows (of a batch of batch_rows rows, the group_size completions of each prompt side by side) with each
    prompt's rows side by side, prompts by their longest row (lengths [batch_rows]); a prompt's rows in batch order,
    whatever order they came in, so that the update's micro-batches (from a shuffled minibatch) are those of the
    no-grad log-prob pass: the same packed rows, the same roundings."""
    rows = rows.sort().values
    prompts = rows // group_size
    count = -(-batch_rows // group_size)
    longest = torch.zeros(count, dtype=lengths.dtype, device=rows.device).scatter_reduce(
        0, prompts, lengths[rows], "amax", include_self=False)
    return rows[(longest[prompts] * count + prompts).argsort(stable=True)]
