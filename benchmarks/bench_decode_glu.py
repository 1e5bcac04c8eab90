"""RMSNorm + gate/up GEMM + SiLU in one Triton kernel (fastgrpo.ops.decode_glu) against the decode step's path today,
per call, at the gate/up shapes of Qwen2.5-1.5B and Llama-3.1-8B and 32, 64 and 128 rows.

    python -m benchmarks.bench_decode_glu                        # GPU: both shapes, 32 / 64 / 128 rows
    python -m benchmarks.bench_decode_glu --sweep                # + the kernel over SWEEP's 72 configs
    python -m benchmarks.bench_decode_glu --sweep --rows 64      # the sweep at 64 rows only
    TRITON_INTERPRET=1 python -m benchmarks.bench_decode_glu --dry-run --sweep   # CPU: tiny widths, the same code

Why: today a decode step's MLP input is three graph nodes per layer: RMSNorm (an Inductor kernel), gate/up (one
cuBLAS GEMM over the stacked [2N, K] copy) and SiLU(gate) * up (an Inductor kernel); on Qwen2.5-1.5B ~0.27 ms a step
is small Inductor kernels and ~0.27 ms idle between nodes (benchmarks/NOTES_rollout.md). decode_glu is one node.
Paths, per shape and rows:
  today       Hugging Face's RMSNorm math -> F.linear over the stacked [2N, K] weights -> silu(gate) * up, one
              torch.compile'd function with the decode layers' Inductor options (rollout/regional.py's
              COMBO_LAYER_OPTIONS: reductions unsplit, combo kernels)
  decode_glu  the Triton kernel on fold_norm_weight's copy (the norm weight folded in), its default_config
  gemm        cuBLAS's GEMM alone (F.linear on the normalized x), for scale
Columns: config (the kernel's: block_m/block_n/block_k/split_k/num_warps/num_stages), us per call
(common.kernel_us: CUDA graphs of 20 calls over copies of the weights that pass 3x the L2, as a decode step reads
them from HBM), tb_s (the weights' 2 N K bytes over that time), bw_share (of the measured copy bandwidth),
max_rel_err (max |h - exact| / max |exact|, exact: fp64 from the same bf16 inputs with the unfolded weights; the
GEMM alone: -), vs_today (today's us over this row's). Inputs: x normal with rows of different scales, weights
normal(0, 0.02), the norm weight 1 + 0.1 normal, all bf16. --sweep: the kernel over SWEEP's tiles x stages x splits
(config_for's for two programs per SM, and twice that); a config the card cannot run (shared memory, registers) is
a row with its error. Writes benchmarks/results/decode_glu-<card>.json after every shape and rows (dry run: a temp
dir, a tiny width under the interpreter); prints the sweep's fastest configs, then the table.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools

import torch
import torch.nn.functional as F
import triton

from benchmarks.common import (LLAMA31_8B, QWEN25_15B, check_interpreted, copies_past_l2, kernel_us, listed,
                               positive_ints, print_sweep_report, require_cuda, run_cases)
from fastgrpo.ops.decode_glu import decode_glu, fold_norm_weight

SHAPES = {"qwen2.5-1.5b": QWEN25_15B, "llama-3.1-8b": LLAMA31_8B}
DRY_SHAPE = dict(hidden_size=48, intermediate_size=40, rms_norm_eps=1e-6)  # odd tile counts at 16-wide tiles
ROWS, DRY_ROWS = "32,64,128", "5,17"
SWEEP = dict(block_n=(32, 64), block_k=(64, 128, 256), num_warps=(4, 8), num_stages=(3, 4, 5), split_times=(1, 2))
COLUMNS = ["shape", "rows", "path", "config", "us", "tb_s", "bw_share", "max_rel_err", "vs_today"]
SWEEP_COLUMNS = ["shape", "rows", "config", "us", "tb_s", "max_rel_err", "vs_today", "error"]
BEST_SHOWN = 5  # per shape and rows, in the printed sweep table (the JSON has every config)


def rms_norm(x: torch.Tensor, norm_w: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Llama / Qwen2 RMSNorm: normalized in fp32, rounded to x's dtype, times the weight."""
    h = x.float()
    return norm_w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def todays_path(x: torch.Tensor, norm_w: torch.Tensor, w_gu: torch.Tensor, eps: float) -> torch.Tensor:
    """The decode step's MLP input as Hugging Face's modules compute it over the engine's stacked copy."""
    gate, up = F.linear(rms_norm(x, norm_w, eps), w_gu).chunk(2, dim=-1)
    return F.silu(gate) * up


def exact(x: torch.Tensor, norm_w: torch.Tensor, w_gu: torch.Tensor, eps: float) -> torch.Tensor:
    """fp64 from the same inputs, the norm weight not folded in."""
    x64 = x.double()
    x_norm = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps) * norm_w.double()
    gate, up = (x_norm @ w_gu.double().T).chunk(2, dim=-1)
    return F.silu(gate) * up


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def sweep_configs(M: int, N: int, K: int, device: torch.device) -> list:
    """SWEEP's configs for h [M, N] (splits: config_for's for two programs per SM, and twice that); the interpreter:
    three 16-wide ones."""
    from fastgrpo.kernels.decode_glu import MAX_BLOCK_M
    from fastgrpo.kernels.fp8_linear import Fp8LinearConfig, config_for

    if device.type != "cuda":
        return [Fp8LinearConfig(16, 16, 16, split) for split in (1, 2)] + [Fp8LinearConfig(16, 32, 32, 1)]
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    configs = []
    for block_n, block_k, warps, stages, times in itertools.product(*SWEEP.values()):
        config = config_for(M, N, K, sms, block_n, block_k, 2, warps, stages, max_block_m=MAX_BLOCK_M)
        configs.append(dataclasses.replace(config, split_k=config.split_k * times))
    return configs


