"""Rows that have finished stop costing compute (EngineConfig.finished_rows), decided at the engine's host syncs.

In a rollout with stop tokens the rows end at different steps; with "keep" a finished row still runs every step to the
longest row's end (its tokens are written as pad). The other modes act at each host sync (every check_every steps):

"skip" (attention="triton"): a finished row's `visible` row is cleared, and so is a shared prompt's once no running
row reads it. The decode kernel loads only visible slots, so it reads none of that row's cache but the slot the step
itself writes (attention_masks always shows a query its own slot). The compiled step and its CUDA graph are unchanged.

"compact": when the running rows fit in the next smaller batch of N, ceil(N/2), ceil(N/4)... (not below MIN_ROWS),
the engine leaves its step loop; `compact` gathers the running rows, with finished ones to fill the batch, into new
state and cache tensors (every per-row field of decode._State, each layer's K/V), and the loop goes on with them.
The gathered rows' outputs so far travel with them, and `call_rows` says whose they are (the stop strings read each
row's prompt); `finish` scatters every row's outputs back into the call's [N, S] buffers. With a shared prefix,
compacted rows get their own copy of their prompt's K/V (a group's running rows are no longer consecutive, which the
kernel's grouping needs). Under "compact" the "skip" clearing runs too.

Same samples: every op of the step is per row (the GEMMs, the attention over the row's own slots, the filters) and
the sampling noise is keyed per sample and step, so a row's tokens and log-probs depend on which rows share its
batch only through how a matmul rounds at another batch size. On the CPU (MKL) the tiny test models' GEMMs round
alike from 6 rows up and the compacted rollouts are bit-identical (tests/test_compaction.py); below that, and on a
GPU (cuBLAS picks kernels by shape), the last bits of a log-prob may differ, and so, rarely, a near-tied token.

Compiling: the per-row (and per-prompt) tensors' batch dimension is marked dynamic (maybe_mark_dynamic) from the
first step on, so torch.compile traces the step once for every batch size (with a shared prefix twice: rows grouped
by prompt, then rows with their own prompt copy) with compile_scope="step"; under "layers" (the default) the
layer's inputs are made inside the step, unmarked, so the layer may compile again per batch size (not counted yet).
Each batch size still captures its own CUDA graph, after EngineConfig.warmup_steps steps, once per batch size per
call. On an H100, Inductor traced the compacted shared-prefix step once for both layouts (NOTES_rollout.md, D3).
"""
from __future__ import annotations

import dataclasses

import torch

# the [N, ...] fields of decode._State: gathered by row when compacting
ROW_FIELDS = ("tokens", "positions", "visible", "seen", "keys", "done", "out_tokens", "out_logprobs", "out_valid")
# the fields that carry a row's results: scattered back to the call's buffers
OUT_FIELDS = ("out_tokens", "out_logprobs", "out_valid", "done")
# Smallest batch compacted to. A decode step multiplies every weight whatever the rows, so halving an already small
# batch saves little while it costs a CUDA-graph capture; and it keeps batches >= 2, since a size-1 dimension would
# make torch.compile specialize and trace again.
MIN_ROWS = 8


