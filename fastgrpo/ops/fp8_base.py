"""The frozen base's GEMMs in FP8 for training: patch_model(fp8_base=True).

Why: in a LoRA step of a large model the base GEMMs are most of the work: the forwards (reference log-probs, the
update's forward and its recompute) and the backward's input gradient. The base weights never change, so an e4m3
copy made once serves every one of them, and the FP8 tensor cores take each GEMM at about 1.5x bf16's speed (an H200,
Llama-3.1-8B's four GEMMs of a layer at 10,240 tokens: 3.85 ms with the activation quantizer against 5.99 in bf16,
benchmarks/NOTES.md). The adapters stay in the input's dtype; LoRA's weight gradients never read the base.

fp8_base_product(x, q, scale, bias) = (xq q^T) sx scale + bias, as fastgrpo.ops.fp8_scaled_linear computes it (each
row of x quantized like a weight row: |x - xq sx| <= 2^-4 |x| for normals), through torch._scaled_mm with row-wise
scales and the bias in its epilogue, out in bf16 (Hopper's row-wise kernel writes bf16 only), then x's dtype.
quantized_input(x) quantizes a layer's input once for the linears that read it: q, k and v (gate and up) get one
input object from the model, so the last input's e4m3 rows are kept while that tensor lives unchanged.
fp8_input_grad(g, q, scale) = g (q scale) with the weight's row scales moved into g (they lie along that GEMM's
sum) before g's rows are quantized the same way. Both quantizers are quantize_fp8's Triton kernel on CUDA
(torch ops elsewhere: the same bytes).

fp8_weight_of(layer) keeps the copy on the layer (an attribute, not a buffer: not saved, not moved by .to()) and
makes it again whenever the weight changes (in place, which bumps its version counter, or replaced; a trained one
also after each torch.optim optimizer step, which a fused optimizer takes without moving the counter); the rollout
engine's decode steps over the model's own weights take the copies its eager prefill checked (fp8_copies_held).
A .to() / .cpu() / .half() that changes the weight drops it at once (the layer's _apply is bound while it holds a
copy): the GPU copies of a model moved to the CPU lived on until its next forward.
"""
from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from fastgrpo.hf.binding import WeakBoundMethod
from fastgrpo.ops._backend import use_triton
from fastgrpo.ops.fp8_linear import quantize_fp8
from fastgrpo.ops.fp8_scaled_linear import scaled_mm_fits

FP8_WEIGHT_ATTR = "_fastgrpo_fp8_weight"
FP8_TRANSPOSED_ATTR = "_fastgrpo_fp8_weight_t"  # q^T of that copy, where a backward asked for it
FP8_CAPABILITY = (8, 9)  # e4m3 tensor cores: Ada, Hopper and later


# The last input quantized_input saw: (a weak reference to it, its version, (xq, sx)). One entry: a layer's
# siblings are called back to back, and an entry kept past its input's life would hold [N, K] bytes for nothing.
_last_input: list = [None]


