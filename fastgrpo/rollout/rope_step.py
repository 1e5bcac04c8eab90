"""Decode steps run the rotary modules without HF's per-call frequency update, so a step can be a CUDA graph.

For rope types "dynamic" and "longrope", HF's rotary forward first updates its frequencies from the longest position
it is given (transformers.modeling_rope_utils.dynamic_rope_update). transformers 5.17 decides both updates on the host,
a device sync at every decode step: the step's CUDA-graph capture failed and the engine fell back to the un-graphed
compiled step (benchmarks/NOTES_rollout.md, "Rope variants on CUDA"). 5.24 made the longrope one traceable, not the
dynamic one.

Within a rollout the update changes nothing after the prefill, which runs HF's decorated forward:
- longrope uses the short or the long factors by the longest sequence; rope_limits.check_rope_switch refuses a
  rollout whose rows could straddle the threshold, so the prefill's choice holds at every step.
- dynamic rescales only past max_position_embeddings, which requests.check_lengths refuses to reach; its reset to
  the original frequencies (after a longer sequence, e.g. in training) fires at the prefill, before any step.
So for the decode loop (warm-up, capture, replay and the fallbacks alike) each such module runs its class's forward
without the update (hf/rope_update.py), bound on the instance and restored afterwards (hf/binding.py): the prefill,
HF's own calls and training keep the update. Modules whose forward in effect is not the class's (bound by someone
else) keep theirs.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from fastgrpo.hf.binding import as_method, bind_forward
from fastgrpo.hf.rope_update import position_updated_rotaries


@contextlib.contextmanager
def rotary_without_updates(model: nn.Module) -> Iterator[None]:
    """Within the block the rotary modules HF updates by position run their forward without the update."""
    with contextlib.ExitStack() as undo:
        for module, without in position_updated_rotaries(model):
            binding = bind_forward(module, lambda _previous, forward=without: forward)
            if getattr(binding.previous, "__func__", None) is type(module).forward:
                undo.callback(binding.restore)
                as_method(module, undo)  # compile_scope="step" traces it: one compile for every rollout
            else:  # a forward bound by someone else, which may not be HF's: it stays
                binding.restore()
        yield