def bucket(rows: int, live: int) -> int:
    """Rows of the smallest batch of rows, ceil(rows / 2), ceil(rows / 4)... that holds `live` rows, >= MIN_ROWS."""
    size = rows
    while (half := -(-size // 2)) >= max(live, MIN_ROWS) and half < size:
        size = half
    return size


def _select_rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t.index_select(0, idx) in t's layout (an fp8 cache's V has its last two dimensions transposed in memory); an
    fp8 cache's e4m3 buffers as their bytes (torch's index kernels do not all take float8: index_copy_ has none on
    the CPU or CUDA)."""
    if t.dim() > 1 and t.stride(-1) != 1 and t.stride(-2) == 1:
        return _select_rows(t.transpose(-1, -2), idx).transpose(-1, -2)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).index_select(0, idx).view(t.dtype)
    return t.index_select(0, idx)


class FinishedRows:
    """The rollout's current state and cache under EngineConfig.finished_rows, from the prefill to the results.

    state: the call's decode._State (its out_* and done buffers receive every row's results); cache: its
    StaticKVCache; num_generations: G (rows n*G..n*G+G-1 share prompt n's K/V when the cache shares prefixes).
    """

    def __init__(self, mode: str, state, cache, num_generations: int):
        self.mode = mode
        self.full = state
        self.state = state
        self.cache = cache
        self.rows: torch.Tensor | None = None  # [n] the call's row of each current row (None: all N, in order)
        self.call_rows = list(range(state.done.shape[0]))  # `rows` on the host (the stop strings read the prompts)
        self.pending = False  # at_sync asked the loop to stop for a compaction
        # [n] the prefix_keys entry each current row reads: its group at first, itself once compacted
        self.prefix_of = (torch.arange(state.done.shape[0], device=state.done.device) // num_generations
                          if cache.shares_prefix else None)
        if mode == "compact":
            self._mark_dynamic()

    def at_sync(self) -> bool:
        """At a host sync: hide finished rows from the decode kernel; True to leave the step loop for `compact`."""
        state = self.state
        if self.mode != "keep" and state.decode_kernel:
            state.visible.masked_fill_(state.done[:, None], False)
            if self.cache.shares_prefix:
                readers = torch.zeros(self.cache.prefix_visible.shape[0], dtype=torch.int32, device=state.done.device)
                readers.index_add_(0, self.prefix_of, (~state.done).int())
                self.cache.prefix_visible.masked_fill_((readers == 0)[:, None], False)
        if self.mode == "compact":
            rows = state.done.shape[0]
            self.pending = bucket(rows, int((~state.done).sum())) < rows
        return self.pending

    def compact(self) -> None:
        """Gather the running rows (and finished ones up to the bucket's size, in row order) into smaller tensors."""
        self.pending = False
        state, cache = self.state, self.cache
        self._store()
        size = bucket(state.done.shape[0], int((~state.done).sum()))
        # idx: [size] running rows first (stable sort of done: False before True), then back in row order
        idx = torch.argsort(state.done.int(), stable=True)[:size].sort().values
        self.state = dataclasses.replace(state, **{
            name: getattr(state, name).index_select(0, idx) for name in ROW_FIELDS if getattr(state, name) is not None
        })
        self.rows = idx if self.rows is None else self.rows[idx]
        self.call_rows = self.rows.tolist()
        # layer by layer, so the old and new caches coexist one layer at a time (fp8: the scales go with them)
        for store in cache.row_stores():
            for layer in store:
                store[layer] = _select_rows(store[layer], idx)
        if cache.shares_prefix:
            entries = self.prefix_of[idx]
            for store in cache.prefix_stores():
                for layer in store:
                    store[layer] = _select_rows(store[layer], entries)
            cache.prefix_visible = cache.prefix_visible.index_select(0, entries)
            self.prefix_of = torch.arange(size, device=idx.device)
        self._mark_dynamic()

    def finish(self, pad_id: int) -> None:
        """Every row's results in the call's state; rows gathered away early read pad / 0 / False after that."""
        self._store()
        if self.rows is not None:
            self.full.out_tokens.masked_fill_(~self.full.out_valid, pad_id)

    def _store(self) -> None:
        if self.rows is None:
            return
        for name in OUT_FIELDS:
            getattr(self.full, name).index_copy_(0, self.rows, getattr(self.state, name))

    def _mark_dynamic(self) -> None:
        """The batch dimension of every per-row (and per-prompt) tensor the step reads: one trace for all sizes."""
        cache = self.cache
        tensors = [getattr(self.state, name) for name in ROW_FIELDS]
        tensors += [t for store in (*cache.row_stores(), *cache.prefix_stores()) for t in store.values()]
        tensors.append(cache.prefix_visible)
        for tensor in tensors:
            if tensor is not None:
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