def quantized_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8 of x's rows ([..., K] contiguous -> xq [N, K] e4m3, sx [N] fp32). The same tensor object at the
    same version as the last call's gets the last call's result: the model hands q, k and v (gate and up) one input
    object, so three quantizers (two) become one, in each forward and recompute. An in-place change moves the
    version (a new quantization); the entry goes with its tensor (a weak reference), so no other tensor that comes
    to live at its address can match it. Quantized at each call instead: an inference tensor (made under
    torch.inference_mode), which has no version to check, and under torch.compile, whose trace does not keep the
    identity test (the engine's decode step over the model's own weights got q/k/v's rows for down_proj's input)."""
    if x.is_inference() or torch.compiler.is_compiling():
        return quantize_fp8(x.reshape(-1, x.shape[-1]))
    entry = _last_input[0]
    if entry is not None and entry[0]() is x and entry[1] == x._version:
        return entry[2]
    quantized = quantize_fp8(x.reshape(-1, x.shape[-1]))
    _last_input[0] = (weakref.ref(x, _forget_input), x._version, quantized)
    return quantized


def _forget_input(ref: weakref.ref) -> None:
    entry = _last_input[0]
    if entry is not None and entry[0] is ref:
        _last_input[0] = None


def fp8_base_product(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None,
    quantized_x: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [N, K] (bf16, fp16 or fp32) times (q [M, K] e4m3, scale [M] fp32) + bias [M] -> [N, M] in x's dtype,
    written into `out` [N, M] where given (by the GEMM itself for bf16: no copy of [N, M]). quantized_x: x's rows
    quantized already (quantized_input), else quantized here."""
    xq, sx = quantize_fp8(x) if quantized_x is None else quantized_x
    bias = None if bias is None else bias.to(torch.bfloat16)
    direct = out if out is not None and out.dtype == torch.bfloat16 else None
    y = torch._scaled_mm(xq, q.t(), scale_a=sx[:, None], scale_b=scale[None, :], bias=bias,
                         out_dtype=torch.bfloat16, out=direct)
    if out is None:
        return y.to(x.dtype)
    if direct is None:
        out.copy_(y)
    return out


