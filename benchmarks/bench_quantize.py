"""The e4m3 row quantizer alone (fastgrpo/kernels/quantize_fp8.py): microseconds per call against the bytes it must
move, for the rows patch_model(fp8_base=True) quantizes in a LoRA step (each linear's input in the forwards, each
output gradient times the weight's row scales in the backward), over a sweep of the kernel's tiles.

    python -m benchmarks.bench_quantize                       # GPU: every case, the sweep
    python -m benchmarks.bench_quantize --no-sweep            # the kernel's own tiles and the tiles before them
    TRITON_INTERPRET=1 python -m benchmarks.bench_quantize --dry-run   # CPU: tiny rows, the same code

Cases: bench_loop's micro-batch of 8 sequences (Qwen2.5-1.5B at C = 4096: 8 x 4352 rows; Llama-3.1-8B at C = 1024:
8 x 1280), bf16 rows of each width the step quantizes: the inputs (hidden, intermediate) and the output gradients
(q/k/v's, gate/up's; the column scale multiplied in). Bytes: the bf16 rows read once, the e4m3 rows and fp32 scales
written. Timing: common.kernel_us over copies of the rows that together pass 3x the L2. Rows: case, tiles
(block_r, block_k, one_pass, num_warps), `tiles` = own (the kernel's choice), before (one row a program, two passes
of min(2048, K) elements, 4 warps: the kernel before 2026-11-30) or sweep, us, GB/s, share of the measured copy
bandwidth, and whether the bytes and scales equal the `own` tiles' (a tile that computes something else shows
there). Writes results/quantize_rows-<card>.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools

import torch
import triton

from benchmarks.bench_rollout import _copy_bandwidth
from benchmarks.common import (check_interpreted, copies_past_l2, failed_row, kernel_us, print_table, require_cuda,
                               timed_row, write_results)
from fastgrpo.kernels.quantize_fp8 import QuantizeTiles, quantize_rows_fwd, quantize_tiles

# name: (rows, K, column scale)
CASES = {
    "qwen-input-hidden": (8 * 4352, 1536, False),
    "qwen-input-intermediate": (8 * 4352, 8960, False),
    "qwen-grad-qkv": (8 * 4352, 2048, True),
    "qwen-grad-gate-up": (8 * 4352, 17920, True),
    "llama-input-hidden": (8 * 1280, 4096, False),
    "llama-input-intermediate": (8 * 1280, 14336, False),
    "llama-grad-qkv": (8 * 1280, 6144, True),
    "llama-grad-gate-up": (8 * 1280, 28672, True),
}
DRY_CASES = {"dry-one-block": (5, 40, False), "dry-two-blocks": (3, 70, True)}
COLUMNS = ["case", "rows", "K", "block_r", "block_k", "one_pass", "num_warps", "tiles", "us", "gb_s", "bw_share",
           "same_bytes"]
MAX_PROGRAM_ELEMENTS = 32768  # the sweep's largest block_r x block_k


def before_tiles(K: int) -> QuantizeTiles:
    return QuantizeTiles(1, min(2048, triton.next_power_of_2(K)), False, 4)


def sweep_tiles(K: int) -> list[QuantizeTiles]:
    whole = triton.next_power_of_2(K)
    tiles = [QuantizeTiles(r, whole, True, w) for r, w in itertools.product((1, 2, 4, 8, 16, 32), (4, 8, 16))
             if 2048 <= r * whole <= MAX_PROGRAM_ELEMENTS]
    tiles += [QuantizeTiles(r, k, False, w) for r, k, w in itertools.product((1, 2, 4), (1024, 2048, 4096, 8192),
                                                                             (4, 8, 16))
              if k < whole and r * k <= MAX_PROGRAM_ELEMENTS // 2]
    return tiles


def candidates(K: int, sweep: bool) -> list[tuple[str, QuantizeTiles]]:
    """(label, tiles) timed for rows of K: the kernel's own, the tiles before them, then the sweep's others."""
    own, before = quantize_tiles(K), before_tiles(K)
    swept = [t for t in sweep_tiles(K) if t not in (own, before)] if sweep else []
    return [("own", own), ("before", before)] + [("sweep", t) for t in swept]


def run_case(name: str, R: int, K: int, column: bool, device: str, bandwidth: float | None, sweep: bool) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)
    nbytes = R * K * 2 + R * K + R * 4
    copies = copies_past_l2(nbytes, device)
    xs = [torch.randn(R, K, generator=g, device=device).mul_(3).to(torch.bfloat16) for _ in range(copies)]
    column_scale = torch.rand(K, generator=g, device=device) + 0.5 if column else None
    outs = [(torch.empty(R, K, dtype=torch.float8_e4m3fn, device=device), torch.empty(R, device=device))
            for _ in range(copies)]
    quantize_rows_fwd(xs[0], *outs[0], column_scale)
    reference = tuple(t.clone() for t in outs[0])
    rows = []
    for label, tiles in candidates(K, sweep):
        row = {"case": name, "rows": R, "K": K, **dataclasses.asdict(tiles), "tiles": label}
        calls = [functools.partial(quantize_rows_fwd, x, *out, column_scale, tiles) for x, out in zip(xs, outs)]
        try:
            # sentinels (e4m3 NaN, a negative scale) where the own tiles' output lay: a row or column a tile skips shows
            outs[0][0].view(torch.uint8).fill_(0x7F)
            outs[0][1].fill_(-1.0)
            calls[0]()
            same = (torch.equal(outs[0][0].view(torch.uint8), reference[0].view(torch.uint8))
                    and torch.equal(outs[0][1], reference[1]))
            us = kernel_us(calls, device)
        except Exception as err:  # noqa: BLE001 - e.g. registers past the card's: its row says so
            rows.append(failed_row(row, err))
            continue
        rows.append(timed_row(row, us, nbytes, bandwidth, same_bytes=same))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny rows on the CPU (needs TRITON_INTERPRET=1)")
    parser.add_argument("--no-sweep", action="store_true", help="only the kernel's own tiles and the ones before")
    args = parser.parse_args(argv)
    check_interpreted(parser, args.dry_run)
    if not args.dry_run:
        require_cuda(parser)
    device = "cpu" if args.dry_run else "cuda"
    bandwidth = None if args.dry_run else _copy_bandwidth()
    rows = []
    for name, (R, K, column) in (DRY_CASES if args.dry_run else CASES).items():
        rows += run_case(name, R, K, column, device, bandwidth, sweep=not args.no_sweep)
    if not args.dry_run:
        config = {"copy_bandwidth_bytes_s": bandwidth, "cases": CASES, "inputs": "bf16 normal(0, 3); column scales "
                  "uniform(0.5, 1.5)", "own_tiles": "quantize_fp8.quantize_tiles(K)"}
        print(f"\nwrote {write_results('quantize_rows', rows, config)}")
    print_table(rows, COLUMNS)


if __name__ == "__main__":
    main()
