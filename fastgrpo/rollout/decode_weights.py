"""The weights the decode steps multiply (EngineConfig.weights): the model's own, or a copy of them made for the
decode of one rollout, "fp8" or "w8a8" (e4m3), "dense" or "fused" (the model's dtype), or a 4-bit base's own
packed weights read by a W4A16 kernel ("nf4").

Why: a decode step of 64 rows reads every weight once for ~128 FLOPs per byte, so its GEMMs cost what the weight
reads cost (benchmarks/NOTES_rollout.md). "fp8": per-channel e4m3 copies (fastgrpo.ops.fp8_linear, W8A16) halve
those reads. "w8a8": the same copy, multiplied on the FP8 tensor cores with each step's activations quantized per
row to e4m3 (fastgrpo.ops.fp8_scaled_linear): a second rounding of 2^-4 relative, so "auto" never picks it (nor
"fp8"). "dense": a plain copy in the model's dtype, for models whose own linears do more than one GEMM per
step: a bitsandbytes 4-bit base (dequantized per call) then decodes with the GEMMs of a bf16 base of its shape,
and a LoRA layer with one GEMM instead of three. Sibling linears that read the same input (q/k/v, gate/up;
Architecture.decode_fused_projections) run as one GEMM over their stacked copies where every member is copied
anyway ("fp8" and "w8a8" copy all; "dense" the LoRA and 4-bit ones), as vLLM runs them: a 64-row GEMM per
projection is too small to reach the weight-read roofline (Qwen2.5-1.5B's K/V projections are 256 wide), and each
is a launch and a graph node. "fused" is "dense" that stacks plain siblings too: a copy of their weights for fewer
GEMMs.

When decoding starts, every dense linear of the model (hf.peft.dense_linears: nn.Linear, lm_head included, a
4-bit base dequantized, a LoRA layer with its adapters merged in fp32) gets a copy of its weight as it is now, and
its forward becomes one GEMM over that copy; when decoding ends the forwards come back and the copy is freed. So a
4-bit base is dequantized once per rollout, not per token, and the trainer's parameters and their grads are only
read. The prefill keeps the model's own weights (its GEMMs have B x P rows: not bandwidth-bound). Memory for the
call (copy_bytes): fp8 and w8a8, 1 byte per weight plus 4 per output channel, about half the bf16 weights; dense,
the element size per weight that had to be made (a plain weight of the model's dtype is not copied); "fused", also
the plain siblings it stacks. The build holds one layer's fp32 temporaries at a time.

How the forward is swapped: the module's class becomes a subclass of it whose forward is the one GEMM (made once
per class), and the copy's tensors are attributes of the module; an instance-level forward (patch_model's) is
moved aside meanwhile. torch.compile then guards on the class and on the tensors' shapes and dtypes, both the same
for every layer and every rollout: a callable object installed per module would be guarded by identity, a new
trace per layer (for per-layer compiled code) and per rollout. The copy's kind is an attribute too (a string, the
same in every module: guarded by value), read by the forward to pick the GEMM. A fused member holds its group
(modules, reached as attributes like the model's own submodules) and hands each sibling its slice of the output as
an attribute for the sibling's call with the same input; the members of a traced layer do that inside the trace.

"nf4": no copy. Each bitsandbytes NF4 base among the dense linears (a LoRA layer's base_layer, or a plain Linear4bit)
that fastgrpo.ops.nf4_linear can read (K a multiple of the blocksize, not repacked for bitsandbytes' CPU kernel)
runs nf4_linear on its own packed weight: 0.5 bytes a weight read per step, a quarter of a bf16 copy's, and no
dequantization in memory (bitsandbytes' own forward writes and reads the whole bf16 weight per call). The rest keeps
its forward: PEFT computes the LoRA branch as it does (three GEMMs instead of "dense"'s one: the adapters are small),
plain linears (lm_head) multiply their own weights, q/k/v and gate/up stay separate GEMMs (stacking them would copy
the 4-bit weights). Swapped the same way (class and per-module attributes: the NF4 parts, views of the weight's own
tensors, and the compute dtype). "auto" takes it when no copy fits: slower than a "dense" copy, much faster than
bitsandbytes' forward (auto_weights).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from fastgrpo.hf.models import architecture
from fastgrpo.hf.peft import dense_linears, dense_weight, four_bit_parts
from fastgrpo.ops.fp8_base import fp8_copies_held
from fastgrpo.ops.fp8_linear import FP8_DTYPE, fp8_linear, prepare_fp8_linear, quantize_fp8
from fastgrpo.ops.fp8_scaled_linear import fp8_scaled_linear
from fastgrpo.ops.nf4_linear import nf4_linear_unpacked, nf4_refusal, nf4_weight, prepare_nf4_linear

WEIGHTS = ("auto", "model", "fp8", "w8a8", "dense", "fused", "nf4")
COPIES = ("fp8", "w8a8", "dense", "fused")  # the kinds copied_weights builds
FP8_COPIES = ("fp8", "w8a8")  # the kinds whose copy is quantize_fp8's
# "auto" makes a copy only with this much device memory to spare after it (the decode step's temporaries)
AUTO_HEADROOM_BYTES = 1 << 30
# and with room to build it: bytes per weight of the largest layer whose copy is made while dense_weight merges it
# (a 4-bit base dequantized to bf16, 2; its fp32 copy, 4; the adapter's fp32 delta and its scaled copy, 4 + 4;
# their sum, 4), one layer at a time. Without it a Llama-3.1-8B QLoRA rollout in a 24 GiB cap picked a copy that
# fit and ran out of memory building it.
BUILD_BYTES_PER_WEIGHT = 18
# the copy's attributes on a module: e4m3 weight [N, K] and fp32 scale [N] (FP8_COPIES), weight [N, K] ("dense"),
# bias [N]; and every swapped module's (group members' too): the copy's kind
_ATTRS = ("fastgrpo_copy_q", "fastgrpo_copy_scale", "fastgrpo_copy_weight", "fastgrpo_copy_bias")
_KIND = "fastgrpo_copy_kind"
# a fused group member's: the group's stacked copy (the four above, rows in member order), its members' output
# sizes, its members (this one included), and (input, output) that a sibling computed for this module
_GROUP_ATTRS = ("fastgrpo_group_q", "fastgrpo_group_scale", "fastgrpo_group_weight", "fastgrpo_group_bias",
                "fastgrpo_group_sizes", "fastgrpo_group", "fastgrpo_pending")


def _gemm(kind: str, x: torch.Tensor, q, scale, weight, bias) -> torch.Tensor:
    """The copy's one GEMM: x (q scale)^T + bias for the FP8 kinds, else x weight^T + bias."""
    if kind == "w8a8":
        return fp8_scaled_linear(x, q, scale, bias)
    if kind == "fp8":
        return fp8_linear(x, q, scale, bias)
    return F.linear(x, weight, bias)


