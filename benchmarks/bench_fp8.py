"""FP8 rollouts (EngineConfig(weights="fp8" | "w8a8")) against bf16: the decode GEMMs, rollout tokens/s and memory,
and the log-prob gap to the trainer, on the same samples.

    python -m benchmarks.bench_fp8                      # GPU: Qwen2.5-1.5B then Llama-3.1-8B shapes, one H200 ~4 min
    python -m benchmarks.bench_fp8 --dry-run            # CPU check: a tiny model, the same code (torch path of the op)
    python -m benchmarks.bench_fp8 --modes bf16,fp8,bf16-triton,fp8-triton   # also with the Triton decode attention
    python -m benchmarks.bench_fp8 --modes bf16,fp8,4bit-dense,4bit-fp8   # + an NF4 base (needs bitsandbytes)
    python -m benchmarks.bench_fp8 --shapes llama-3.1-8b --modes bf16-triton,fused-triton,fp8-triton,4bit-dense-triton
    python -m benchmarks.bench_fp8 --shapes llama-3.1-8b --modes fused-triton,fp8-triton,w8a8-triton   # W8A8
    python -m benchmarks.bench_fp8 --shapes llama-3.1-8b --no-gemms \
        --modes fused-triton,4bit-dense-triton,4bit-triton,4bit-nf4-triton   # NF4 read by the W4A16 kernel

Per shape (random bf16 weights: bench_rollout.build_model; bench_rollout's request: 8 prompts x 8 samples, prompt
256 random ids, 1024 new tokens, temperature 1, EOS ignored):
  gemm rows     each distinct linear of a decode step at 64 rows, and each stack of siblings the FP8 copies run as
                one GEMM (q+k+v, gate+up): cuBLAS bf16 (F.linear) against fp8_linear (W8A16) with default_config
                and the best of `sweep` (tiles, warps, splits), and fp8_scaled_linear (W8A8, compiled as in the
                decode step: the activations' quantizer fused) with its rowwise scales (w8a8_us) and with scalar
                scales, an fp32 out and the scales multiplied after (w8a8_tensorwise_us: the layout it did not
                take), and through the Triton kernel with e4m3 x (w8a8_triton_us, the same compiled op with
                gemm="triton"; its kernel alone at default_config and the best of `w8a8_sweep`: w8a8_kernel_us,
                w8a8_best_us), and with bitsandbytes installed nf4_linear (W4A16) over the weight in NF4 as the 4bit*
                bases hold it (blocksize 64, nested absmax; nf4_us, and the best of `nf4_sweep`: nf4_best_us, to
                tune its default_config) against bitsandbytes' own matmul_4bit (bnb_us); us per call, kernel
                time (common.kernel_us: 20 calls captured in a CUDA graph, the replay timed), and the weight bytes read
                per second over the measured copy bandwidth (share). The sweep is there to tune default_config.
  rollout rows  one engine mode each (MODES): a warm-up call stopped after 32 steps (first_s: compile + graph
                capture; profile_rollout's StepClock) then `repeats` timed calls (wall, synchronized): tok_s, ms_step
                (prefill and text decoding included), decode_ms (decode steps 17-1024 alone), speedup over bf16,
                peak GiB above the weights,
                the copy's GiB (copy_bytes) and build seconds (one decode_weights entry, synchronized). 4bit*:
                the decoder linears converted to bitsandbytes NF4 in place (the model's own forward, "dense",
                "fp8" and "w8a8" copies of it, "nf4": no copy, its own 4-bit weights read by nf4_linear): a 4-bit
                base should decode at least as fast as the bf16 one. The FP8 and "dense" copies of a 4-bit base run
                q/k/v and gate/up stacked, one GEMM each; "fused" does that in bf16; "nf4" runs them apart.
  gap           on the last timed call's samples: the trainer's log-probs of them (loss.model.sequence_logprobs,
                8 rows at a time: pi_old in training) against the engine's: loss.correction.logprob_gap (mean and
                max |gap| per token, k1 / k3 estimates of KL(engine || trainer) per token) and xent, the sampled
                tokens' mean -log p under the engine. bf16's own gap is the engine/trainer mismatch without FP8.
Random weights give flat distributions (xent near ln V): the gap here shows the plumbing and an order of magnitude,
not what a trained checkpoint loses (measure that on real weights before relying on it).
Writes benchmarks/results/fp8-<card>.json after every row (dry run: a temp dir) and prints the tables last.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib.util
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from benchmarks import common
from benchmarks.bench_rollout import _copy_bandwidth, build_model, weight_bytes
from benchmarks.profile_rollout import StepClock, rollout
from benchmarks.common import (GIB, RolloutSizes, copies_past_l2, kernel_us, listed, print_table,
                               require_cuda, write_results)
from fastgrpo.hf.peft import dense_linears
from fastgrpo.loss.correction import logprob_gap
from fastgrpo.loss.model import sequence_logprobs
from fastgrpo.ops.fp8_linear import fp8_linear, prepare_fp8_linear, quantize_fp8, quantize_rows
from fastgrpo.ops import fp8_scaled_linear as fp8_scaled_linear_module
from fastgrpo.ops.fp8_scaled_linear import fp8_scaled_linear
from fastgrpo.ops.nf4_linear import nf4_linear, prepare_nf4_linear
from fastgrpo.rollout.decode_weights import copy_bytes, decode_weights, fused_groups
from fastgrpo.rollout.decode import EngineConfig

SHAPES = ("qwen2.5-1.5b", "llama-3.1-8b")
DRY_SHAPE = "tiny-qwen2"
# seconds after the start past which a rollout mode is skipped (--deadline). The gemm rows are no longer quick: they
# compile W8A8's two variants per shape (14 compiles for Llama-3.1-8B), so three modes of one shape may need more
DEADLINE_S = 230
# mode -> (EngineConfig, base): base "bf16" is the built model, "4bit" its decoder linears in bitsandbytes NF4;
# attention and weights named, not left to EngineConfig's "auto" defaults, so each mode is what its name says
SDPA, TRITON = dict(attention="sdpa"), dict(attention="triton")
MODES = {
    "bf16": (EngineConfig(**SDPA, weights="model"), "bf16"),
    "fp8": (EngineConfig(**SDPA, weights="fp8"), "bf16"),
    "bf16-triton": (EngineConfig(**TRITON, weights="model"), "bf16"),
    "fp8-triton": (EngineConfig(**TRITON, weights="fp8"), "bf16"),
    "w8a8-triton": (EngineConfig(**TRITON, weights="w8a8"), "bf16"),  # the FP8 copy on the FP8 tensor cores
    # the same with torch._scaled_mm as fp8_scaled_linear's GEMM (W8A8_GEMMS) instead of its default (Triton)
    "w8a8-scaledmm-triton": (EngineConfig(**TRITON, weights="w8a8"), "bf16"),
    # bf16 with q/k/v and gate/up stacked (one GEMM per group), as "fp8" runs them: fp8 against this isolates FP8
    "fused-triton": (EngineConfig(**TRITON, weights="fused"), "bf16"),
    # the KV cache in e4m3 + an fp32 scale per vector (EngineConfig.kv_cache): against fused-triton / fp8-triton
    "fp8kv-triton": (EngineConfig(**TRITON, weights="fused", kv_cache="fp8"), "bf16"),
    "fp8-fp8kv-triton": (EngineConfig(**TRITON, weights="fp8", kv_cache="fp8"), "bf16"),
    "w8a8-fp8kv-triton": (EngineConfig(**TRITON, weights="w8a8", kv_cache="fp8"), "bf16"),
    # each prompt's K/V stored and read once per group (EngineConfig.shared_prefix), bf16 and with both FP8 halves
    "fused-shared-triton": (EngineConfig(**TRITON, weights="fused", shared_prefix=True), "bf16"),
    "w8a8-fp8kv-shared-triton": (EngineConfig(**TRITON, weights="w8a8", kv_cache="fp8", shared_prefix=True), "bf16"),
    "4bit": (EngineConfig(**SDPA, weights="model"), "4bit"),  # bitsandbytes' own forward: each step dequantizes
    "4bit-dense": (EngineConfig(**SDPA, weights="dense"), "4bit"),
    "4bit-fp8": (EngineConfig(**SDPA, weights="fp8"), "4bit"),
    "4bit-dense-triton": (EngineConfig(**TRITON, weights="dense"), "4bit"),
    # what weights="auto" falls back to when no copy fits: bitsandbytes dequantizes each layer at every step
    "4bit-triton": (EngineConfig(**TRITON, weights="model"), "4bit"),
    "4bit-w8a8-triton": (EngineConfig(**TRITON, weights="w8a8"), "4bit"),
    # no copy: nf4_linear reads each NF4 base's own 4-bit weight (LoRA-free here; lm_head bf16 as in every 4bit mode)
    "4bit-nf4-triton": (EngineConfig(**TRITON, weights="nf4"), "4bit"),
}
# modes whose W8A8 linears run another GEMM than fp8_scaled_linear's default (fp8_scaled_linear.GEMM)
W8A8_GEMMS = {"w8a8-scaledmm-triton": "scaled_mm"}
SCORE_ROWS = 8  # rows per sequence_logprobs call of the gap
WARMUP_STEPS = 32  # the warm-up call's length: past the graph capture (EngineConfig.warmup_steps + 1), a sync step
NF4_BYTES = 0.5 + 1 / 64  # per weight read by nf4_linear: a nibble, and a uint8 absmax code per block of 64


@dataclasses.dataclass(frozen=True)
class Sizes(RolloutSizes):
    repeats: int = 1


GPU_SIZES = Sizes()
DRY_SIZES = Sizes(prompts=2, generations=2, prompt_len=8, new_tokens=64)


def sweep(M: int, N: int, K: int, device: torch.device) -> list:
    """Alternatives to default_config for one GEMM: 64 / 128 / 256 features (256 with 8 warps only: 4 spill)
    x 4 / 8 warps x splits for one or two programs per SM, 128 of K per step and 3 stages; and 256 of K per step."""
    from fastgrpo.kernels.fp8_linear import config_for

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    configs = {config_for(M, N, K, sms, block_n, 128, per_sm, warps, 3)
               for block_n in (64, 128, 256) for warps in (4, 8) for per_sm in (1, 2) if (block_n, warps) != (256, 4)}
    configs |= {config_for(M, N, K, sms, 128, 256, per_sm, 8, 3) for per_sm in (1, 2)}
    return sorted(configs, key=dataclasses.astuple)


def w8a8_sweep(M: int, N: int, K: int, device: torch.device) -> list:
    """Configs of the kernel with e4m3 x (half the bytes of x per K step, no upcast, so wider tiles may pay now):
    64 / 128 features x 128 / 256 of K x 3 / 4 / 5 stages x splits for one, two or four programs per SM (4 warps), and
    256 features with 8 warps."""
    from fastgrpo.kernels.fp8_linear import config_for

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    configs = {config_for(M, N, K, sms, block_n, block_k, per_sm, 4, stages)
               for block_n in (64, 128) for block_k in (128, 256) for stages in (3, 4, 5) for per_sm in (1, 2, 4)}
    configs |= {config_for(M, N, K, sms, 256, 128, per_sm, 8, 3) for per_sm in (1, 2, 4)}
    return sorted(configs, key=dataclasses.astuple)


def _timed_configs(configs, calls, device: str) -> dict:
    """config -> kernel us of calls(config), for each config the card can run (one past its shared memory or
    registers is skipped: Triton refuses it at the eager warm-up call, before any capture)."""
    import triton

    timed = {}
    for config in configs:
        try:
            timed[config] = kernel_us(calls(config), device)
        except triton.runtime.errors.OutOfResources:
            continue
    return timed


def _w8a8_kernel_row(x: torch.Tensor, qs: list) -> dict:
    """The W8A8 Triton kernel alone (x quantized beforehand) at default_config and the best of w8a8_sweep, us per
    call."""
    from fastgrpo.kernels.fp8_linear import default_config, fp8_linear_fwd

    xq, sx = quantize_rows(x)
    M, K = x.shape
    N = qs[0][0].shape[0]

    def calls(config):
        return [functools.partial(fp8_linear_fwd, xq, q, s, None, config, x_scale=sx, out_dtype=torch.bfloat16)
                for q, s in qs]

    default = default_config(M, N, K, x.device, fp8_x=True)
    timed = _timed_configs({default, *w8a8_sweep(M, N, K, x.device)}, calls, x.device.type)
    best = min(timed, key=timed.get)
    return {"w8a8_kernel_us": timed[default], "w8a8_best_us": timed[best], "w8a8_best": str(dataclasses.astuple(best)),
            "w8a8_sweep_us": {str(dataclasses.astuple(c)): us for c, us in sorted(timed.items(), key=lambda kv: kv[1])}}


def nf4_sweep(M: int, N: int, K: int, device: torch.device) -> list:
    """Alternatives to nf4_linear's default_config, one stage each (more stages make the code-table gathers
    cp.async copies: kernels/nf4_linear.py): 64 / 128 features x 4 / 8 warps x 128 / 256 of K per step x splits
    for two, four or eight programs per SM (24 configs, fewer where two fill the same splits)."""
    from fastgrpo.kernels.fp8_linear import config_for

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    configs = {config_for(M, N, K, sms, block_n, block_k, per_sm, warps, 1)
               for block_n in (64, 128) for warps in (4, 8) for block_k in (128, 256) for per_sm in (2, 4, 8)}
    return sorted(configs, key=dataclasses.astuple)


def _nf4_sweep_row(x: torch.Tensor, fours: list, device: str) -> dict:
    """nf4_linear's default config and the best of nf4_sweep, us per call."""
    from fastgrpo.kernels.nf4_linear import default_config, nf4_linear_fwd
    from fastgrpo.ops.nf4_linear import nf4_weight

    ws = [nf4_weight(p, st) for p, st in fours]
    M, K = x.shape
    N = ws[0].N

    def calls(config):
        return [functools.partial(nf4_linear_fwd, x, w.packed, w.absmax, w.code, w.absmax_code, w.absmax_scale,
                                  w.offset, None, w.N, w.blocksize, w.nested_blocksize, config) for w in ws]

    timed = _timed_configs(nf4_sweep(M, N, K, x.device), calls, device)
    best = min(timed, key=timed.get)
    return {"nf4_best_us": timed[best], "nf4_best": str(dataclasses.astuple(best)),
            "nf4_default": str(dataclasses.astuple(default_config(M, N, K, 64, x.device)))}


