"""Token-tiled MLP: a decoder layer's MLP run over chunks of tokens, keeping only its input for the backward.

An untiled Qwen2.5-1.5B MLP at 8 x 8192 tokens keeps gate, up and act(gate) * up for the backward (and, with LoRA,
each adapted linear's input): 64K x 8960 x 2 B = 1.1 GiB each, the bulk of one layer's recompute activations.
Tiled, the forward runs chunk by chunk under no_grad and saves x alone; the backward recomputes one chunk at a time
with grad and backpropagates it, so one chunk's intermediates exist at once (8192 tokens: 140 MiB each).

Two autograd nodes, so that a checkpoint's recompute does not run the MLP:
    _SavedInput(x, *params) -> token   saves x; its backward recomputes the chunks, returns dx and the param grads
    _ChunkedForward(token, x) -> out   runs the chunks under no_grad, saves nothing; its backward passes dout on
A Function's saved tensors are packed after its forward returns, and torch's non-reentrant checkpoint stops its
recompute at the pack of the last tensor the forward saved (early stop, on by default). Were x saved by the node
that computes, the recompute would run the whole chunked MLP before that pack. Saved by a node of its own that runs
first, x is packed before the MLP: where the MLP is the layer's last op that saves anything (llama, mistral, qwen,
phi3) the recompute stops there, and the MLP forward runs twice per step, as with plain checkpointing. Gemma2/3
normalize the MLP output (that norm saves it), so their recompute runs the MLP: three forwards per step.

A recompute that builds the whole layer's graph again (fastgrpo.offload's recompute in the backward) cannot stop
early; instead it runs under `outputs_unread()`, where _ChunkedForward puts a NaN placeholder in the graph and runs no
chunk. Exact where the MLP output goes only into the residual add, whose backward reads no values (the same
architectures as above): the gradient still flows through both nodes to _SavedInput's chunked backward. Where
something did read it (a norm), the NaNs would reach the gradients: loud, not silently wrong.

Parameter grads are returned through autograd (accumulated over chunks in fp32), so .backward() and
torch.autograd.grad both work. Dropout inside the MLP (LoRA dropout) sees the same random numbers in the
recompute: the RNG state is restored, as torch's checkpoint does.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
from torch import nn

from fastgrpo._checks import check_floating, check_positive_int
from fastgrpo._forward_state import ForwardState

# 8192 tokens: gate, up and their product of a Qwen2.5-1.5B MLP (I = 8960) are 140 MiB each in bf16.
DEFAULT_CHUNK_TOKENS = 8192
# patch_model's default: chunks whose widest intermediate ([chunk, I]; Phi-3's gate_up [chunk, 2I]) is at most
# 256 MiB (Qwen2.5-1.5B in bf16: 14976 tokens; Llama-3.1-8B, I = 14336: 9344). Fewer tokens run untiled: tiling a
# few thousand tokens saves little memory and costs host time per chunk (a Qwen2.5-1.5B LoRA update of 8 micro-batches
# of 8 x 1280 tokens, offloaded: 2.81 s with 8192-token chunks, 2.32 s untiled, +0.12 GiB peak; one H100,
# results/update_profile-nvidia-h100-80gb-hbm3.json, config.later_runs).
DEFAULT_CHUNK_BYTES = 256 << 20
# Per thread: the backward of a CUDA tensor runs in autograd's device thread, where the recompute sets it.
_UNREAD = threading.local()


@contextlib.contextmanager
def outputs_unread() -> Iterator[None]:
    """Within: a tiled MLP's output is a NaN placeholder and its chunks do not run (module docstring), for a recompute
    whose caller knows that nothing reads the MLP output's values."""
    previous = getattr(_UNREAD, "on", False)
    _UNREAD.on = True
    try:
        yield
    finally:
        _UNREAD.on = previous