def _copy_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A dense linear's forward during decoding: one GEMM over the copy of its weight."""
    return _gemm(self.fastgrpo_copy_kind, x, self.fastgrpo_copy_q, self.fastgrpo_copy_scale,
                 self.fastgrpo_copy_weight, self.fastgrpo_copy_bias)


def _group_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A fused group member's forward during decoding (q/k/v, gate/up: siblings that read the same input): the
    output a sibling already computed from this very input, or one GEMM over the group's stacked copy, whose
    other slices wait on the siblings for their call with the same input (HF's forwards call them in a row)."""
    pending = self.fastgrpo_pending
    if pending is not None:
        self.fastgrpo_pending = None
        if pending[0] is x:
            return pending[1]
    out = _gemm(self.fastgrpo_copy_kind, x, self.fastgrpo_group_q, self.fastgrpo_group_scale,
                self.fastgrpo_group_weight, self.fastgrpo_group_bias)
    mine = None
    for member, piece in zip(self.fastgrpo_group, out.split(self.fastgrpo_group_sizes, dim=-1)):
        if member is self:
            mine = piece
        else:
            member.fastgrpo_pending = (x, piece)
    return mine


def _nf4_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A 4-bit base's forward during decoding ("nf4"): nf4_linear over its own packed weight, x cast to the compute
    dtype and the output back, as bitsandbytes' forward does."""
    dtype = self.fastgrpo_nf4_dtype or x.dtype
    return nf4_linear_unpacked(x.to(dtype), self.fastgrpo_nf4, self.bias).to(x.dtype)


@functools.cache
def _copy_class(base: type, forward=_copy_forward) -> type:
    """`base` with the copy's forward: one subclass per class and forward, shared by every module of that class
    (its name kept, for code that looks classes up by name)."""
    return type(base.__name__, (base,), {"forward": forward, "__module__": __name__})


def decode_weights(model: torch.nn.Module, weights: str) -> contextlib.AbstractContextManager:
    """The context the engine decodes in: the model's own weights ("model"), a copy of them (COPIES), or the W4A16
    kernel over a 4-bit base's own weights ("nf4"); "auto" is resolved_weights'."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights: expected one of {list(WEIGHTS)}, got {weights!r}")
    kind = resolved_weights(model, weights)
    if kind == "model":  # an fp8_base model's e4m3 copies, checked by the prefill, are taken as they are
        return fp8_copies_held()
    if kind == "nf4":
        return nf4_weights(model)
    return _copy_or_fallback(model, kind, _nf4_device(model)) if weights == "auto" else copied_weights(model, kind)


@contextlib.contextmanager
def _copy_or_fallback(model: torch.nn.Module, kind: str, nf4: bool = True) -> Iterator[list[torch.nn.Module]]:
    """copied_weights(model, kind) for "auto". If building the copy runs out of device memory anyway (the room is
    an estimate, and the allocator's free blocks may be fragmented): the smaller "dense" copy where "fused" was
    taken and one exists, else "nf4" where auto_weights would fall back to it (`nf4`: the device runs the kernel),
    else the model's own weights, with a warning each time: the choice was ours, so it must not end the user's run."""
    kinds = [kind]
    if kind == "fused" and 0 < copy_bytes(model, "dense") < copy_bytes(model, "fused"):
        kinds.append("dense")
    with contextlib.ExitStack() as stack:
        modules = []
        for i, candidate in enumerate(kinds):
            try:
                modules = stack.enter_context(copied_weights(model, candidate))
                break
            except torch.OutOfMemoryError:
                pass  # the partial copy is freed with the exception, after this block
            torch.cuda.empty_cache()
            following = kinds[i + 1] if i + 1 < len(kinds) else "nf4" if nf4 and _nf4_fallback(model) else "model"
            then = "the model's own weights" if following == "model" else repr(following)
            warnings.warn(f"rollout: weights='auto' took {candidate!r}, whose copy ran out of device memory while it "
                          f"was built; decoding with {then}", stacklevel=4)
        else:  # every copy ran out of memory
            if following == "nf4":
                modules = stack.enter_context(nf4_weights(model))
        yield modules


def resolved_weights(model: torch.nn.Module, weights: str) -> str:
    """"auto", for a model on CUDA: "fused" when its copy fits the memory free now, with room to build it
    (build_bytes) and AUTO_HEADROOM_BYTES to spare, else "dense" when a LoRA or 4-bit model's copy does, else
    "nf4" (_nf4_device, _nf4_fallback), else "model" (and "model" off CUDA). On an H100,
    "fused" took a bf16 decode step from 3.57 to 3.26 ms (Qwen2.5-1.5B shapes) and 10.0 to 9.57 ms (Llama-3.1-8B)
    for a copy of q/k/v and gate/up (benchmarks/NOTES_rollout.md); a LoRA model on all linears copies the same
    bytes for "dense" and "fused". Anything else is returned as it is."""
    if weights != "auto":
        return weights
    device = model.get_input_embeddings().weight.device
    if device.type != "cuda":
        return "model"
    free, _ = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    free += torch.cuda.memory_reserved(device) - allocated  # the allocator's cached blocks
    # a cap set with torch.cuda.set_per_process_memory_fraction (how a 24 GB card is emulated on a larger one): a
    # fraction of the device's memory, not of mem_get_info's total (which an emulation may report as the cap)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)(device)
    card = torch.cuda.get_device_properties(device).total_memory
    return auto_weights(model, min(free, int(fraction * card) - allocated), _nf4_device(model))


def auto_weights(model: torch.nn.Module, free: int, nf4: bool = True) -> str:
    """What "auto" resolves to with `free` bytes of device memory: the first of "fused" and "dense" whose copy
    fits; else "nf4" where `nf4` (the device runs the kernel) and _nf4_fallback(model); else "model". On an H100
    a Llama-3.1-8B QLoRA decode step of 64 rows took 17.5 ms with "nf4", 15.6 with "dense" and 42.8 on
    bitsandbytes' own forward (benchmarks/NOTES_rollout.md): "nf4" is the fallback, not a first choice."""
    build = build_bytes(model)
    for kind in ("fused", "dense"):
        if copy_fits(copy_bytes(model, kind), free, build):
            return kind
    return "nf4" if nf4 and _nf4_fallback(model) else "model"


def _nf4_device(model: torch.nn.Module) -> bool:
    """Whether the model's device runs nf4_linear's kernel for "auto": CUDA of compute capability 8.0 or newer
    (bf16 / fp16 tensor-core dots; only sm_90 was run)."""
    device = model.get_input_embeddings().weight.device
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def _nf4_fallback(model: torch.nn.Module) -> bool:
    """Whether "auto" may decode with "nf4": the model has NF4 bases nf4_linear reads, all computing in a 16-bit
    dtype (the measured path; an fp32 compute dtype runs the kernel's fp32 dots, not measured against
    bitsandbytes)."""
    modules = nf4_linears(model)
    fallback = model.get_input_embeddings().weight.dtype  # a 4-bit layer without a compute dtype casts to x's
    return bool(modules) and all((four_bit_parts(m)[2] or fallback) in (torch.bfloat16, torch.float16)
                                 for m in modules)


def copy_fits(copy: int, free: int, build: int = 0) -> bool:
    """Whether "auto" makes a copy of `copy` bytes with `free` bytes of device memory, `build` of them needed while
    it is made: only when there is one to make ("dense" has none for a model without LoRA or 4-bit layers) and it
    leaves the headroom."""
    return 0 < copy and copy + build + AUTO_HEADROOM_BYTES <= free


def build_bytes(model: torch.nn.Module) -> int:
    """The most device memory building a "dense" or "fused" copy holds beyond the copy itself: the temporaries of
    its largest merged or dequantized layer (BUILD_BYTES_PER_WEIGHT); 0 when every copied weight is a plain one."""
    merged = [m for m in dense_linears(model) if _makes_dense_copy(m)]
    return max((_layer(m).out_features * _layer(m).in_features for m in merged), default=0) * BUILD_BYTES_PER_WEIGHT


@contextlib.contextmanager
def copied_weights(model: torch.nn.Module, kind: str = "fp8") -> Iterator[list[torch.nn.Module]]:
    """Within the block, each of dense_linears(model) (yielded) computes x W^T + b from a copy of its current weight
    W: e4m3 with a scale per output channel (kinds "fp8", "w8a8": their GEMMs differ) or in the model's dtype
    ("dense", "fused"); the siblings of a fused_groups group run as one GEMM over their stacked copies. On exit every
    module is what it was (class, patched forward) and the copy is freed."""
    if kind not in COPIES:
        raise ValueError(f"kind: expected one of {list(COPIES)}, got {kind!r}")
    device = model.get_input_embeddings().weight.device
    if kind in FP8_COPIES and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"weights: {kind!r} needs a GPU of compute capability 8.9 or newer (Ada, Hopper) for e4m3; "
                         f"{torch.cuda.get_device_name(device)} is {torch.cuda.get_device_capability(device)}")
    dtype = model.get_input_embeddings().weight.dtype
    modules = dense_linears(model)
    group_of = {member: group for group in fused_groups(model, modules, kind) for member in group}
    swapped = []
    try:
        with torch.no_grad():
            for module in modules:
                group = group_of.get(module)
                if group is None:
                    attrs = {**dict(zip(_ATTRS, _copy(module, kind, dtype))), _KIND: kind}
                    _swap(module, attrs, _copy_forward, swapped)
                elif module is group[0]:
                    stacked = _stacked_copy(group, kind, dtype)
                    attrs = {**dict(zip(_GROUP_ATTRS, (*stacked, group, None))), _KIND: kind}
                    for member in group:
                        _swap(member, attrs, _group_forward, swapped)
        yield modules
    finally:
        _restore(swapped)


@contextlib.contextmanager
def nf4_weights(model: torch.nn.Module) -> Iterator[list[torch.nn.Module]]:
    """Within the block, each of nf4_linears(model) (yielded) computes its output with nf4_linear over its own
    packed weight; on exit every module is what it was. Nothing is copied."""
    swapped = []
    try:
        modules = nf4_linears(model)
        if not modules:  # asked for by name: say that it does nothing here
            warnings.warn("rollout: weights='nf4' found no bitsandbytes NF4 layer that nf4_linear can read; decoding "
                          "with the model's own weights", stacklevel=4)
        for module in modules:
            packed, state, dtype = four_bit_parts(module)
            prepare_nf4_linear(packed.device)
            _swap(module, {"fastgrpo_nf4": nf4_weight(packed, state), "fastgrpo_nf4_dtype": dtype}, _nf4_forward,
                  swapped)
        yield modules
    finally:
        _restore(swapped)


def nf4_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The bitsandbytes 4-bit bases of dense_linears(model) that nf4_linear reads (nf4_refusal: NF4, K a multiple
    of the blocksize, not repacked for bitsandbytes' CPU kernel), each once (a base two LoRA wrappers share would be
    swapped twice, and its undo fail); the others keep their forward, and so does the base of a merged LoRA layer
    (PEFT may unmerge it mid-rollout, replacing the weight read at entry)."""
    bases = {id(_layer(m)): _layer(m) for m in dense_linears(model) if not getattr(m, "merged", False)}
    return [b for b in bases.values() if (parts := four_bit_parts(b)) is not None and nf4_refusal(*parts[:2]) is None
            and tuple(parts[1].shape) == (b.out_features, b.in_features)]  # not a [K, N]-quantized weight


def _restore(swapped: list) -> None:
    """Undo _swap, last first: each module's class, attributes and instance-level forward as they were."""
    for module, base, own, names in reversed(swapped):
        module.__class__ = base
        for name in names:
            del module.__dict__[name]
        if own is not None:
            module.__dict__["forward"] = own


def fused_groups(model: torch.nn.Module, modules: list[torch.nn.Module], kind: str) -> list[tuple]:
    """The sibling linears (Architecture.decode_fused_projections, e.g. q/k/v) that the copy runs as one GEMM: each
    group whose members are all among `modules` and take the same input size; for "dense", only groups whose
    members it copies anyway (LoRA and 4-bit layers: stacking costs no memory beyond the copy), where "fused"
    stacks plain weights too. An empty list for a model outside the patch table."""
    try:
        arch = architecture(model)
    except ValueError:
        return []
    copied = {m for m in modules if kind != "dense" or _makes_dense_copy(m)}
    groups, grouped = [], set()
    for parent in model.modules():
        for names in arch.decode_fused_projections:
            group = tuple(getattr(parent, name, None) for name in names)
            # a module shared by two parents (or twice in one) would be swapped twice: it keeps its own copy
            distinct = len(set(group)) == len(group) and not grouped.intersection(group)
            if distinct and all(m in copied for m in group) and len({_layer(m).in_features for m in group}) == 1:
                groups.append(group)
                grouped.update(group)
    return groups


def _layer(module: torch.nn.Module) -> torch.nn.Module:
    """The linear that holds the base weight (a LoRA layer's base_layer)."""
    return getattr(module, "base_layer", module)


def _makes_dense_copy(module: torch.nn.Module) -> bool:
    """Whether "dense" copies this module's weight: a LoRA layer's merge or a dequantized 4-bit base (a plain
    floating weight is used as it is)."""
    return module is not _layer(module) or not _layer(module).weight.is_floating_point()


def _copy(module: torch.nn.Module, kind: str, dtype: torch.dtype, out: tuple | None = None) -> tuple:
    """(e4m3 weight, scale, None, bias) for FP8_COPIES, (None, None, weight, bias) for "dense" and "fused": the
    module's current weight (merged or dequantized: one layer's temporaries at a time). FP8: quantized into `out`
    (q, scale) where given."""
    weight, bias = dense_weight(module)
    if kind in FP8_COPIES:
        q, scale = quantize_fp8(weight, out)
        prepare_fp8_linear(q.device)  # "w8a8" too: its Triton GEMM is the same kernel (and odd shapes run fp8_linear)
        return q, scale, None, bias
    # the layer's own dtype (a plain weight is used as it is: no copy); 4-bit: the compute dtype
    own = _layer(module).weight.dtype if _layer(module).weight.is_floating_point() else dtype
    return None, None, weight.to(own), bias


def _stacked_copy(group: tuple, kind: str, dtype: torch.dtype) -> tuple:
    """The members' _copy stacked along the output features, rows in member order (one member's temporaries at
    a time), and their output sizes. A member without a bias gets zeros where another has one."""
    sizes = tuple(_layer(m).out_features for m in group)
    starts = list(itertools.accumulate(sizes, initial=0))
    if kind in FP8_COPIES:  # each member quantized straight into its rows: no copy of its own to move
        layer = _layer(group[0])
        q = torch.empty(starts[-1], layer.in_features, dtype=FP8_DTYPE, device=layer.weight.device)
        scale = torch.empty(starts[-1], dtype=torch.float32, device=layer.weight.device)
        biases = [_copy(m, kind, dtype, (q[a:b], scale[a:b]))[3] for m, a, b in zip(group, starts, starts[1:])]
        stacked = [q, scale, None]
    else:
        stacked, biases = None, []
        for member, a, b in zip(group, starts, starts[1:]):
            *copy, bias = _copy(member, kind, dtype)
            if stacked is None:
                stacked = [None if t is None else t.new_empty((starts[-1], *t.shape[1:])) for t in copy]
            for whole, part in zip(stacked, copy):
                if part is not None:
                    whole[a:b] = part
            biases.append(bias)
    like = next((b for b in biases if b is not None), None)
    bias = None if like is None else torch.cat([like.new_zeros(n) if b is None else b for b, n in zip(biases, sizes)])
    return (*stacked, bias, sizes)


def _swap(module: torch.nn.Module, attrs: dict, forward, swapped: list) -> None:
    """Give `module` the copy's attributes and the class whose forward reads them; an instance-level forward
    (patch_model's) is moved aside. Recorded in `swapped` for the undo."""
    base, own = type(module), module.__dict__.pop("forward", None)
    module.__dict__.update(attrs)
    module.__class__ = _copy_class(base, forward)
    swapped.append((module, base, own, tuple(attrs)))


def copy_bytes(model: torch.nn.Module, kind: str = "fp8") -> int:
    """Bytes of the copy copied_weights(model, kind) builds: FP8_COPIES, 1 per weight and 4 per output channel;
    dense, the model dtype's size per weight of the LoRA and 4-bit layers (the others decode with their own weight;
    biases are the modules' own, or stacked: a few KiB, not counted); fused, dense's and the plain members of the
    groups; nf4, none (nothing is copied)."""
    if kind == "nf4":
        return 0
    embedding = model.get_input_embeddings().weight
    modules = dense_linears(model)
    stacked = {m for group in fused_groups(model, modules, kind) for m in group} if kind == "fused" else set()
    total = 0
    for module in modules:
        n, k = _layer(module).out_features, _layer(module).in_features
        if kind in FP8_COPIES:
            total += n * (k + 4)
        elif _makes_dense_copy(module) or module in stacked:
            total += n * k * embedding.element_size()
    return total
