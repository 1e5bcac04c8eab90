"""W8A8's activation scales per row (the engine's) against per group along K (fp8_scaled_linear's x_group), for each
decode linear with the kernel that makes its input, as a decode step compiles them.

    python -m benchmarks.bench_w8a8_scales                 # GPU: Qwen2.5-1.5B and Llama-3.1-8B shapes, ~1 min
    python -m benchmarks.bench_w8a8_scales --dry-run       # CPU check: tiny widths (needs TRITON_INTERPRET=1)

Why: a row's scale needs the row's amax before any of it is quantized, so the quantizer is a reduction over the
whole row with one program per row: 64 programs for a 64-row decode step. The SwiGLU output's (the down
projection's input, 14336 wide for Llama-3.1-8B) took 6.9 us a call, 0.22 ms of a 6.9 ms FP8 decode step
(benchmarks/NOTES_rollout.md). A scale per group of x_group values needs only the group: many programs, one pass;
the GEMM then scales each K step's dot by its group's scales instead of the output by the row's. What it measured
on an H200 is in benchmarks/NOTES_rollout.md (the engine keeps rows).

Per linear (64 rows; q/k/v and gate/up stacked, as the decode copies run them) and scales ("rows", "groups128",
"groups256"), Inductor-compiled with its producer (RMSNorm before q/k/v and gate/up; SiLU(gate) x up before down;
none before o, the attention's output), us per call as common.kernel_us times a decode step's kernels (graphed, the
weights read from HBM): `step_us` producer + quantizer + GEMM, `quant_us` producer + quantizer alone, `gemm_us` the
Triton GEMM alone on the quantized x. `rel_err`: mean |y - exact| / mean |exact|, exact the fp64 product of the
producer's output (unquantized) and the dequantized weight; the inputs carry 1% of channels at 30x (as LLM
activations have a few large channels), where a row's scale costs its small values precision. `bf16_us`: the
producer and cuBLAS's bf16 GEMM of the same weight, for scale. Writes benchmarks/results/w8a8_scales-<card>.json.
"""
from __future__ import annotations

import argparse
import functools
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import copies_past_l2, kernel_us, listed, print_table, require_cuda, write_results
from benchmarks.e2e import MODEL_CONFIGS
from fastgrpo.ops.fp8_linear import dequantize_fp8, prepare_fp8_linear, quantize_fp8, quantize_groups, quantize_rows
from fastgrpo.ops.fp8_scaled_linear import fp8_scaled_linear

SHAPES = ("qwen2.5-1.5b", "llama-3.1-8b")
SCALES = {"rows": None, "groups128": 128, "groups256": 256}
DRY_SCALES = {"rows": None, "groups16": 16, "groups32": 32}
ROWS, DRY_ROWS = 64, 5
OUTLIERS, OUTLIER_GAIN = 0.01, 30.0
COLUMNS = ["shape", "linear", "N", "K", "scales", "step_us", "quant_us", "gemm_us", "bf16_us", "rel_err"]


def linears(shape: str, dry_run: bool) -> list[tuple[str, str, int, int]]:
    """(name, producer, N, K) of a decoder layer's linears as the decode copy runs them."""
    c = MODEL_CONFIGS["tiny-qwen2" if dry_run else shape]
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * head_dim
    return [("q/k/v", "norm", qkv, hidden), ("o", "none", hidden, hidden), ("gate/up", "norm", 2 * inter, hidden),
            ("down", "swiglu", hidden, inter)]


def produce(kind: str, inp: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """The linear's input from the step's tensor before it, in the step's dtype."""
    if kind == "norm":
        h = inp.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(inp.dtype) * norm_weight
    if kind == "swiglu":
        gate, up = inp.chunk(2, dim=-1)
        return F.silu(gate) * up
    return inp


def quantize(x: torch.Tensor, x_group: int | None):
    return quantize_rows(x) if x_group is None else quantize_groups(x, x_group)


def gemm_alone(xq, sx, q, scale, x_group):
    from fastgrpo.kernels.fp8_linear import fp8_linear_fwd

    return fp8_linear_fwd(xq, q, scale, None, x_scale=sx, out_dtype=torch.bfloat16, x_group=x_group)


def linear_rows(shape: str, name: str, kind: str, N: int, K: int, scales: dict, rows: int, device: str) -> list:
    g = torch.Generator(device=device).manual_seed(0)
    width = 2 * K if kind == "swiglu" else K
    gain = torch.ones(width, device=device)
    gain[torch.randperm(width, generator=g, device=device)[:max(1, int(OUTLIERS * width))]] = OUTLIER_GAIN
    inp = (torch.randn(rows, width, device=device, generator=g) * gain).bfloat16()
    norm_weight = (1 + 0.1 * torch.randn(K, device=device, generator=g)).bfloat16()
    ws = [(torch.randn(N, K, device=device, generator=g) * 0.02).bfloat16()
          for _ in range(copies_past_l2(N * K, device))]
    qs = [quantize_fp8(w) for w in ws]
    x = produce(kind, inp, norm_weight)
    exact = x.double() @ dequantize_fp8(*qs[0], torch.float64).T
    compiled = functools.partial(torch.compile, dynamic=False) if device == "cuda" else (lambda fn: fn)
    bf16 = compiled(lambda t, w: F.linear(produce(kind, t, norm_weight), w))
    out = []
    for label, x_group in scales.items():
        torch._dynamo.reset()
        step = compiled(lambda t, q, s: fp8_scaled_linear(produce(kind, t, norm_weight), q, s, None, "triton", x_group))
        quant = compiled(lambda t: quantize(produce(kind, t, norm_weight), x_group))
        xq, sx = quantize(x, x_group)
        y = step(inp, *qs[0]).double()
        out.append({"shape": shape, "linear": name, "N": N, "K": K, "scales": label,
                    "step_us": kernel_us([functools.partial(step, inp, q, s) for q, s in qs], device),
                    "quant_us": kernel_us([functools.partial(quant, inp)], device),
                    "gemm_us": kernel_us([functools.partial(gemm_alone, xq, sx, q, s, x_group) for q, s in qs], device),
                    "bf16_us": kernel_us([functools.partial(bf16, inp, w) for w in ws], device),
                    "rel_err": ((y - exact).abs().mean() / exact.abs().mean()).item()})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny widths on the CPU (needs TRITON_INTERPRET=1)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of " + ", ".join(SHAPES))
    args = parser.parse_args(argv)
    shapes = listed(parser, "--shapes", args.shapes, SHAPES)
    if not args.dry_run:
        require_cuda(parser)
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda":
        prepare_fp8_linear(torch.device(device))  # the split-K tickets, before any capture
    scales, rows = (DRY_SCALES, DRY_ROWS) if args.dry_run else (SCALES, ROWS)
    results = []
    with torch.no_grad():
        for shape in shapes[:1] if args.dry_run else shapes:
            for name, kind, N, K in linears(shape, args.dry_run):
                results += linear_rows(shape, name, kind, N, K, scales, rows, device)
    config = {"rows": rows, "outliers": f"{OUTLIERS:.0%} of channels x {OUTLIER_GAIN:g}", "scales": list(scales),
              "timing": "common.kernel_us (CUDA graph of 20 calls, weights past L2)"}
    path = write_results("w8a8_scales", results, config, Path(tempfile.mkdtemp()) if args.dry_run else None)
    print(f"wrote {path}")
    print_table(results, COLUMNS)


if __name__ == "__main__":
    main()
