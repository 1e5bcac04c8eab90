"""One SFT training step (forward + backward + AdamW) per system, on GPU: the cross-entropy of the response tokens.

    python -m pytest benchmarks/bench_sft.py -q -s

Qwen2.5-1.5B shapes with random weights, bf16, 8 sequences x 4096 tokens (a 256-token prompt, 3840 response tokens
with labels), LoRA r=16 on all linear layers and full fine-tuning. Systems (the model set-up as in bench_e2e):
  hf             plain HF, gradient checkpointing, `model(..., labels=...)`: HF's loss over [B, T, V] logits.
  hf+fused_ce    the same model, only the loss swapped for fastgrpo.loss.sft.sft_loss (fused lm_head, no logits).
  liger          HF + Liger's RMSNorm / RoPE / SwiGLU on the instance, gradient checkpointing, and
                 LigerFusedLinearCrossEntropyLoss over the final hidden states (all rows, prompt ones ignored by
                 ignore_index, as HF hands them to Liger).
  fastgrpo       fastgrpo.patch_model(model, offload_activations=True) and sft_loss.
Every case writes its row to benchmarks/results/sft-<card>.json as soon as it is measured (time per step: median
of 3 steps after one warm-up step; peak: torch.cuda.max_memory_allocated over the warm-up and timed steps).
Narrow the run with FASTGRPO_SFT_MODES=lora,full and FASTGRPO_SFT_SYSTEMS=hf,hf+fused_ce,liger,fastgrpo.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from benchmarks.common import measure_step, print_table, refuse_script_run, write_results
from benchmarks.e2e import StepSetup, build_model, modeling_globals_restored

SYSTEMS = ("hf", "hf+fused_ce", "liger", "fastgrpo")
MODES = os.environ.get("FASTGRPO_SFT_MODES", "lora,full").split(",")
RUN_SYSTEMS = os.environ.get("FASTGRPO_SFT_SYSTEMS", ",".join(SYSTEMS)).split(",")
ROWS: list[dict] = []


@dataclasses.dataclass
class SFTSetup:
    model_name: str = "qwen2.5-1.5b"
    system: str = "fastgrpo"
    lora_rank: int | None = 16  # None: full fine-tuning
    batch_size: int = 8
    seq_length: int = 4096
    prompt_length: int = 256
    dtype: torch.dtype = torch.bfloat16
    device: str = "cuda"


def make_batch(setup: SFTSetup, vocab_size: int) -> dict[str, torch.Tensor]:
    """Random token ids [B, T]; the response (every position from prompt_length on) carries the labels."""
    g = torch.Generator().manual_seed(1)
    B, T, P = setup.batch_size, setup.seq_length, setup.prompt_length
    input_ids = torch.randint(0, vocab_size, (B, T), generator=g)
    response_mask = torch.zeros(B, T, dtype=torch.long)
    response_mask[:, P:] = 1
    batch = {
        "input_ids": input_ids,
        "attention_mask": torch.ones(B, T, dtype=torch.long),
        "response_mask": response_mask,
        "labels": torch.where(response_mask.bool(), input_ids, -100),  # HF / Liger: -100 is ignored
    }
    return {k: v.to(setup.device) for k, v in batch.items()}


def sft_loss_fn(model, batch: dict[str, torch.Tensor], system: str) -> torch.Tensor:
    """The mean cross-entropy of the response tokens, as each system computes it (the same number for all)."""
    if system == "hf":
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    from fastgrpo.hf.models import backbone_and_head

    if system == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        backbone, head = backbone_and_head(model)
        hidden = backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        H = hidden.shape[-1]
        return LigerFusedLinearCrossEntropyLoss()(
            head.weight, hidden[:, :-1].reshape(-1, H), batch["labels"][:, 1:].reshape(-1)
        )
    from fastgrpo.loss.sft import sft_loss

    loss, _ = sft_loss(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"])
    return loss


def make_sft_step(setup: SFTSetup):
    """Build the model (as bench_e2e builds it for the system), AdamW and the batch; return a function running one
    step and returning its loss."""
    model_system = {"hf+fused_ce": "hf"}.get(setup.system, setup.system)
    model = build_model(StepSetup(model_name=setup.model_name, system=model_system, lora_rank=setup.lora_rank,
                                  dtype=setup.dtype, device=setup.device))
    params = [p for p in model.parameters() if p.requires_grad]
    fused = setup.device == "cuda"
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=fused, foreach=not fused)
    batch = make_batch(setup, model.config.vocab_size)

    def step():
        loss = sft_loss_fn(model, batch, setup.system)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _cases():
    for mode in MODES:
        for system in RUN_SYSTEMS:
            yield pytest.param(mode, system, id=f"{mode}-{system}")


@pytest.mark.parametrize("mode,system", list(_cases()))
def test_sft_step(benchmark, mode, system):
    if system == "liger":
        pytest.importorskip("liger_kernel")
    setup = SFTSetup(system=system, lora_rank={"lora": 16, "full": None}[mode])
    row = {"model": setup.model_name, "mode": "lora16" if setup.lora_rank else "full", "system": system,
           "batch_size": setup.batch_size, "seq_length": setup.seq_length, "prompt_length": setup.prompt_length}
    # Liger's patches reach transformers' module names: undone after the case, so they touch no other case.
    with modeling_globals_restored():
        if system == "liger":
            torch._dynamo.reset()  # as bench_e2e: Liger's compiled pieces must not see another case's shapes
        row.update(measure_step(benchmark, lambda: make_sft_step(setup), setup.batch_size * setup.seq_length,
                                on_warmup=lambda loss: {"first_loss": loss.item()}))
    ROWS.append(row)
    write_results("sft", ROWS, {"what": "one SFT step: forward + backward + AdamW, bf16, mean cross-entropy of "
                                        "the response tokens", "shapes": "Qwen2.5-1.5B, 8 x 4096 tokens (prompt 256)"})
    benchmark.extra_info.update(row)


def teardown_module(module):
    if ROWS:
        print()
        print_table(ROWS, ["mode", "system", "ms", "peak_gib", "tokens_per_s", "first_loss"])


if __name__ == "__main__":
    refuse_script_run(__file__)