def fp8_input_grad(g: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, q_t: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """g [M, N] (the output's gradient) times the weight (q [N, K] e4m3, scale [N] fp32) -> g W [M, K] in g's dtype,
    on the FP8 tensor cores. The weight's row scales lie along this GEMM's sum, so they go into g before its rows are
    quantized (g_n scale_n: one fp32 multiply in the quantizer), and q is multiplied as it is, transposed into the
    column-major operand the GEMM takes: q_t (q^T contiguous) where the caller keeps one, else a transient copy."""
    gq, sg = quantize_fp8(g if g.stride(-1) == 1 else g.contiguous(), column_scale=scale)
    ones = _ones_row(q.shape[1], q.device)
    q_t = transposed(q) if q_t is None else q_t
    y = torch._scaled_mm(gq, q_t.t(), scale_a=sg[:, None], scale_b=ones, out_dtype=torch.bfloat16)
    return y.to(g.dtype)


@functools.cache
def _ones_row(n: int, device: torch.device) -> torch.Tensor:
    """[1, n] fp32 ones: the unit column scales of fp8_input_grad's GEMM, one tensor per width and device (made per
    call, it was an allocation and a fill kernel for each adapted linear in every backward). Read only."""
    return torch.ones(1, n, dtype=torch.float32, device=device)


def transposed(q: torch.Tensor) -> torch.Tensor:
    """q^T contiguous: the Triton tile transpose where Triton runs (torch's 1-byte strided copy is slow on CUDA)."""
    if not use_triton(q):
        return q.t().contiguous()
    from fastgrpo.kernels.transpose import transpose_bytes

    return transpose_bytes(q)


def fp8_weight_of(layer: nn.Linear) -> tuple[torch.Tensor, torch.Tensor] | None:
    """quantize_fp8(layer.weight) for fp8_base_product, made at the first call and again after the weight changed;
    None where _scaled_mm cannot take the shape (K and N multiples of 16): that layer multiplies in bf16."""
    weight = layer.weight
    if not scaled_mm_fits(*weight.shape):
        return None
    cached = layer.__dict__.get(FP8_WEIGHT_ATTR)
    if cached is not None and _copies_held[0]:  # the rollout's decode steps (fp8_copies_held): unchecked
        return cached[1]
    key = _weight_key(weight)
    if cached is None or cached[0] != key:
        check_fp8_device(weight.device)
        drop_fp8_weight(layer)  # the old copy goes before the new one is made
        cached = (key, quantize_fp8(weight.detach()))
        layer.__dict__[FP8_WEIGHT_ATTR] = cached
        if "_apply" not in layer.__dict__:  # else another library's: the copy waits for the next forward
            layer.__dict__["_apply"] = WeakBoundMethod(_apply_dropping_stale_copy, layer)
    return cached[1]


# True while the rollout engine decodes over the model's own weights: nothing changes them between its eager prefill,
# which checked every copy, and its last step
_copies_held = [False]


@contextlib.contextmanager
def fp8_copies_held():
    """While entered, fp8_weight_of takes each layer's copy as it is, unchecked: the engine's compiled decode step
    over the model's own weights read each copy's key (its weight's address, one per layer) in the trace and compiled
    again for every linear of every layer, past dynamo's limit of 8 (the rest ran eagerly)."""
    held = _copies_held[0]
    _copies_held[0] = True
    try:
        yield
    finally:
        _copies_held[0] = held


# Optimizer steps taken since a trained weight's copy was first made (a torch.optim global hook, registered then):
# part of a trained weight's key, because fused optimizers (torch's fused AdamW, fastgrpo's stochastic-rounding one)
# write the weights in place without moving their version counters
_optimizer_steps = [0]
_step_hook: list = [None]


def _count_step(optimizer, args, kwargs) -> None:
    _optimizer_steps[0] += 1


def _weight_key(weight: torch.Tensor) -> tuple:
    if weight.requires_grad and _step_hook[0] is None:
        _step_hook[0] = register_optimizer_step_post_hook(_count_step)
    steps = _optimizer_steps[0] if weight.requires_grad else None
    return weight.data_ptr(), weight._version, weight.device, weight.dtype, steps


def _apply_dropping_stale_copy(layer: nn.Module, *args, **kwargs) -> nn.Module:
    """nn.Module._apply (what .to(), .cuda(), .half() run on every submodule), then the e4m3 copy goes if the weight
    it was made from moved or changed."""
    result = type(layer)._apply(layer, *args, **kwargs)
    cached = layer.__dict__.get(FP8_WEIGHT_ATTR)
    if cached is not None and cached[0] != _weight_key(layer.weight):
        drop_fp8_weight(layer)
    return result


def fp8_transposed_of(layer: nn.Linear, q: torch.Tensor) -> torch.Tensor:
    """q^T contiguous of the layer's copy q (fp8_weight_of's), kept on the layer beside it until that copy changes:
    fp8_input_grad's operand, transposed once instead of at every backward."""
    kept = layer.__dict__.get(FP8_TRANSPOSED_ATTR)
    if kept is None or kept[0] is not q:
        kept = (q, transposed(q))
        layer.__dict__[FP8_TRANSPOSED_ATTR] = kept
    return kept[1]


def drop_fp8_weight(layer: nn.Module) -> None:
    """The e4m3 copy (and its transpose) goes, and the _apply bound with it."""
    layer.__dict__.pop(FP8_WEIGHT_ATTR, None)
    layer.__dict__.pop(FP8_TRANSPOSED_ATTR, None)
    bound = layer.__dict__.get("_apply")
    if isinstance(bound, WeakBoundMethod) and bound.__func__ is _apply_dropping_stale_copy:
        del layer.__dict__["_apply"]


def check_fp8_device(device: torch.device) -> None:
    """One line where the GPU has no FP8 tensor cores, or where this torch's CPU _scaled_mm (the tests' software
    path) takes no row-wise scales (torch 2.11's: an internal assert)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
        found = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise ValueError(f"fp8_base: needs a GPU with FP8 tensor cores (compute capability 8.9 or later: Ada, "
                         f"Hopper), and {device} ({torch.cuda.get_device_name(device)}) is {found}")
    if device.type == "cpu" and not _cpu_takes_row_scales():
        raise ValueError(f"fp8_base: runs on the CPU only where torch's CPU _scaled_mm takes row-wise scales, which "
                         f"torch {torch.__version__}'s does not; run the model on an FP8 GPU, or patch it without "
                         "fp8_base")


@functools.cache
def _cpu_takes_row_scales() -> bool:
    a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True
