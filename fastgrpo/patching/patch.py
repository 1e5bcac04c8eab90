"""patch_model / unpatch_model: bind fused forwards on the module instances of one model, and undo it exactly.

Nothing outside the given model changes: no transformers class, module or function is modified.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from torch import nn

from fastgrpo._checks import check_choice, check_int_at_least, check_positive_int
from fastgrpo._device import forward_on_model_device
from fastgrpo.hf.architectures import ACTIVATIONS, loaded_lora_classes
from fastgrpo.hf.binding import WeakBoundMethod, bind_forward
from fastgrpo.hf.models import architecture, check_one_device, decoder_layers, split_recomputed, unwrap_peft
from fastgrpo.hf.versions import check_supported
from fastgrpo.offload import ActivationOffloader, disable_offload_checkpointing, enable_offload_checkpointing
from fastgrpo.offload.checkpointing import check_offloader_device
from fastgrpo.ops.fp8_base import check_fp8_device, drop_fp8_weight
from fastgrpo.ops.fp8_trained import fp8_linear_eligible, fp8_linear_forward
from fastgrpo.ops.tiled_mlp import chunk_tokens_for
from fastgrpo.patching.forwards import (
    lora_linear_forward,
    mlp_forward,
    rms_norm_forward,
    rope_attention_forward,
    tiled_mlp_forward,
)
from fastgrpo.patching.liger import refuse_liger_patched, unwatch_liger, watch_for_liger
from fastgrpo.patching.loss_forward import causal_lm_forward

SUMMARY_ATTR = "fastgrpo_patch_summary"
_UNDO_ATTR = "_fastgrpo_undo"
_MODULES_ATTR = "_fastgrpo_modules"  # the (name, class) of each module patched over
LORA_DTYPES = ("input", "adapter")


def patch_model(
    model: nn.Module,
    *,
    rms_norm: bool = True,
    rope: bool = True,
    swiglu: bool = True,
    fused_loss: bool = True,
    offload_activations: bool | ActivationOffloader = False,
    recompute_layers: int | None = None,
    tiled_mlp: bool | None = None,
    mlp_chunk_tokens: int | None = None,
    fused_lora: bool = True,
    lora_dtype: str = "input",
    fp8_base: bool = False,
) -> nn.Module:
    """Replace RMSNorm, rotary embedding and gated-MLP math of `model` with fastgrpo's fused kernels.

    model: a transformers causal LM (llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3 / gemma3_text, phi3),
    a PEFT wrapper of one, or one with a bitsandbytes 4-bit base. swiglu also covers Gemma's GeGLU.
    fused_loss: with `labels`, in training mode, the model's forward computes the loss from hidden states without
    [B, T, V] logits (logits=None). In eval mode it is the library's forward, logits and all (HF's Trainer hands them
    to compute_metrics), as Liger's is, unless called with skip_logits=True (Liger's keyword too). fastgrpo.grpo_loss /
    sequence_logprobs are fused whether or not the model is patched.
    offload_activations: wrap the decoder layers with fastgrpo.offload's offload checkpointing. True uses the
    default offloader of the inputs' device: its pinned host pool is unbounded and kept for reuse until the last
    layer using it is unpatched (or fastgrpo.offload.release_host_memory()). An ActivationOffloader is used instead,
    e.g. ActivationOffloader("cuda", pool=HostBufferPool(max_bytes=8 << 30)) to bound the pinned memory; it is
    yours: release_host_memory(offloader) gives its memory back. It must be made for the layers' device: one for
    another is refused (here, or at the first forward of a model not yet placed, on "meta").
    recompute_layers: with offload_activations, checkpoint only the first N decoder layers; the later ones keep their
    activations on the GPU, so the backward does not run them again (a faster update for more memory: measured in
    benchmarks/NOTES.md). None: every layer. The last layers are the ones kept because the backward reaches them
    first and frees their activations first.
    tiled_mlp: run each MLP over chunks of mlp_chunk_tokens tokens, keeping only its input for the backward
    (fastgrpo.ops.tiled_mlp); None: on in the layers offload_activations checkpoints (then one layer's MLP
    intermediates are most of the peak; a kept layer holds them anyway), True / False force it everywhere. Under
    checkpointing it adds no MLP FLOPs (the recompute stops before the MLP), except on gemma2/3 (one more MLP
    forward: their recompute needs the MLP output); without checkpointing, one more MLP forward. mlp_chunk_tokens:
    tokens per chunk (an error where no MLP runs tiled); None: as many as keep the MLP's widest intermediate
    ([chunk, intermediate_size], Phi-3's fused gate_up [chunk, 2 x intermediate_size]) within 256 MiB in the model's
    dtype (fastgrpo.ops.tiled_mlp.chunk_tokens_for: Qwen2.5-1.5B in bf16, 14976), so micro-batches of fewer tokens run
    untiled.
    fused_lora: PEFT LoRA Linear layers (peft.tuners.lora.layer.Linear, and the QLoRA classes bnb.Linear4bit /
    Linear8bitLt over a bitsandbytes base) compute their vanilla adapter branch with fastgrpo.ops.lora, which keeps
    the layer's input for the backward instead of a copy in the adapter's dtype (fp32 adapters on a bf16 input: 4 B
    per input element and layer); DoRA, dropout in training, merged or disabled adapters, adapter_names, autocast
    run PEFT's forward.
    lora_dtype: the precision of that branch. "input": in the dtype of the layer's input, as under torch autocast
    (TRL's bf16 Trainer, Unsloth): the adapter weights are cast to it per call and the delta is added to the base
    output inside the second GEMM (fastgrpo.ops.lora.lora_add): on a bf16 model, bf16 tensor-core GEMMs with fp32
    accumulation, adapter weights and their gradients staying fp32. Over a frozen, unhooked nn.Linear base the
    base GEMM is part of the same op (fastgrpo.ops.lora.lora_linear), whose backward adds the adapters' input
    gradients into the base's in their GEMMs instead of leaving autograd a separate add. Over other bases the base
    layer's output is added into in place when nothing else can see it (not a view, no forward hook on the base
    layer or module-wide), else copied once.
    "adapter": PEFT's own math without autocast,
    bitwise (input cast to the fp32 adapters, fp32 GEMMs, an fp32 [tokens, out] delta added and cast back), which
    measured on an H100 costs more GPU time than the base model in a Qwen2.5-1.5B LoRA step (ops/lora.py).
    fp8_base: the frozen nn.Linear bases of LoRA layers multiply in FP8, in the forward and in the input gradient
    (fastgrpo.ops.fp8_base: each row of the input, of the output's gradient and of the weight in e4m3 with its own
    scale, ~2^-4 relative per element). An e4m3 copy of each such weight is kept beside it (1 byte per parameter)
    and made again when the weight changes. Faster where the GEMMs are large (an H200, Llama-3.1-8B at 10,240
    tokens: 1.55x the forward GEMMs; Qwen2.5-1.5B: 1.04x, benchmarks/NOTES.md); it changes the numbers the model
    computes, as a QLoRA base does. Needs fused_lora, lora_dtype "input", a LoRA layer over an nn.Linear, plain
    adapters (no DoRA, no lora_dropout), and FP8 tensor cores (compute capability 8.9+) on CUDA; the CPU runs it in
    software. A forward under autocast, or of a merged adapter, is PEFT's: its base multiplies in the autocast /
    model dtype. On a model without LoRA layers (full fine-tuning) every nn.Linear of the decoder layers with sides
    multiples of 16 runs fastgrpo.ops.fp8_trained's FP8Linear: the forward and input gradient in FP8
    as above, the weight gradient in the model's dtype; each weight keeps its e4m3 copy and the copy's transpose (2
    bytes a parameter), a trained one made again after every torch.optim step (fused optimizers move no version
    counter). It pays only where micro-batches are long (benchmarks/NOTES.md, forty-eighth session).

    Returns the same object. What was replaced is in `model.fastgrpo_patch_summary` (counts per kind, the reason
    for anything left alone, the options resolved and the arguments as given). Patching again with the same
    arguments does nothing while the modules are the same; with other arguments, or after PEFT wrapped linears of the
    patched model (get_peft_model) or merged them away, the model is unpatched first. Plain HF forward and generate
    (KV cache) keep working on the patched modules.
    """
    hf_model = unwrap_peft(model)
    arch = architecture(hf_model)
    check_one_device(hf_model)
    for library in ("transformers", "peft"):
        check_supported(library)
    # A truthy stand-in ("no" read from a config file) would switch on what it meant to leave off.
    switches = {"rms_norm": rms_norm, "rope": rope, "swiglu": swiglu, "fused_loss": fused_loss,
                "fused_lora": fused_lora, "fp8_base": fp8_base}
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name}: expected True or False, got {value!r}")
    if not isinstance(tiled_mlp, (bool, type(None))):
        raise ValueError(f"tiled_mlp: expected True, False or None, got {tiled_mlp!r}")
    if mlp_chunk_tokens is not None:
        check_positive_int("mlp_chunk_tokens", mlp_chunk_tokens)
    check_choice("lora_dtype", lora_dtype, LORA_DTYPES)
    if fp8_base and not (fused_lora and lora_dtype == "input") and _has_lora_layers(hf_model):
        raise ValueError(f"fp8_base: runs in fastgrpo's LoRA forward, which needs fused_lora=True and "
                         f"lora_dtype='input'; got fused_lora={fused_lora}, lora_dtype={lora_dtype!r}")
    check_offload_options(offload_activations, recompute_layers)
    layers = decoder_layers(hf_model, arch)
    refuse_liger_patched(hf_model)
    checkpointed = _checkpointed_layers(layers, offload_activations, recompute_layers)
    if isinstance(offload_activations, ActivationOffloader):
        check_offloader_device(offload_activations, checkpointed, "offload_activations")
    tiled_modules, tiled_mlp_argument, chunk_tokens_argument = None, tiled_mlp, mlp_chunk_tokens  # None: every MLP
    if tiled_mlp is None:
        tiled_mlp = bool(checkpointed)
        tiled_modules = {id(m) for layer in checkpointed for m in layer.modules()}
    if not tiled_mlp and mlp_chunk_tokens is not None:  # a setting that would do nothing
        why = "False" if tiled_mlp_argument is False else "None and offload_activations checkpoints no layer"
        raise ValueError(f"mlp_chunk_tokens: sizes the tiled MLP's chunks, and no MLP runs tiled (tiled_mlp={why}); "
                         "pass tiled_mlp=True, or leave mlp_chunk_tokens None")
    if tiled_mlp and mlp_chunk_tokens is None:  # sized by the MLP's widest intermediate (Phi-3's is gate_up's 2I)
        widest = hf_model.config.get_text_config().intermediate_size * (2 if arch.mlp_fused_gate_up else 1)
        mlp_chunk_tokens = chunk_tokens_for(widest, hf_model.dtype.itemsize)
    options = {
        "rms_norm": rms_norm, "rope": rope, "swiglu": swiglu, "fused_loss": fused_loss,
        "offload_activations": offload_activations, "recompute_layers": recompute_layers, "tiled_mlp": tiled_mlp,
        "mlp_chunk_tokens": mlp_chunk_tokens, "fused_lora": fused_lora, "lora_dtype": lora_dtype,
        "fp8_base": fp8_base,
    }
    # Compared as given: tiled_mlp None and True resolve alike when every layer is checkpointed, not otherwise; a
    # resolved chunk size passed back (FastGRPOTrainer patches again with them) would be refused without a tiled MLP.
    arguments = {**options, "tiled_mlp": tiled_mlp_argument, "mlp_chunk_tokens": chunk_tokens_argument}
    existing = hf_model.__dict__.get(SUMMARY_ATTR)
    if existing is not None:
        # Same arguments, same modules: done. PEFT may have wrapped linears since (get_peft_model on the patched
        # model) or merged them away: patched again, its LoRA layers get the fused branch.
        if existing["arguments"] == arguments and hf_model.__dict__.get(_MODULES_ATTR) == _modules(hf_model):
            return model
        unpatch_model(model)
    undo: list[Callable[[], None]] = []

    def bind(module, make_forward):
        undo.append(bind_forward(module, make_forward).restore)

    patched: Counter = Counter()
    skipped: dict[str, str] = {}
    rope_forwards: dict[type, Callable | None] = {}
    lora_classes = loaded_lora_classes() if fused_lora else {}
    fp8_full = _check_fp8_bases(hf_model, layers, lora_classes) if fp8_base else set()
    for module in hf_model.modules():
        name = type(module).__name__
        lora_class = lora_classes.get(type(module))  # exactly: subclasses have forwards of their own
        if lora_class is not None:
            bind(module, lambda previous: lora_linear_forward(previous, lora_class, lora_dtype, fp8_base))
            patched["fused_lora"] += 1
            if fp8_base:  # its e4m3 copy goes with the patch
                undo.append(WeakBoundMethod(lambda layer: drop_fp8_weight(layer.base_layer), module))
        elif id(module) in fp8_full:
            bind(module, lambda _: fp8_linear_forward)
            patched["fp8_linear"] += 1
            undo.append(WeakBoundMethod(drop_fp8_weight, module))  # a frozen weight's copy goes with the patch
        elif rms_norm and name in arch.norm_classes:
            bind(module, lambda _: rms_norm_forward(
                arch.norm_eps_attr, arch.norm_offset, arch.norm_cast_before_weight))
            patched["rms_norm"] += 1
        elif name in arch.mlp_classes:
            act_name = type(getattr(module, arch.mlp_act_attr)).__name__
            if swiglu and act_name not in ACTIVATIONS:
                skipped["swiglu"] = f"{name}: activation {act_name} has no fused kernel"
            elif swiglu:
                bind(module, lambda _: mlp_forward(ACTIVATIONS[act_name], arch.mlp_fused_gate_up))
                patched["swiglu"] += 1
            # bound last: it chunks whichever forward the MLP has now
            if tiled_mlp and (tiled_modules is None or id(module) in tiled_modules):
                bind(module, lambda previous: tiled_mlp_forward(previous, mlp_chunk_tokens))
                patched["tiled_mlp"] += 1
        elif rope and name in arch.attention_classes:
            if type(module) not in rope_forwards:
                rope_forwards[type(module)] = rope_attention_forward(type(module))
            forward = rope_forwards[type(module)]
            if forward is None:
                skipped["rope"] = f"{name}.forward does not call apply_rotary_pos_emb through its module globals"
                continue
            bind(module, lambda _: forward)
            patched["rope"] += 1
    for kind, enabled, classes in (("rms_norm", rms_norm, arch.norm_classes), ("swiglu", swiglu, arch.mlp_classes),
                                   ("rope", rope, arch.attention_classes)):
        if enabled and not patched[kind] and kind not in skipped:
            skipped[kind] = f"no module of class {list(classes)} in this {type(hf_model).__name__}"
    if fused_loss:
        bind(hf_model, lambda previous: causal_lm_forward(previous, hf_model.base_model_prefix, arch))
        patched["fused_loss"] += 1
    if checkpointed:
        enable_offload_checkpointing(
            checkpointed, offloader=None if offload_activations is True else offload_activations,
            tiled_mlp_chunk_tokens=mlp_chunk_tokens if tiled_mlp else None,
            mlp_output_only_added=arch.mlp_output_added_as_is,
        )
        # Bound to the model, which it finds the layers in: a deepcopy's undo disables the copy's.
        undo.append(WeakBoundMethod(lambda model: disable_offload_checkpointing(decoder_layers(model, arch)), hf_model))
        patched["offload_activations"] += len(checkpointed)
    if checkpointed and recompute_layers is not None:
        undo.append(_hf_checkpointing_off(hf_model, arch, layers, recompute_layers))
    # bound last, around every forward above: Triton launches on the current device, not the model's
    bind(hf_model, forward_on_model_device)
    watch_for_liger(hf_model, layers)
    undo.append(WeakBoundMethod(unwatch_liger, hf_model))
    hf_model.__dict__[_UNDO_ATTR] = undo
    hf_model.__dict__[_MODULES_ATTR] = _modules(hf_model)
    hf_model.__dict__[SUMMARY_ATTR] = {
        "model_type": hf_model.config.model_type, "options": options, "arguments": arguments,
        "patched": dict(patched), "skipped": skipped,
    }
    return model


def _hf_checkpointing_off(hf_model: nn.Module, arch, layers: list[nn.Module], first_kept: int) -> Callable[[], None]:
    """HF's gradient checkpointing off on the decoder layers from first_kept on (those recompute_layers keeps, whose
    activations stay for the backward: HF's flag would recompute them); the undo puts each flag back."""
    was_on = [i for i in range(first_kept, len(layers)) if getattr(layers[i], "gradient_checkpointing", False)]
    for i in was_on:
        layers[i].gradient_checkpointing = False

    def restore(model: nn.Module) -> None:  # bound to the model: a deepcopy's undo restores the copy's layers
        model_layers = decoder_layers(model, arch)
        for i in was_on:
            model_layers[i].gradient_checkpointing = True

    return WeakBoundMethod(restore, hf_model)


def _check_fp8_bases(model: nn.Module, layers: list[nn.Module], lora_classes: dict) -> set[int]:
    """What fp8_base acts on: plain LoRA layers (no DoRA, no adapter dropout) over nn.Linear bases; in a model with
    no LoRA layer (full fine-tuning), the decoder layers' linears fp8_linear takes, whose ids it returns. One line
    where there are none, or where the LoRA layers are of a kind it cannot take."""
    lora_layers = [m for m in model.modules() if type(m) in lora_classes]
    if not lora_layers:
        full = [m for layer in layers for m in layer.modules() if fp8_linear_eligible(m)]
        if not full:
            raise ValueError(f"fp8_base: multiplies the decoder's nn.Linear layers in FP8 (a LoRA model's frozen "
                             f"bases, or every one in full fine-tuning), and this {type(model).__name__} has none of "
                             "bf16 / fp16 / fp32 weights with both sides multiples of 16")
        check_fp8_device(full[0].weight.device)
        return {id(m) for m in full}
    linears = [m.base_layer for m in lora_layers if type(m.base_layer) is nn.Linear]
    if not linears:
        kinds = sorted({type(m.base_layer).__name__ for m in lora_layers})
        raise ValueError(f"fp8_base: multiplies the frozen nn.Linear bases of PEFT LoRA layers in FP8, and "
                         f"its LoRA layers' bases are {kinds} in this {type(model).__name__} (get_peft_model over a "
                         "bf16 / fp16 model)")
    variants = sorted({type(v).__name__ for m in lora_layers for v in m.lora_variant.values()})
    if variants:  # DoRA and the like: PEFT's forward runs them, the base in bf16: FP8 silently off
        raise ValueError(f"fp8_base: runs in fastgrpo's LoRA forward, which takes plain LoRA adapters, and this "
                         f"{type(model).__name__}'s LoRA layers have {variants[0]} ones (PEFT's forward runs them, the "
                         "base in bf16); use LoraConfig(use_dora=False)")
    dropouts = sorted({d.p for m in lora_layers for d in m.lora_dropout.values()
                       if isinstance(d, nn.Dropout) and d.p > 0})
    if dropouts:  # in training PEFT's forward would run, the base in bf16: FP8 silently off
        raise ValueError(f"fp8_base: runs in fastgrpo's LoRA forward, which takes no adapter dropout, and this "
                         f"{type(model).__name__}'s LoRA layers have lora_dropout {dropouts[-1]} (their training "
                         "forward would be PEFT's, the base in bf16); use LoraConfig(lora_dropout=0)")
    check_fp8_device(linears[0].weight.device)
    return set()


def _has_lora_layers(model: nn.Module) -> bool:
    """Whether PEFT's LoRA layers are in `model` (whatever fused_lora says): fp8_base then acts on their bases only."""
    lora_classes = loaded_lora_classes()
    return any(type(m) in lora_classes for m in model.modules())


def _modules(model: nn.Module) -> list[tuple[str, type]]:
    return [(name, type(module)) for name, module in model.named_modules()]


def check_offload_options(offload_activations, recompute_layers) -> None:
    """offload_activations' type and recompute_layers' value, which need no model (FastGRPOTrainer checks them
    before TRL loads one)."""
    if not isinstance(offload_activations, (bool, ActivationOffloader)):
        raise ValueError("offload_activations: expected a bool or a fastgrpo.offload.ActivationOffloader, "
                         f"got {type(offload_activations).__name__}")
    if recompute_layers is not None:
        check_int_at_least("recompute_layers", recompute_layers, 0, or_else=" or None")


def _checkpointed_layers(
    layers: list[nn.Module], offload_activations: bool | ActivationOffloader, recompute_layers: int | None
) -> list[nn.Module]:
    """The decoder layers offload checkpointing wraps: the first recompute_layers of them (None: all)."""
    if recompute_layers is None:
        return layers if offload_activations is not False else []
    if offload_activations is False:
        raise ValueError("recompute_layers: chooses the layers offload_activations checkpoints, and "
                         "offload_activations is off")
    return split_recomputed(layers, recompute_layers)[0]


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo patch_model on `model` (restoring every forward it replaced); returns the same object.

    A model that is not patched is returned unchanged.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected the torch module patch_model was given, got {type(model).__name__}")
    hf_model = unwrap_peft(model)
    undo = hf_model.__dict__.pop(_UNDO_ATTR, None)
    hf_model.__dict__.pop(SUMMARY_ATTR, None)
    hf_model.__dict__.pop(_MODULES_ATTR, None)
    for restore in reversed(undo or []):
        try:
            restore()
        except ReferenceError:  # a module replaced since, and freed: nothing left to restore
            pass
    return model
