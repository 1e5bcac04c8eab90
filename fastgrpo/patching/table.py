"""What patch_model replaces, per Hugging Face model_type: the one place where architectures differ.

Modules are found by class name on the model instance. Everything not listed here runs the library's own code.
"""
from __future__ import annotations

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

    def logit_softcap(self, config) -> float | None:
        """The soft-cap a model of this architecture applies to its logits, or None."""
        return getattr(config, self.logit_softcap_attr, None) if self.logit_softcap_attr else None


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
    )


def _gemma_like(prefix: str) -> Architecture:
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
    )


ARCHITECTURES: dict[str, Architecture] = {
    "llama": _llama_like("Llama"),
    "mistral": _llama_like("Mistral"),
    "qwen2": _llama_like("Qwen2"),
    "qwen3": _llama_like("Qwen3"),
    "gemma": _gemma_like("Gemma"),
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
