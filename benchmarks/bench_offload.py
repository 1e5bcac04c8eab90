"""Activation-offload checkpointing vs HF non-reentrant gradient checkpointing, same run, same card.

    python -m pytest benchmarks/bench_offload.py -q -s

Qwen2.5-1.5B shapes (random weights), LoRA r=16 on every linear of the decoder (peft), bf16, sdpa, 8 x 8192 tokens.
One step = forward + backward of -mean log p(next token) through the frozen lm_head with
fastgrpo.fused_linear_logprobs (no [N, V] logits; the sum of the hidden states if that op is missing); no optimizer.
Rows: peak GiB above the weights, median step ms (CUDA events, 5 steps after 2 warm-up steps), and for offload the
copy-stream time per step (CUDA events around each copy) against the step-time difference: exposed = ours - HF,
hidden = copy time - exposed. Each case runs with PEFT's default fp32 adapters and with bf16 adapters (fp32 adapters
save an fp32 copy of every adapted linear's input). Targets: peak <= 60% and step <= 1.05x of HF's.
Cases (CASE_INFO, printed above the table):
    hf_checkpointing  HF's non-reentrant gradient checkpointing, HF modules (the baseline)
    offload           fastgrpo.offload checkpointing alone, HF modules, untiled MLP
    offload_tiled     offload + token-tiled MLP (fastgrpo.ops.tiled_mlp, 8192-token chunks), HF modules otherwise
    patched_offload   the product path: patch_model(model, offload_activations=True) = fused RMSNorm / RoPE / SwiGLU
                      kernels + offload + tiled MLP in patch_model's default chunks (14976 tokens for these shapes;
                      results/offload-nvidia-h200.json ran 8192, the default then)
    one_layer         one decoder layer's forward + backward, not checkpointed, untiled MLP: the part of the peak that
                      no checkpointing of whole layers removes
    one_layer_tiled   the same with the tiled MLP (8192-token chunks): what tiling leaves of it
"""
from __future__ import annotations

import gc
import os
import statistics

import pytest
import torch

from benchmarks.common import QWEN25_15B, GIB, print_table, refuse_script_run, write_results

BATCH, SEQ = 8, int(os.environ.get("FASTGRPO_OFFLOAD_SEQ", "8192"))
WARMUP, STEPS = 2, 5
ROWS: list[dict] = []
_SETUP: dict = {}


def _setup() -> dict:
    """The model and batch, built once for every case (3 GB of bf16 weights)."""
    if _SETUP:
        return _SETUP
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            Qwen2Config(**QWEN25_15B), dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)  # nonzero, so both LoRA factors get real gradients
    model.train()
    ids = torch.randint(0, QWEN25_15B["vocab_size"], (BATCH, SEQ + 1), device="cuda")
    _SETUP.update(model=model, base=model.get_base_model(), inputs=ids[:, :-1], targets=ids[:, 1:].contiguous())
    return _SETUP


