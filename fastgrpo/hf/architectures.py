"""What patch_model replaces, per Hugging Face model_type and per PEFT LoRA class: the one place where
architectures differ.

Modules are found by class name on the model instance. Everything not listed here runs the library's own code.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    norm_classes: tuple[str, ...]  # RMSNorm modules (layer norms, final norm, q/k norms)
    norm_eps_attr: str  # where the module keeps its epsilon
    norm_offset: float  # 1.0: Gemma's x * (1 + w)
    norm_cast_before_weight: bool  # Llama rounds x * rstd to the input dtype before * w; Gemma rounds once at the end
    attention_classes: tuple[str, ...]  # their forward calls the module-level `apply_rotary_pos_emb`
    mlp_classes: tuple[str, ...]
    mlp_fused_gate_up: bool  # Phi-3: one gate_up_proj, chunked in two
    mlp_act_attr: str
    logit_softcap_attr: str | None = None  # config field that soft-caps the logits (passed to the fused loss)
    # Sibling linears of one module that read the same input (attention q/k/v, MLP gate/up): the rollout's decode
    # copy stacks each group's weights and runs it as one GEMM (rollout/decode_weights.py). Phi-3 stores them stacked.
    decode_fused_projections: tuple[tuple[str, ...], ...] = ()
    # The layer's last op adds the MLP output to the residual as it is, so a recompute of the layer in the backward can
    # skip a tiled MLP's forward (fastgrpo.offload.checkpointing). Not Gemma2/3 (a norm reads it) nor Phi-3 (a
    # dropout follows it, drawing random numbers after the MLP's own: LoRA dropout).
    mlp_output_added_as_is: bool = True

    def logit_softcap(self, config) -> float | None:
        """The soft-cap a model of this architecture applies to its logits, or None."""
        return getattr(config, self.logit_softcap_attr, None) if self.logit_softcap_attr else None


_SEPARATE_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _llama_like(prefix: str) -> Architecture:
    return Architecture(
        norm_classes=(f"{prefix}RMSNorm",),
        norm_eps_attr="variance_epsilon",
        norm_offset=0.0,
        norm_cast_before_weight=True,
        attention_classes=(f"{prefix}Attention",),
        mlp_classes=(f"{prefix}MLP",),
        mlp_fused_gate_up=False,
        mlp_act_attr="act_fn",
        decode_fused_projections=_SEPARATE_PROJECTIONS,
    )


def _gemma_like(prefix: str, mlp_output_added_as_is: bool = False) -> Architecture:
    return Architecture(
        norm_classes=(f"{prefix}RMSNorm",),
        norm_eps_attr="eps",
        norm_offset=1.0,
        norm_cast_before_weight=False,
        attention_classes=(f"{prefix}Attention",),
        mlp_classes=(f"{prefix}MLP",),
        mlp_fused_gate_up=False,
        mlp_act_attr="act_fn",
        logit_softcap_attr="final_logit_softcapping",
        decode_fused_projections=_SEPARATE_PROJECTIONS,
        mlp_output_added_as_is=mlp_output_added_as_is,
    )


ARCHITECTURES: dict[str, Architecture] = {
    "llama": _llama_like("Llama"),
    "mistral": _llama_like("Mistral"),
    "qwen2": _llama_like("Qwen2"),
    "qwen3": _llama_like("Qwen3"),
    "gemma": _gemma_like("Gemma", mlp_output_added_as_is=True),
    "gemma2": _gemma_like("Gemma2"),
    "gemma3": _gemma_like("Gemma3"),
    "gemma3_text": _gemma_like("Gemma3"),
    "phi3": Architecture(
        norm_classes=("Phi3RMSNorm",),
        norm_eps_attr="variance_epsilon",
        norm_offset=0.0,
        norm_cast_before_weight=True,
        attention_classes=("Phi3Attention",),
        mlp_classes=("Phi3MLP",),
        mlp_fused_gate_up=True,
        mlp_act_attr="activation_fn",
        mlp_output_added_as_is=False,
    ),
}

# Activation modules (by class name, transformers 5.x) -> the fused gated activation that matches them exactly.
ACTIVATIONS: dict[str, str] = {
    "SiLUActivation": "silu",
    "SiLU": "silu",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "NewGELUActivation": "gelu_tanh",
}


@dataclass(frozen=True)
class LoRAClass:
    """A PEFT LoRA class whose vanilla branch patch_model fuses, and how its forward (PEFT 0.21) differs from
    peft.tuners.lora.layer.Linear's around that branch."""

    module: str  # where PEFT defines it; looked up in sys.modules, never imported
    name: str
    # result = base_layer(x).clone(): PEFT's "defensive" 4-bit clone; the base output is a view made by bitsandbytes'
    # autograd Function, on which in-place ops fail (it is the layer's output when none of its adapters is active).
    clone_base: bool = False
    # Each delta cast to the base result's dtype before the add (a bf16 result adds bf16 deltas), instead of
    # PEFT Linear's sum in the promoted dtype (fp32 for fp32 adapters) cast once at the end.
    delta_in_result_dtype: bool = False


LORA_CLASSES = (
    LoRAClass("peft.tuners.lora.layer", "Linear"),
    LoRAClass("peft.tuners.lora.bnb", "Linear4bit", clone_base=True, delta_in_result_dtype=True),
    LoRAClass("peft.tuners.lora.bnb", "Linear8bitLt", delta_in_result_dtype=True),
)


def loaded_lora_classes() -> dict[type, LoRAClass]:
    """The LORA_CLASSES PEFT has loaded: a model holding such layers has imported their module (peft.tuners.lora.bnb
    defines its classes only when bitsandbytes is installed)."""
    found = {}
    for lora_class in LORA_CLASSES:
        cls = getattr(sys.modules.get(lora_class.module), lora_class.name, None)
        if cls is not None:
            found[cls] = lora_class
    return found