def shape_rows(shape: str, dims: dict, M: int, device: str, bandwidth: float | None, sweep: bool) -> tuple:
    """(rows, sweep rows) of one shape at M rows."""
    from fastgrpo.kernels.decode_glu import decode_glu_fwd, default_config

    K, N, eps = dims["hidden_size"], dims["intermediate_size"], dims["rms_norm_eps"]
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(M, K, device=device, generator=g)
         * (0.1 + 3 * torch.rand(M, 1, device=device, generator=g))).bfloat16()
    norm_w = (1 + 0.1 * torch.randn(K, device=device, generator=g)).bfloat16()
    stacked = [(torch.randn(2 * N, K, device=device, generator=g) * 0.02).bfloat16()
               for _ in range(copies_past_l2(2 * N * K * 2, device))]
    folded = [fold_norm_weight(w[:N], w[N:], norm_w) for w in stacked]
    want = exact(x, norm_w, stacked[0], eps)
    torch._dynamo.reset()  # a fresh compile per shape and rows (static shapes, as the engine compiles its layers)
    if device == "cuda":
        from fastgrpo.rollout.regional import COMBO_LAYER_OPTIONS

        today = torch.compile(todays_path, dynamic=False, options=dict(COMBO_LAYER_OPTIONS))
    else:
        today = todays_path
    x_norm = rms_norm(x, norm_w, eps)

    def row(path, us, err=None, config=None):
        out = {"shape": shape, "rows": M, "N": N, "K": K, "path": path,
               "config": None if config is None else "/".join(map(str, dataclasses.astuple(config))), "us": us,
               "tb_s": 2 * N * K * 2 / (us * 1e-6) / 1e12, "max_rel_err": err}
        if bandwidth:
            out["bw_share"] = 2 * N * K * 2 / (us * 1e-6) / bandwidth
        return out

    today_us = kernel_us([functools.partial(today, x, norm_w, w, eps) for w in stacked], device)
    rows = [row("today", today_us, rel_err(today(x, norm_w, stacked[0], eps), want)),
            row("decode_glu", kernel_us([functools.partial(decode_glu, x, w, eps) for w in folded], device),
                rel_err(decode_glu(x, folded[0], eps), want), default_config(M, N, K, x.device)),
            row("gemm", kernel_us([functools.partial(F.linear, x_norm, w) for w in stacked], device))]
    swept = []
    for config in sweep_configs(M, N, K, x.device) if sweep else []:
        calls = [functools.partial(decode_glu_fwd, x, w, eps, "silu", config) for w in folded]
        try:  # Triton refuses a config past the card's shared memory or registers at the eager warm-up call
            swept.append(row("sweep", kernel_us(calls, device), rel_err(calls[0](), want), config))
        except triton.runtime.errors.OutOfResources as error:
            swept.append({**row("sweep", float("nan"), None, config), "error": str(error)[:120]})
    for r in rows + swept:
        r["vs_today"] = today_us / r["us"]
    return rows, swept


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny widths on the CPU (needs TRITON_INTERPRET=1)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of " + ", ".join(SHAPES))
    parser.add_argument("--rows", help=f"comma-separated row counts (default {ROWS}; dry run {DRY_ROWS})")
    parser.add_argument("--sweep", action="store_true", help="also time the kernel over SWEEP's configs")
    args = parser.parse_args(argv)
    shapes = listed(parser, "--shapes", args.shapes, SHAPES)
    row_counts = positive_ints(parser, "--rows", args.rows or (DRY_ROWS if args.dry_run else ROWS))
    check_interpreted(parser, args.dry_run)
    if not args.dry_run:
        require_cuda(parser)
    device = "cpu" if args.dry_run else "cuda"
    bandwidth = None
    if not args.dry_run:
        from benchmarks.bench_rollout import _copy_bandwidth
        from fastgrpo.ops.fp8_linear import prepare_fp8_linear

        prepare_fp8_linear(torch.device(device))  # the split-K tickets (decode_glu shares them), before any capture
        bandwidth = _copy_bandwidth()
    config = {"copy_bandwidth_bytes_s": bandwidth, "sweep": SWEEP, "dtype": "bfloat16",
              "timing": "common.kernel_us (CUDA graph of 20 calls, weights past L2)"}
    rows, swept = run_cases(
        "decode_glu", itertools.product(["tiny"] if args.dry_run else shapes, row_counts),
        lambda shape, M: shape_rows(shape, DRY_SHAPE if args.dry_run else SHAPES[shape], M, device, bandwidth,
                                    args.sweep),
        config, args.dry_run)
    print_sweep_report(rows, swept, args.sweep, ("shape", "rows"), BEST_SHOWN, SWEEP_COLUMNS, COLUMNS)


if __name__ == "__main__":
    main()
