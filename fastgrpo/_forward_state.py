"""ForwardState: where the RNG and autocast stood when a forward ran, so that a recompute in the backward runs it
again alike (dropout draws the same numbers), as torch's checkpoint does."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class ForwardState:
    """The CPU RNG, the RNG of `device` when it is a CUDA device, and `device`'s autocast setting, taken now."""

    __slots__ = ("device", "autocast_on", "autocast_dtype", "cpu_rng", "cuda_rng")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.autocast_on = torch.is_autocast_enabled(device.type)
        self.autocast_dtype = torch.get_autocast_dtype(device.type)
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def rng_restored(self) -> Iterator[None]:
        """Grad enabled and the RNG as it was; the caller's RNG is left as it found it."""
        with torch.random.fork_rng(devices=[self.device] if self.cuda_rng is not None else []), torch.enable_grad():
            torch.set_rng_state(self.cpu_rng)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state(self.cuda_rng, self.device)
            yield

    def autocast(self) -> torch.autocast:
        """Autocast as it was, for the forward run again only: its backward runs outside, as after any forward."""
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_on)
