"""End-to-end GRPO training steps: one builder per system, same data for all.

Systems:
  hf        plain Hugging Face: non-reentrant gradient checkpointing, logits of the completion positions, eager
            fp32 log-softmax and the GRPO loss over them (what TRL does).
  liger     HF + Liger-Kernel: Liger's RMSNorm/RoPE/SwiGLU on the instance and LigerFusedLinearGRPOLoss over the
            final hidden states (logits never whole), with HF checkpointing.
  fastgrpo  fastgrpo.patch_model(model, offload_activations=True) and fastgrpo.grpo_loss (fused lm_head + loss).
A step is forward + backward + AdamW step; the data are random token ids (speed and memory do not depend on them).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Iterator

import torch

from benchmarks.common import LLAMA31_8B, QWEN25_15B

SYSTEMS = ("hf", "liger", "fastgrpo")

MODEL_CONFIGS = {
    # 64K-token completions need positions past Qwen2.5's 32K (RoPE is computed on the fly: nothing else changes).
    "qwen2.5-1.5b": dict(QWEN25_15B, model_type="qwen2", max_position_embeddings=131072),
    "llama-3.1-8b": dict(LLAMA31_8B, model_type="llama"),
    # A few-MB model with the same code path, to check this file on a CPU.
    "tiny-qwen2": dict(
        model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True, max_position_embeddings=8192,
    ),
}


@dataclasses.dataclass
class StepSetup:
    model_name: str = "qwen2.5-1.5b"
    system: str = "fastgrpo"
    lora_rank: int | None = 16  # None: full fine-tuning
    num_generations: int = 8
    prompt_length: int = 256
    completion_length: int = 1024
    micro_batch_size: int | None = None  # sequences per forward/backward (gradient accumulation); None: all at once
    dtype: torch.dtype = torch.bfloat16
    device: str = "cuda"


@contextlib.contextmanager
def modeling_globals_restored() -> Iterator[None]:
    """Undo, on exit, what a case did to the names of transformers' Llama / Qwen2 modeling modules.

    Liger's apply_liger_kernel_to_* replaces module-level names (apply_rotary_pos_emb, Qwen2RMSNorm, Qwen2MLP), so
    every model built later in the process, plain HF and fastgrpo alike, carries Liger's modules (what that did to
    the measured peaks: benchmarks/NOTES.md).
    """
    modules = [importlib.import_module(f"transformers.models.{name}.modeling_{name}") for name in ("llama", "qwen2")]
    saved = [(module, dict(vars(module))) for module in modules]
    try:
        yield
    finally:
        for module, names in saved:
            vars(module).update(names)


def build_model(setup: StepSetup) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(MODEL_CONFIGS[setup.model_name])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device(setup.device):
        model = AutoModelForCausalLM.from_config(config, dtype=setup.dtype, attn_implementation="sdpa")
    if setup.lora_rank is not None:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=setup.lora_rank, lora_alpha=2 * setup.lora_rank, target_modules="all-linear")
        model = get_peft_model(model, lora)
    model.config.use_cache = False
    if setup.system in ("hf", "liger"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if setup.lora_rank is not None:
            model.enable_input_require_grads()
    if setup.system == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        base = model.get_base_model() if setup.lora_rank is not None else model
        _apply_liger_kernel_to_instance(model=base, fused_linear_cross_entropy=False, cross_entropy=False)
    if setup.system == "fastgrpo":
        import fastgrpo

        model = fastgrpo.patch_model(model, offload_activations=setup.device == "cuda")
    model.train()
    return model


def make_batch(setup: StepSetup, vocab_size: int) -> dict[str, torch.Tensor]:
    """8 completions of one prompt, as GRPO trains them: [B, P + C] ids, completion mask, advantages.

    On-policy (the first inner epoch: old log-probs = the current ones), so no token is clipped and every
    system does the full gradient work.
    """
    g = torch.Generator().manual_seed(1)
    B, P, C = setup.num_generations, setup.prompt_length, setup.completion_length
    input_ids = torch.randint(0, vocab_size, (B, P + C), generator=g)
    completion_mask = torch.zeros(B, P + C, dtype=torch.bool)
    completion_mask[:, P:] = True
    batch = {
        "input_ids": input_ids,
        "attention_mask": torch.ones(B, P + C, dtype=torch.long),
        "completion_mask": completion_mask,
        "advantages": torch.randn(B, generator=g),
    }
    return {k: v.to(setup.device) for k, v in batch.items()}


def _lm_head(model):
    return model.get_output_embeddings()


def _grpo_over_logps(logps, batch, setup):
    from fastgrpo.loss.grpo import aggregation_weights, grpo_per_token_loss

    mask = batch["completion_mask"][:, setup.prompt_length:].float()
    loss, _, _, _ = grpo_per_token_loss(logps, mask, batch["advantages"])
    return (loss * aggregation_weights(mask, "bnpo")).sum()


def loss_fn(model, batch: dict[str, torch.Tensor], setup: StepSetup) -> torch.Tensor:
    P, C = setup.prompt_length, setup.completion_length
    targets = batch["input_ids"][:, P:]  # the completion tokens, predicted from positions P-1 .. P+C-2
    if setup.system == "hf":
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], logits_to_keep=C + 1
        ).logits[:, :-1]
        logps = torch.log_softmax(logits.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return _grpo_over_logps(logps, batch, setup)
    if setup.system == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        out = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True,
            logits_to_keep=1,
        )
        hidden = out.hidden_states[-1][:, P - 1:-1]
        liger = LigerFusedLinearGRPOLoss(beta=0.0, loss_type="bnpo", use_ref_model=False)
        loss, _ = liger(
            hidden, _lm_head(model).weight, targets, batch["completion_mask"][:, P:].long(), batch["advantages"]
        )
        return loss
    import fastgrpo

    loss, _ = fastgrpo.grpo_loss(
        model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"], batch["advantages"],
        loss_type="bnpo",
    )
    return loss


def make_step(setup: StepSetup):
    """Build the model, optimizer and batch; return a zero-argument function running one training step."""
    if setup.system == "liger":
        # Liger's loss is torch.compile'd; on torch 2.11 its recompile for a second shape fails (H200, 2026-11-26).
        torch._dynamo.reset()
    model = build_model(setup)
    params = [p for p in model.parameters() if p.requires_grad]
    fused = setup.device == "cuda"
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=fused, foreach=not fused)
    batch = make_batch(setup, model.config.vocab_size)

    micro = setup.micro_batch_size or setup.num_generations
    micro_batches = [
        {k: v[i : i + micro] for k, v in batch.items()} for i in range(0, setup.num_generations, micro)
    ]

    def step():
        for micro_batch in micro_batches:
            loss = loss_fn(model, micro_batch, setup) / len(micro_batches)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step
