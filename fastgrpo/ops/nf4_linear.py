"""NF4 weight-only linear over a bitsandbytes 4-bit weight: the unpacked parts, the dequantizer, the eager path, the op.

`nf4_linear(x, weight4, quant_state, bias)` = x dequant(W)^T + bias for a bitsandbytes Params4bit weight of
quant_type "nf4" (compress_statistics on or off, any blocksize that divides K): the Triton kernel
(fastgrpo.kernels.nf4_linear, which documents the format) on CUDA tensors or under TRITON_INTERPRET=1, else
`nf4_linear_torch`: `dequantize_nf4` (bitsandbytes' dequantize_4bit, bit for bit, in plain torch) in x's dtype and
F.linear, the math of bitsandbytes' own forward (so the engine runs on the CPU). `nf4_weight` reads a weight and its
QuantState into `Nf4Weight`, plain tensors and ints that torch.compile guards by shape and value, not by identity
(the engine keeps one per layer for the rollout: no copy of any weight). K not a multiple of the blocksize (a block
would straddle rows) is refused (ValueError); the engine leaves such layers on their own forward. No autograd: the
rollout runs under no_grad. A torch.library custom op, opaque to torch.compile; no host syncs (CUDA-graph safe).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from fastgrpo._checks import check_dtype, check_shape
from fastgrpo.ops._backend import use_triton

_ACTIVATIONS = (torch.float16, torch.bfloat16, torch.float32)
MAX_BLOCKSIZE = 256  # the kernel's K tile holds whole blocks; bitsandbytes allows up to 4096


class Nf4Weight(NamedTuple):
    """A bitsandbytes NF4 weight W [N, K], unpacked (views of its own tensors: nothing is copied)."""

    packed: torch.Tensor  # [N K / 2] uint8, element f in byte f // 2, high nibble first
    absmax: torch.Tensor  # [N K / blocksize]: fp32, or uint8 codes when nested
    code: torch.Tensor  # [16] fp32, the NF4 values
    absmax_code: Optional[torch.Tensor]  # nested: [256] fp32, the absmax codes' values
    absmax_scale: Optional[torch.Tensor]  # nested: [ceil(N K / blocksize / nested_blocksize)] fp32
    offset: Optional[torch.Tensor]  # nested: [] fp32, added to every absmax
    N: int
    K: int
    blocksize: int
    nested_blocksize: int  # 0 when not nested


def nf4_refusal(weight4: torch.Tensor, quant_state) -> str | None:
    """Why nf4_linear cannot take this weight, or None when it can."""
    if quant_state is None or getattr(quant_state, "quant_type", None) != "nf4":
        return f"quant_type {getattr(quant_state, 'quant_type', None)!r} is not 'nf4'"
    if getattr(quant_state, "packing_format_for_cpu", False):
        return "the weight was repacked for bitsandbytes' CPU kernel (a different layout)"
    shape = tuple(quant_state.shape)
    if len(shape) != 2:
        return f"weight shape {list(shape)} is not [N, K]"
    N, K = shape
    if K % quant_state.blocksize:
        return f"K={K} is not a multiple of blocksize {quant_state.blocksize} (a block would straddle rows)"
    if weight4.dtype != torch.uint8 or weight4.numel() * 2 != N * K:
        return f"packed weight {weight4.dtype} with {weight4.numel()} bytes, expected uint8 with N K / 2 = {N * K // 2}"
    if quant_state.blocksize > MAX_BLOCKSIZE:
        return f"blocksize {quant_state.blocksize} > {MAX_BLOCKSIZE} (a tile spans a block: too large a tile)"
    if not weight4.is_contiguous() or not quant_state.absmax.is_contiguous():
        return "a strided packed weight or absmax (the kernel reads them flat)"
    if quant_state.nested and quant_state.absmax.dtype != torch.uint8:
        return f"nested absmax of dtype {quant_state.absmax.dtype}, expected uint8 codes"
    if quant_state.nested and quant_state.state2.absmax.dtype != torch.float32:
        return f"nested scales of dtype {quant_state.state2.absmax.dtype}, expected fp32 (the absmax arithmetic)"
    return None


def nf4_weight(weight4: torch.Tensor, quant_state) -> Nf4Weight:
    """The parts of a bitsandbytes NF4 weight (packed [N K / 2, 1] uint8 and its QuantState) as an Nf4Weight;
    ValueError with nf4_refusal's reason for a weight the kernel cannot read."""
    reason = nf4_refusal(weight4, quant_state)
    if reason is not None:
        raise ValueError(f"nf4_linear: {reason}")
    N, K = quant_state.shape
    code = quant_state.code.to(torch.float32)
    if quant_state.nested:
        state2 = quant_state.state2
        return Nf4Weight(weight4.reshape(-1), quant_state.absmax, code, state2.code.float(), state2.absmax.float(),
                         quant_state.offset.float().reshape(()), N, K, quant_state.blocksize, state2.blocksize)
    return Nf4Weight(weight4.reshape(-1), quant_state.absmax.float(), code, None, None, None, N, K,
                     quant_state.blocksize, 0)


