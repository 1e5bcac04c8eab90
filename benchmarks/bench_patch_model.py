"""One GRPO step (forward + backward) of Qwen2.5-1.5B, patched vs unpatched HF, same run.

    python -m pytest benchmarks/bench_patch_model.py -q -s

Qwen2.5-1.5B config, random weights, bf16, sdpa, B = 8, T in {1024, 4096, 8192} (prompt T/8, completions of random
length in the rest), LoRA r=16 on every decoder linear, and full fine-tuning. HF gradient checkpointing is on in
both (as GRPO trainers run), so the difference is the layers and the loss:
  unpatched: model(...).logits over the completion (logits_to_keep) -> fp32 log_softmax -> GRPO (TRL's path).
  patched:   fastgrpo.patch_model(model) + fastgrpo.grpo_loss(model, ...) (no [B, T, V] logits).
Token-level GRPO with old log-probs (clipping active), loss_type "bnpo". Rows: median ms, peak GiB above the
weights (first call), the loss of each path and the patched/unpatched ratios. Targets: peak <= 50% at T = 4096;
time no worse than unpatched. FASTGRPO_PATCH_SEQS=1024,4096 picks sequence lengths.
"""
from __future__ import annotations

import gc
import os

import pytest
import torch

from benchmarks.common import QWEN25_15B, measure, print_table, refuse_script_run, write_results

BATCH = 8
SEQS = [int(s) for s in os.environ.get("FASTGRPO_PATCH_SEQS", "1024,4096,8192").split(",")]
ROWS: list[dict] = []
_MODELS: dict = {}


def _model(mode: str):
    """One model per mode, built once; the cases patch and unpatch it in place."""
    if mode in _MODELS:
        return _MODELS[mode]
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config

    _MODELS.clear()
    gc.collect()
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            Qwen2Config(**QWEN25_15B), dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mode == "lora":
        model.enable_input_require_grads()
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
    model.train()
    _MODELS[mode] = model
    return model


def _batch(seq: int):
    g = torch.Generator(device="cuda").manual_seed(seq)
    prompt = seq // 8
    ids = torch.randint(0, QWEN25_15B["vocab_size"], (BATCH, seq), device="cuda", generator=g)
    attention_mask = torch.ones(BATCH, seq, dtype=torch.long, device="cuda")
    lengths = torch.randint(seq // 4, seq - prompt + 1, (BATCH,), device="cuda", generator=g)
    cols = torch.arange(seq, device="cuda")
    completion_mask = ((cols >= prompt) & (cols < prompt + lengths[:, None])).long()
    attention_mask[cols.expand(BATCH, -1) >= prompt + lengths[:, None]] = 0
    advantages = torch.randn(BATCH, device="cuda", generator=g)
    old_logps = (-2.0 + 0.1 * torch.randn(BATCH, seq, device="cuda", generator=g)) * completion_mask
    return ids, attention_mask, completion_mask, advantages, old_logps, prompt


def _eager_loss(model, ids, attention_mask, completion_mask, advantages, old_logps, prompt):
    """TRL's path: logits of the completion positions, fp32 log_softmax, the GRPO math of fastgrpo.loss.grpo."""
    from fastgrpo.loss.grpo import aggregation_weights, grpo_per_token_loss

    keep = ids.shape[1] - prompt + 1
    logits = model(input_ids=ids, attention_mask=attention_mask, logits_to_keep=keep).logits[:, :-1]
    targets = ids[:, prompt:]
    logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]  # [B, C]
    mask = completion_mask[:, prompt:].float()
    per_token, _, _, _ = grpo_per_token_loss(logps, mask, advantages, old_logps[:, prompt:].float())
    return (per_token * aggregation_weights(mask, "bnpo")).sum()


def _fused_loss(model, ids, attention_mask, completion_mask, advantages, old_logps, prompt):
    from fastgrpo.loss.model import grpo_loss

    return grpo_loss(model, ids, attention_mask, completion_mask, advantages, old_logps=old_logps)[0]


@pytest.mark.parametrize("mode", ["lora", "full"])
@pytest.mark.parametrize("seq", SEQS)
def test_grpo_step(mode, seq):
    from fastgrpo.patching import patch_model, unpatch_model

    model = _model(mode)
    batch = _batch(seq)
    pair = []
    for variant, loss_fn in (("unpatched", _eager_loss), ("patched", _fused_loss)):
        unpatch_model(model) if variant == "unpatched" else patch_model(model)
        losses = []

        def step():
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model, *batch)
            loss.backward()
            losses.append(loss.detach())

        row = {"mode": mode, "T": seq, "variant": variant, **measure(step, warmup_ms=200, rep_ms=1000)}
        row["loss"] = losses[0].item() if losses else None
        model.zero_grad(set_to_none=True)
        ROWS.append(row)
        pair.append(row)
    unpatch_model(model)
    base, ours = pair
    if base["ms"] and ours["ms"]:
        ours["time_vs_unpatched"] = ours["ms"] / base["ms"]
        ours["peak_vs_unpatched"] = ours["peak_gib"] / base["peak_gib"]


def teardown_module(module):
    _MODELS.clear()
    if ROWS:
        path = write_results("patch_model", ROWS, {
            "model": "Qwen2.5-1.5B config (random weights)", "batch": BATCH, "seqs": SEQS, "dtype": "bfloat16",
            "attention": "sdpa", "gradient_checkpointing": True, "lora": "r=16, all-linear",
            "loss": "GRPO token level, bnpo, old_logps", "prompt": "T/8",
        })
        print(f"\nwrote {path}")
        print_table(ROWS, ["mode", "T", "variant", "ms", "peak_gib", "oom", "loss", "time_vs_unpatched",
                           "peak_vs_unpatched"])


if __name__ == "__main__":
    refuse_script_run(__file__)