def chunk_tokens_for(intermediate_size: int, element_size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk (a multiple of 128, at least 128) whose [chunk, intermediate_size] intermediates of
    element_size bytes take at most chunk_bytes each."""
    check_positive_int("intermediate_size", intermediate_size)
    check_positive_int("element_size", element_size)
    return max(128, chunk_bytes // (intermediate_size * element_size) // 128 * 128)


def _chunked_forward(forward: Callable, x2: torch.Tensor, chunk_tokens: int, width: int) -> torch.Tensor:
    """forward over row chunks of x2 [N, H] into one [N, width] output (no list + cat: that would hold it twice)."""
    out = None
    for start in range(0, x2.shape[0], chunk_tokens):
        xc = x2[start : start + chunk_tokens]  # xc: [n, H]
        y = forward(xc)  # y: [n, width]
        if y.shape != (xc.shape[0], width):
            raise ValueError(
                f"module: tiled_mlp needs a forward mapping [..., {x2.shape[-1]}] to [..., {width}], "
                f"got {list(y.shape)} from {list(xc.shape)}"
            )
        if out is None:
            out = y.new_empty(x2.shape[0], width)
        out[start : start + xc.shape[0]] = y
    return out


class _SavedInput(torch.autograd.Function):
    """Saves x (and where the RNG and autocast stood); its backward is the MLP's backward, chunk by chunk."""

    @staticmethod
    def forward(ctx, x, forward, chunk_tokens, *params):
        ctx.save_for_backward(x)
        ctx.forward, ctx.chunk_tokens, ctx.params = forward, chunk_tokens, params
        ctx.state = ForwardState(x.device)
        # token: [..., H] carries d(out) from _ChunkedForward back to this node; a 0-stride view, no memory.
        return x.new_zeros(()).expand(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():
            raise RuntimeError("tiled_mlp: double backward (create_graph=True) is not supported")
        (x,) = ctx.saved_tensors
        x2 = x.detach().reshape(-1, x.shape[-1])  # x2: [N, H]
        grad2 = grad_out.reshape(-1, grad_out.shape[-1])  # grad2: [N, H]
        want_x = ctx.needs_input_grad[0]
        grad_x = torch.empty_like(x2) if want_x else None
        acc: list[torch.Tensor | None] = [None] * len(ctx.params)
        with ctx.state.rng_restored():
            # Chunks in forward order: dropout draws the random numbers the forward drew.
            for start in range(0, x2.shape[0], ctx.chunk_tokens):
                xc = x2[start : start + ctx.chunk_tokens].detach().requires_grad_(want_x)  # xc: [n, H]
                with ctx.state.autocast():
                    yc = ctx.forward(xc)
                inputs = ([xc] if want_x else []) + list(ctx.params)
                grads = torch.autograd.grad(
                    yc, inputs, grad2[start : start + xc.shape[0]].to(yc.dtype), allow_unused=True
                )
                if want_x:
                    grad_x[start : start + xc.shape[0]] = grads[0]
                for i, g in enumerate(grads[len(inputs) - len(acc) :]):
                    if g is None:
                        continue
                    # fp32 accumulation across chunks (fp64 stays fp64); cast once below.
                    g = g.to(torch.promote_types(g.dtype, torch.float32))
                    acc[i] = g if acc[i] is None else acc[i].add_(g)
        param_grads = [None if a is None else a.to(p.dtype) for a, p in zip(acc, ctx.params)]
        return (None if grad_x is None else grad_x.view(x.shape)), None, None, *param_grads


class _ChunkedForward(torch.autograd.Function):
    """The MLP output, chunk by chunk under no_grad; nothing saved: the gradient goes on to _SavedInput's token."""

    @staticmethod
    def forward(ctx, token, x, forward, chunk_tokens):
        if getattr(_UNREAD, "on", False):
            return x.new_full(x.shape, float("nan"))
        x2 = x.reshape(-1, x.shape[-1])  # x2: [N, H]
        return _chunked_forward(forward, x2, chunk_tokens, x.shape[-1]).view(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, None, None, None


def tiled_mlp(
    module: nn.Module,
    x: torch.Tensor,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """module's MLP applied to x [..., H] -> [..., H], over chunks of `chunk_tokens` tokens (rows of x).

    forward: what computes one chunk (default module.forward; patch_model passes the forward it wraps). Gradients
        go to x and to module's parameters that require grad; other tensors the forward reads get none.
    Inputs of at most chunk_tokens tokens run forward(x) as is. Under no_grad (or with nothing requiring grad)
    the chunks just run. Otherwise only x is kept for the backward, which recomputes each chunk.
    """
    check_floating("x", x)
    if x.dim() < 1:
        raise ValueError("x: expected a tensor of shape [..., H], got a scalar")
    check_positive_int("chunk_tokens", chunk_tokens)
    forward = module.forward if forward is None else forward
    if x.numel() // max(x.shape[-1], 1) <= chunk_tokens:
        return forward(x)
    params = tuple(p for p in module.parameters() if p.requires_grad)
    if not (torch.is_grad_enabled() and (x.requires_grad or params)):
        with torch.no_grad():
            return _chunked_forward(forward, x.reshape(-1, x.shape[-1]), chunk_tokens, x.shape[-1]).view(x.shape)
    token = _SavedInput.apply(x, forward, chunk_tokens, *params)
    return _ChunkedForward.apply(token, x, forward, chunk_tokens)