def _loss(base, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    try:
        from fastgrpo.ops.fused_linear import fused_linear_logprobs
    except ImportError:
        return hidden.float().sum()
    return -fused_linear_logprobs(hidden, base.lm_head.weight, targets).mean()


def _step(setup: dict) -> None:
    model, base = setup["model"], setup["base"]
    model.zero_grad(set_to_none=True)
    hidden = base.model(input_ids=setup["inputs"], use_cache=False).last_hidden_state  # hidden: [B, T, 1536]
    _loss(base, hidden, setup["targets"]).backward()


def _hf_checkpointing(base, on: bool) -> None:
    """HF's gradient checkpointing, non-reentrant (transformers 5.24 renamed the methods)."""
    if on:
        if hasattr(base, "activation_checkpointing_enable"):
            base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(base, "activation_checkpointing_disable"):
        base.activation_checkpointing_disable()
    else:
        base.gradient_checkpointing_disable()


def _measure(step) -> dict:
    """Peak GiB above what is allocated before a step, and the median of STEPS timed steps after WARMUP."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(STEPS):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return {"ms": statistics.median(times), "peak_gib": (torch.cuda.max_memory_allocated() - base) / GIB}


def _lora_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _set_adapter_dtype(model, adapters: str) -> None:
    """PEFT keeps LoRA weights in fp32 by default (autocast_adapter_dtype=True): then every adapted linear saves an
    fp32 copy of its input, 7 per layer. "bf16" casts them to bf16 (as autocast_adapter_dtype=False would)."""
    dtype = torch.float32 if adapters == "fp32" else torch.bfloat16
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(dtype)


def _run_hf(setup: dict) -> dict:
    _hf_checkpointing(setup["base"], True)
    try:
        measured = _measure(lambda: _step(setup))
        setup["hf_grads"] = _lora_grads(setup["model"])
    finally:
        _hf_checkpointing(setup["base"], False)
    return measured


def _run_offload(setup: dict, hf: dict | None, patch: dict | None = None) -> dict:
    """Offload checkpointing with a copy-timing offloader; with `patch`, through patch_model(model, **patch)."""
    from fastgrpo.offload import ActivationOffloader, disable_offload_checkpointing, enable_offload_checkpointing
    from fastgrpo.patching import patch_model, unpatch_model

    layers = setup["base"].model.layers
    offloader = ActivationOffloader("cuda", record_copy_times=True)
    if patch is not None:  # its layers get the offloader from patch_model, with the tiled MLP's chunk and data
        patch_model(setup["model"], **{**patch, "offload_activations": offloader})
    else:
        enable_offload_checkpointing(layers, offloader=offloader)
    allocations = []

    def step():
        _step(setup)
        allocations.append(offloader.pool.num_allocations)

    try:
        measured = _measure(step)
        copy_ms = offloader.copy_ms() / (WARMUP + STEPS)  # the warm-up steps' copies are timed too
        grads = _lora_grads(setup["model"])
    finally:
        if patch is not None:
            unpatch_model(setup["model"])
        disable_offload_checkpointing(layers)
    measured.update(
        copy_ms_per_step=copy_ms, pinned_gib=offloader.pool.bytes_held / GIB,
        pool_grew_after_warmup=allocations[-1] != allocations[0],
    )
    if hf is not None:
        exposed = measured["ms"] - hf["ms"]
        measured.update(
            peak_vs_hf=measured["peak_gib"] / hf["peak_gib"], step_vs_hf=measured["ms"] / hf["ms"],
            exposed_ms=exposed, hidden_ms=copy_ms - max(exposed, 0.0),
            lora_grad_max_rel_diff=max(
                ((grads[k] - g).norm() / g.norm().clamp_min(1e-30)).item() for k, g in setup["hf_grads"].items()
            ),
        )
        measured["meets_targets"] = measured["peak_vs_hf"] <= 0.60 and measured["step_vs_hf"] <= 1.05
    return measured


def _run_one_layer(setup: dict, tiled: bool = False) -> dict:
    """One decoder layer's forward + backward, not checkpointed: what every per-layer scheme still holds at once
    during a layer's recompute + backward. tiled: its MLP tiled (patch_model with tiled_mlp alone)."""
    from fastgrpo.patching import patch_model, unpatch_model

    if tiled:
        patch_model(setup["model"], rms_norm=False, rope=False, swiglu=False, fused_loss=False, tiled_mlp=True,
                    mlp_chunk_tokens=8192)
    try:
        return _one_layer_step(setup)
    finally:
        if tiled:
            unpatch_model(setup["model"])


def _one_layer_step(setup: dict) -> dict:
    layer = setup["base"].model.layers[0]
    x = torch.randn(BATCH, SEQ, QWEN25_15B["hidden_size"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    position_ids = torch.arange(SEQ, device="cuda").expand(BATCH, SEQ)
    position_embeddings = setup["base"].model.rotary_emb(x, position_ids)

    def step():
        x.grad = None
        layer(x, position_embeddings=position_embeddings, position_ids=position_ids).float().sum().backward()

    return _measure(step)


CASE_INFO = {
    "hf_checkpointing": "HF non-reentrant gradient checkpointing, HF modules (baseline)",
    "offload": "fastgrpo offload checkpointing, HF modules, untiled MLP",
    "offload_tiled": "offload + tiled MLP (8192-token chunks), HF modules otherwise",
    "patched_offload": "product: patch_model(model, offload_activations=True) = fused kernels + offload + tiled MLP",
    "one_layer": "one decoder layer fwd+bwd, not checkpointed, untiled MLP",
    "one_layer_tiled": "one decoder layer fwd+bwd, not checkpointed, tiled MLP (8192-token chunks)",
}
PATCHES = {  # patch_model options of the cases that go through it
    "offload_tiled": dict(rms_norm=False, rope=False, swiglu=False, fused_loss=False, offload_activations=True,
                          mlp_chunk_tokens=8192),
    "patched_offload": dict(offload_activations=True),
}
CASES = [(adapters, case) for adapters in ("fp32", "bf16") for case in CASE_INFO]


@pytest.mark.parametrize("adapters,case", CASES, ids=[f"{a}-{c}" for a, c in CASES])
def test_case(adapters, case):
    setup = _setup()
    _set_adapter_dtype(setup["model"], adapters)  # fp32 cases run first: the bf16 cast happens once
    hf = next((r for r in ROWS if r["case"] == "hf_checkpointing" and r["adapters"] == adapters), None)
    try:
        if case == "hf_checkpointing":
            measured = _run_hf(setup)
        elif case.startswith("one_layer"):
            measured = _run_one_layer(setup, tiled=case == "one_layer_tiled")
        else:
            measured = _run_offload(setup, hf, PATCHES.get(case))
    finally:
        setup["model"].zero_grad(set_to_none=True)
    row = {"case": case, "adapters": adapters, "tokens": BATCH * SEQ, **measured}
    if not case.startswith("one_layer"):
        row["tokens_per_s"] = BATCH * SEQ / row["ms"] * 1e3
    ROWS.append(row)
    _write()


def _write() -> None:
    hidden_bytes = BATCH * SEQ * QWEN25_15B["hidden_size"] * 2
    write_results("offload", ROWS, {
        "model": "qwen2.5-1.5b shapes, random weights, LoRA r=16 all-linear (adapters fp32 = PEFT default, or bf16), "
                 "bf16, sdpa",
        "batch": BATCH, "seq": SEQ, "warmup_steps": WARMUP, "timed_steps": STEPS,
        "loss": "fused_linear_logprobs through the frozen lm_head (sum of hidden states if missing)",
        "checkpoint_inputs_gib_hf": QWEN25_15B["num_hidden_layers"] * hidden_bytes / GIB,
        "targets": {"peak_vs_hf": 0.60, "step_vs_hf": 1.05},
        "cases": CASE_INFO,
    })


def teardown_module(module):
    if ROWS:
        print()
        for case, info in CASE_INFO.items():
            print(f"{case:<17} {info}")
        print_table(ROWS, ["case", "adapters", "ms", "peak_gib", "step_vs_hf", "peak_vs_hf", "copy_ms_per_step",
                           "exposed_ms", "hidden_ms", "pinned_gib", "lora_grad_max_rel_diff"])


@pytest.fixture(autouse=True, scope="module")
def _free_model():
    yield
    _SETUP.clear()
    gc.collect()
    torch.cuda.empty_cache()


if __name__ == "__main__":
    refuse_script_run(__file__)