def linear_shapes(model) -> dict[tuple[int, int], str]:
    """(N, K) -> the names of the dense linears of that shape (layer 0's and lm_head), and of layer 0's stacks of
    siblings ("q_proj+k_proj+v_proj": the GEMMs the FP8 copies run)."""
    names: dict[tuple[int, int], list[str]] = {}
    dense = dense_linears(model)
    named = {module: name for name, module in model.named_modules()}
    for name, module in model.named_modules():
        if module in dense and (".layers.0." in name or name.endswith("lm_head")):
            names.setdefault((module.out_features, module.in_features), []).append(name.rsplit(".", 1)[-1])
    for group in fused_groups(model, dense, "fp8"):
        if ".layers.0." in named[group[0]]:
            shape = (sum(m.out_features for m in group), group[0].in_features)
            names.setdefault(shape, []).append("+".join(named[m].rsplit(".", 1)[-1] for m in group))
    return {shape: "/".join(n) for shape, n in names.items()}


def _w8a8_tensorwise(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8_scaled_linear with the scale layout it did not take: scalar scales (1) and an fp32 out, the per-row and
    per-channel scales multiplied after (fused with the cast under torch.compile)."""
    xq, sx = quantize_rows(x)
    one = torch.ones((), device=x.device)
    y = torch._scaled_mm(xq, q.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    return (y * sx[:, None] * scale).to(x.dtype)


def gemm_rows(shape: str, model, rows: int, bandwidth: float, device: str) -> list[dict]:
    from fastgrpo.kernels.fp8_linear import default_config, fp8_linear_fwd

    out = []
    g = torch.Generator(device=device).manual_seed(0)
    cuda = device == "cuda"
    # on CUDA compiled, as in the decode step (the activations' quantizer fused into one kernel); eager in the dry run
    w8a8, tensorwise = ((torch.compile(fn, dynamic=False) if cuda else fn)
                        for fn in (fp8_scaled_linear, _w8a8_tensorwise))
    w8a8_triton = functools.partial(w8a8, gemm="triton")
    if cuda:
        prepare_fp8_linear(torch.device(device))  # the W8A16 kernel's split-K tickets, before any capture
        prepare_nf4_linear(torch.device(device))
    nf4 = importlib.util.find_spec("bitsandbytes") is not None
    for (N, K), names in linear_shapes(model).items():
        torch._dynamo.reset()  # a compile per shape: a model has about as many as dynamo's recompile limit (8)
        copies = copies_past_l2(N * K, device)  # of the e4m3 weights
        x = torch.randn(rows, K, device=device, generator=g).bfloat16()
        ws = [(torch.randn(N, K, device=device, generator=g) * 0.02).bfloat16() for _ in range(copies)]
        qs = [quantize_fp8(w) for w in ws]
        row = {"shape": shape, "linear": names, "N": N, "K": K,
               "bf16_us": kernel_us([functools.partial(F.linear, x, w) for w in ws], device),
               "fp8_us": kernel_us([functools.partial(fp8_linear, x, q, s) for q, s in qs], device),
               "w8a8_us": kernel_us([functools.partial(w8a8, x, q, s, gemm="scaled_mm") for q, s in qs], device),
               "w8a8_triton_us": kernel_us([functools.partial(w8a8_triton, x, q, s) for q, s in qs], device),
               "w8a8_tensorwise_us": kernel_us([functools.partial(tensorwise, x, q, s) for q, s in qs], device)}
        if nf4:
            import bitsandbytes.functional as bnb_functional

            # the 4bit* bases' format (bnb.nn.Params4bit's defaults): blocksize 64, nested absmax
            fours = [bnb_functional.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
                     for w in ws]
            row["nf4_us"] = kernel_us([functools.partial(nf4_linear, x, p, st) for p, st in fours], device)
            row["nf4_speedup"] = row["bf16_us"] / row["nf4_us"]
            # the baseline: bitsandbytes' own forward of a Linear4bit at these rows (its call, as the layer makes it)
            import bitsandbytes as bnb

            row["bnb_us"] = kernel_us([functools.partial(bnb.matmul_4bit, x, p.t(), quant_state=st)
                                        for p, st in fours], device)
            row["nf4_share"] = N * K * NF4_BYTES / (row["nf4_us"] * 1e-6) / bandwidth
            if cuda:
                row.update(_nf4_sweep_row(x, fours, device))
            del fours
        if cuda:
            row["default"] = str(dataclasses.astuple(default_config(rows, N, K, x.device)))
            w8a16 = [functools.partial(fp8_linear_fwd, x, q, s, None) for q, s in qs]
            timed = _timed_configs(sweep(rows, N, K, x.device), lambda c: [functools.partial(f, c) for f in w8a16],
                                   device)
            best = min(timed, key=timed.get)
            row.update(best_us=timed[best], best=str(dataclasses.astuple(best)))
            row.update(_w8a8_kernel_row(x, qs))
        row["speedup"] = row["bf16_us"] / row["fp8_us"]
        row["w8a8_speedup"] = row["bf16_us"] / row["w8a8_us"]
        row["w8a8_triton_speedup"] = row["bf16_us"] / row["w8a8_triton_us"]
        for kind, size in (("bf16", 2), ("fp8", 1), ("w8a8", 1), ("w8a8_triton", 1)):
            row[f"{kind}_share"] = N * K * size / (row[f"{kind}_us"] * 1e-6) / bandwidth
        out.append(row)
        del ws, qs
    return out


def to_4bit(model) -> None:
    """Replace the decoder's nn.Linear layers (not lm_head) with bitsandbytes NF4 Linear4bit, in place, quantized on
    the weights' device (on the CPU without bitsandbytes' AVX512-BF16 repacking, which the copies cannot read)."""
    import bitsandbytes as bnb

    head = model.get_output_embeddings()
    for name, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear or module is head:
            continue
        layer = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=module.bias is not None,
                                  compute_dtype=torch.bfloat16, quant_type="nf4", device="meta")
        layer.support_avx512bf16_for_cpu = False
        device = module.weight.device
        layer.weight = bnb.nn.Params4bit(module.weight.data, requires_grad=False, quant_type="nf4").to(device)
        if module.bias is not None:
            layer.bias = module.bias
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def rollout_row(setup: dict, sizes: Sizes, mode: str) -> dict:
    """timed_rollouts' row, from a fresh compile state, with the engine's fallback warnings ("fallbacks")."""
    # each mode compiles the same layer code again: past dynamo's recompile limit (8) a later mode's layers would
    # run eagerly, said only in a log line; a fresh start per mode
    torch._dynamo.reset()
    gemm = W8A8_GEMMS.get(mode, fp8_scaled_linear_module.GEMM)
    with warnings.catch_warnings(record=True) as caught, mock.patch.object(fp8_scaled_linear_module, "GEMM", gemm):
        warnings.simplefilter("always")
        row = timed_rollouts(setup, sizes, mode)
    if MODES[mode][0].weights == "w8a8":
        row["w8a8_gemm"] = gemm
    # the engine's fallbacks (a failed compile or graph capture: eager steps) make a row's speed another mode's
    row["fallbacks"] = sorted({str(w.message)[:300] for w in caught if str(w.message).startswith("rollout:")})
    return row


def timed_rollouts(setup: dict, sizes: Sizes, mode: str) -> dict:
    """Warm-up (compile + capture, stopped after WARMUP_STEPS steps: the same request, so the same compiled step),
    then `repeats` timed calls; the copy's size and build time; the gap on the last call's samples."""
    config, _ = MODES[mode]
    model, device = setup["model"], setup["device"]
    first_s, _ = rollout(setup, sizes, config, StepClock(stop_at=WARMUP_STEPS))
    row = {"shape": setup["shape"], "mode": mode, "first_s": first_s}
    weights = _allocated(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, decode = [], []
    for _ in range(sizes.repeats):
        gc.collect()
        clock = StepClock()
        seconds, result = rollout(setup, sizes, config, clock)
        times.append(seconds)
        decode.append(clock.ms_per_step(config.check_every, sizes.new_tokens))
    seconds = statistics.median(times)
    assert result.completion_ids.shape == (sizes.rows, sizes.new_tokens), result.completion_ids.shape
    row.update(tok_s=sizes.rows * sizes.new_tokens / seconds, ms_step=seconds / sizes.new_tokens * 1e3,
               decode_ms=statistics.median(decode))
    if device == "cuda":
        row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - weights) / GIB
    row["weights_gib"] = weights / GIB
    if config.weights != "model":
        row["copy_gib"] = copy_bytes(model, config.weights) / GIB
        _sync(device)
        start = time.perf_counter()
        with decode_weights(model, config.weights):  # "nf4": no copy, only the forwards swapped
            _sync(device)
            row["copy_build_s"] = time.perf_counter() - start
    row.update(gap(model, result))
    return row


def gap(model, result) -> dict:
    """The trainer's log-probs of the engine's samples against the engine's: logprob_gap, and xent."""
    prompt_mask, completion_mask = result.prompt_mask, result.completion_mask
    ids = torch.cat([result.prompt_ids, result.completion_ids], 1)
    attention = torch.cat([prompt_mask, completion_mask], 1)
    mask = torch.cat([torch.zeros_like(prompt_mask), completion_mask], 1)
    engine = torch.cat([prompt_mask * 0.0, result.logprobs.float()], 1)
    train = torch.cat([sequence_logprobs(model, ids[i:i + SCORE_ROWS], attention[i:i + SCORE_ROWS],
                                         mask[i:i + SCORE_ROWS]).float()
                       for i in range(0, ids.shape[0], SCORE_ROWS)])
    valid = mask.bool()
    return {**logprob_gap(train, engine, mask), "xent": -engine[valid].double().mean().item()}