def block_absmax(w: Nf4Weight) -> torch.Tensor:
    """[N K / blocksize] fp32: the absmax of each block, the nested ones dequantized as bitsandbytes does (the
    product and the sum each rounded to fp32)."""
    if w.absmax_code is None:
        return w.absmax
    codes = w.absmax.long()
    return w.absmax_code[codes] * w.absmax_scale[torch.arange(len(codes), device=codes.device) // w.nested_blocksize] \
        + w.offset


def dequantize_nf4(w: Nf4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [N, K] in `dtype`: code[q] absmax in fp32, rounded once (exact in fp32 and fp64)."""
    nibbles = torch.stack([w.packed >> 4, w.packed & 15], 1).reshape(-1).long()  # high nibble first
    values = w.code[nibbles].reshape(-1, w.blocksize) * block_absmax(w)[:, None]
    return values.to(dtype).reshape(w.N, w.K)


def nf4_linear_torch(x: torch.Tensor, w: Nf4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize_nf4(w, x.dtype)^T + bias, in x's dtype (bitsandbytes' forward)."""
    return F.linear(x, dequantize_nf4(w, x.dtype), None if bias is None else bias.to(x.dtype))


# the schema is inferred from the annotations: Optional[...], the form torch.library documents
@torch.library.custom_op("fastgrpo::nf4_linear", mutates_args=())
def _nf4_linear_op(
    x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
    absmax_code: Optional[torch.Tensor], absmax_scale: Optional[torch.Tensor], offset: Optional[torch.Tensor],
    bias: Optional[torch.Tensor], N: int, K: int, blocksize: int, nested_blocksize: int,
) -> torch.Tensor:
    w = Nf4Weight(packed, absmax, code, absmax_code, absmax_scale, offset, N, K, blocksize, nested_blocksize)
    if not use_triton(x, packed):
        return nf4_linear_torch(x, w, bias)
    from fastgrpo.kernels.nf4_linear import nf4_linear_fwd

    return nf4_linear_fwd(x, packed, absmax, code, absmax_code, absmax_scale, offset, bias, N, blocksize,
                          nested_blocksize)


@_nf4_linear_op.register_fake
def _(x, packed, absmax, code, absmax_code, absmax_scale, offset, bias, N, K, blocksize, nested_blocksize):
    return x.new_empty(x.shape[0], N)


def nf4_linear_unpacked(x: torch.Tensor, w: Nf4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (fp16, bf16 or fp32), an Nf4Weight, bias [N] -> [..., N] in x's dtype."""
    check_dtype("x", x, _ACTIVATIONS)
    check_shape("x", x, (*x.shape[:-1], w.K))
    if bias is not None:
        check_shape("bias", bias, (w.N,))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    bias = bias.contiguous() if bias is not None else None
    out = _nf4_linear_op(x2, w.packed, w.absmax, w.code, w.absmax_code, w.absmax_scale, w.offset, bias,
                         w.N, w.K, w.blocksize, w.nested_blocksize)
    return out.reshape(*lead, w.N)


def nf4_linear(x: torch.Tensor, weight4: torch.Tensor, quant_state, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(weight4)^T + bias for a bitsandbytes NF4 weight (packed uint8 and its QuantState)."""
    return nf4_linear_unpacked(x, nf4_weight(weight4, quant_state), bias)


def prepare_nf4_linear(device: torch.device) -> None:
    """Allocate the kernel's per-device split-K tickets (fp8_linear's) now, before any CUDA graph capture."""
    if device.type == "cuda":
        from fastgrpo.kernels.fp8_linear import prepare

        prepare(device)