def run_shape(shape: str, sizes: Sizes, modes: list[str], deadline: float, device: str, write,
              gemms: bool = True) -> None:
    began = time.perf_counter()
    model, tokenizer = build_model(shape, device)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, model.config.vocab_size, (sizes.prompts, sizes.prompt_len), generator=g).tolist()
    setup = {"shape": shape, "model": model, "tokenizer": tokenizer, "prompts": prompts, "device": device}
    bandwidth = _copy_bandwidth() if device == "cuda" else 1e10
    print(f"{shape}: built in {time.perf_counter() - began:.0f} s; weights {weight_bytes(model) / GIB:.2f} GiB "
          f"(bf16), FP8 copy {copy_bytes(model) / GIB:.2f} GiB", flush=True)
    if gemms:
        write(gemm_rows(shape, model, sizes.rows, bandwidth, device), [])
    bf16 = None
    for mode in sorted(modes, key=lambda m: MODES[m][1] == "4bit"):  # the 4-bit conversion is one-way: last
        if time.monotonic() > deadline:
            write([], [{"shape": shape, "mode": mode, "error": "skipped: deadline reached"}])
            continue
        began = time.perf_counter()
        try:
            if MODES[mode][1] == "4bit" and not setup.get("4bit"):
                to_4bit(model)
                setup["4bit"] = True
            row = rollout_row(setup, sizes, mode)
        except Exception as err:  # noqa: BLE001 - a failed mode is reported; the others still run
            row = {"shape": shape, "mode": mode, "error": repr(err)[:300]}
        if mode == "bf16" and "tok_s" in row:
            bf16 = row["tok_s"]
        if bf16 and "tok_s" in row:
            row["speedup_vs_bf16"] = row["tok_s"] / bf16
        print(f"{shape} / {mode}: {time.perf_counter() - began:.0f} s", flush=True)
        write([], [row])
    del setup, model
    torch._dynamo.reset()  # the compiled steps hold the model's modules
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of " + ", ".join(SHAPES))
    parser.add_argument("--modes", default="bf16,fp8", help="comma-separated, of " + ", ".join(MODES))
    parser.add_argument("--repeats", type=int, default=GPU_SIZES.repeats, help="timed calls per mode (median)")
    parser.add_argument("--no-gemms", action="store_true", help="only the rollout rows (the gemm rows compile "
                        "the W8A8 op per shape: about a minute)")
    parser.add_argument("--deadline", type=float, default=DEADLINE_S,
                        help="seconds after the start past which rollout modes are skipped")
    args = parser.parse_args(argv)
    modes = listed(parser, "--modes", args.modes, MODES)
    device = "cpu" if args.dry_run else "cuda"
    sizes = dataclasses.replace(DRY_SIZES if args.dry_run else GPU_SIZES, repeats=args.repeats)
    shapes = [DRY_SHAPE] if args.dry_run else listed(parser, "--shapes", args.shapes, SHAPES)
    if not args.dry_run:
        require_cuda(parser)
    results_dir = Path(tempfile.mkdtemp(prefix="bench_fp8_")) if args.dry_run else common.RESULTS_DIR
    gemms: list[dict] = []
    rollouts: list[dict] = []
    config = {"model": "random weights, bf16 (4bit*: decoder linears NF4), sdpa unless -triton",
              **dataclasses.asdict(sizes), "sampling": "temperature 1, top_k 0, top_p 1, EOS ignored",
              "gap": "trainer sequence_logprobs vs engine log-probs on the engine's samples"}

    def write(new_gemms: list[dict], new_rollouts: list[dict]) -> None:
        gemms.extend(new_gemms)
        rollouts.extend(new_rollouts)
        path = write_results("fp8", [*gemms, *rollouts], config, results_dir)
        print(f"wrote {path}", flush=True)

    # the dry run exercises the op's plain-torch path (the kernel's CPU checks are tests/test_fp8_linear.py)
    env = mock.patch.dict("os.environ", {"TRITON_INTERPRET": "0"}) if args.dry_run else mock.patch.dict("os.environ")
    deadline = time.monotonic() + args.deadline
    with env:
        for shape in shapes:
            run_shape(shape, sizes, modes, deadline, device, write, gemms=not args.no_gemms)
    print()
    print_table(gemms, ["shape", "linear", "N", "K", "bf16_us", "fp8_us", "w8a8_us", "w8a8_tensorwise_us",
                        "w8a8_triton_us", "nf4_us", "bnb_us", "speedup", "w8a8_speedup", "w8a8_triton_speedup",
                        "nf4_speedup", "bf16_share", "fp8_share", "w8a8_share", "w8a8_triton_share", "nf4_share",
                        "best_us", "best", "default", "w8a8_kernel_us", "w8a8_best_us", "w8a8_best", "nf4_best_us",
                        "nf4_best", "nf4_default"])
    print()
    print_table(rollouts, ["shape", "mode", "w8a8_gemm", "tok_s", "speedup_vs_bf16", "ms_step", "decode_ms", "first_s",
                           "peak_extra_gib", "copy_gib", "copy_build_s", "tokens", "mean_abs_gap", "max_abs_gap",
                           "kl_k1", "kl_k3", "xent", "fallbacks", "error"])


if __name__ == "__main__":
    main()
