"""The Triton decode attention kernel alone (fastgrpo/kernels/decode_attention.py): microseconds per call against
the bytes it must read, with a bf16 and an e4m3 cache (its V slot-major as the engine stores it, and row-major), over
a sweep of its GPU tiles and split counts; and the e4m3 cache with the kernel's fp8_dots (e4m3-fp8-dots), also with
its operands in two e4m3 parts (e4m3-fp8-split). In the
plain layout (each row's own cache) or the shared-prefix one (--layouts shared: EngineConfig(shared_prefix=True)).

    python -m benchmarks.bench_decode_attention                           # GPU: both shapes, all caches, sweep
    python -m benchmarks.bench_decode_attention --caches e4m3 --tiles 64/2/2,128/4/2 --splits auto,1,2
    python -m benchmarks.bench_decode_attention --caches e4m3-fp8-dots --layouts plain,shared --tiles 128/4/2
    TRITON_INTERPRET=1 python -m benchmarks.bench_decode_attention --dry-run   # CPU: tiny shapes, default tiles

One call is one layer of bench_rollout's decode step at its mean context: 64 rows (8 prompts x 8 samples), a
1280-slot cache (prompt 256 + 1024 new tokens) filled to 768 slots (--new-tokens N: 256 + N slots filled to
256 + N / 2), all visible, the shape's K/V heads and query
heads per K/V head, head dim 128, called as the engine calls it (v_finite: its cache holds finite values only).
Shared layout: the 8 samples of a prompt read its 256 prompt slots once, as one program of 8 x G query rows (the
kernel's taller tiles), then each its own 1024 suffix slots, filled to 512. Bytes read: the filled slots' K and V
(e4m3: and their fp32 scales), a prompt's once. Timing: common.kernel_us over copies of the
cache that together pass 3x the L2 (a decode step reads each layer's cache from HBM). Rows: shape, cache, tiles
(block_n, num_warps, num_stages), splits (auto: the kernel's rule), `default` (the kernel's own choice of both), us,
GB/s, share of the measured device copy bandwidth, and the largest difference from the default's output (a tile
that computes something else shows there). Writes results/decode_attention-<card>.json.
"""
from __future__ import annotations

import argparse
import functools
import itertools

import torch

from benchmarks.bench_rollout import _copy_bandwidth
from benchmarks.common import (check_interpreted, copies_past_l2, failed_row, kernel_us, listed, print_table,
                               require_cuda, timed_row, write_results)
from benchmarks.e2e import MODEL_CONFIGS
from fastgrpo.kernels.cards import max_shared
from fastgrpo.kernels.decode_attention import (FP8_DOTS_DEEP_SHARED, FP8_DOTS_DEEP_TILES, GPU_TILES,
                                             decode_attention_fwd, launch_tiles, program_blocks)
from fastgrpo.ops.decode_attention import quantize_kv

SHAPES = ("qwen2.5-1.5b", "llama-3.1-8b")
# samples, prompt: the shared layout's samples per prompt and prompt slots (the plain layout's rows hold both)
GPU_SIZES = dict(rows=64, slots=1280, length=768, samples=8, prompt=256)
NEW_TOKENS = 1024  # GPU_SIZES' rollout: prompt + NEW_TOKENS slots, filled to the mean context prompt + NEW_TOKENS / 2
DRY_SIZES = dict(rows=4, slots=80, length=50, samples=2, prompt=16)
LAYOUTS = ("plain", "shared")
SWEEP = dict(block_n=(32, 64, 128), num_warps=(2, 4, 8), num_stages=(2, 3, 4))
COLUMNS = ["shape", "cache", "layout", "block_n", "num_warps", "num_stages", "maxnreg", "splits", "default", "us",
           "gb_s", "bw_share", "max_diff_vs_default", "error"]


def heads(shape: str) -> tuple[int, int, int]:
    """(K/V heads, query heads per K/V head, head dim) of a benchmark shape."""
    c = MODEL_CONFIGS[shape]
    return c["num_key_value_heads"], c["num_attention_heads"] // c["num_key_value_heads"], \
        c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])


# cache -> (e4m3, V slot-major, the kernel's dots options): the bf16 cache; the e4m3 cache as the engine stores it
# (rollout/kv_cache.py: V's slots contiguous) with fp16 dots (the engine's before 2026-11-28); with V row-major like K
# (the engine's layout before 2026-11-27); the engine's e4m3 cache and dots, fp8_dots (e4m3 q and weights on the FP8
# tensor cores); and fp8_dots with each operand in two e4m3 parts (fp8_split, not the engine's: NOTES_rollout.md)
CACHES = {"bf16": (False, False, {}), "e4m3": (True, True, {}), "e4m3-v-rowmajor": (True, False, {}),
          "e4m3-fp8-dots": (True, True, {"fp8_dots": True}),
          "e4m3-fp8-split": (True, True, {"fp8_dots": True, "fp8_split": True})}


def caches(shape: str, sizes: dict, cache: str, layout: str, device: str) -> tuple[list[dict], int]:
    """Copies of one layer's inputs (enough to pass 3x the L2 on a GPU) and the bytes one call must read."""
    fp8, slot_major, dots = CACHES[cache]
    H, G, D = heads(shape)
    N, M, length = sizes["rows"], sizes["slots"], sizes["length"]
    S, P = (sizes["samples"], sizes["prompt"]) if layout == "shared" else (1, 0)
    read = N // S * P + N * (length - P)  # slots read per head: each prompt's once, then each row's own
    g = torch.Generator(device).manual_seed(0)
    per_copy = read * H * D * 2 * (1 if fp8 else 2) + (read * H * 2 * 4 if fp8 else 0)
    made = []
    for _ in range(copies_past_l2(per_copy, device)):
        k, v = (torch.randn(N, H, M - P, D, generator=g, device=device, dtype=torch.bfloat16) for _ in range(2))
        call = dict(q=torch.randn(N, H, G, D, generator=g, device=device, dtype=torch.bfloat16), k=k, v=v,
                    v_finite=True, visible=torch.ones(N, M - P, dtype=torch.bool, device=device),
                    length=torch.tensor([length - P], device=device), scale=D**-0.5)
        if P:
            call["prefix_k"], call["prefix_v"] = (torch.randn(N // S, H, P, D, generator=g, device=device,
                                                              dtype=torch.bfloat16) for _ in range(2))
            call["prefix_visible"] = torch.ones(N // S, P, dtype=torch.bool, device=device)
        if fp8:
            for name in ("k", "v", "prefix_k", "prefix_v")[:4 if P else 2]:
                call[name], call[f"{name}_scale"] = quantize_kv(call[name])
                if slot_major and name.endswith("v"):
                    call[name] = call[name].transpose(2, 3).contiguous().transpose(2, 3)
            call.update(dots)
        made.append(call)
    return made, per_copy


def parse_tiles(text: str) -> dict:
    """block_n/num_warps/num_stages[/maxnreg] -> the kernel's tiles dict; ValueError if it is not that."""
    values = [int(x) for x in text.split("/")]
    if len(values) not in (3, 4):
        raise ValueError(text)
    return dict(zip((*SWEEP, "maxnreg"), values))


def rollout_sizes(new_tokens: int) -> dict:
    """GPU_SIZES for a rollout of new_tokens: the cache holds the prompt and them, filled to their mean context."""
    prompt = GPU_SIZES["prompt"]
    return GPU_SIZES | dict(slots=prompt + new_tokens, length=prompt + new_tokens // 2)


def kernel_tiles(shape: str, sizes: dict, cache: str, layout: str, shared: int = 0) -> dict:
    """The tiles the kernel picks itself for a layout's programs (S x G query rows: taller with a shared prefix) on a
    card of `shared` bytes of shared memory per block (0: off a GPU)."""
    _, G, D = heads(shape)
    S = sizes["samples"] if layout == "shared" else 1
    fp8, _, dots = CACHES[cache]
    fp8_dots = dots.get("fp8_dots", False)
    return launch_tiles(*program_blocks(S * G, D, fp8_dots), fp8, fp8_dots, shared)


def run_shape(shape: str, sizes: dict, device: str, bandwidth: float | None, tiles: list[dict],
              cache_names: list[str], layouts: list[str], split_counts: list[int | None]) -> list[dict]:
    """Rows of one shape: each cache x layout x tiles x splits (None: the kernel's choice)."""
    rows = []
    for cache, layout in itertools.product(cache_names, layouts):
        calls, nbytes = caches(shape, sizes, cache, layout, device)
        own = kernel_tiles(shape, sizes, cache, layout, max_shared(torch.device(device)) if device == "cuda" else 0)
        reference = decode_attention_fwd(**calls[0], tiles=own).float()
        for t, splits in itertools.product([own if t is None else t for t in tiles], split_counts):
            row = {"shape": shape, "cache": cache, "layout": layout, **t, "splits": splits or "auto",
                   "default": t == own and splits is None}
            try:
                diff = (decode_attention_fwd(**calls[0], tiles=t, splits=splits).float() - reference).abs().max().item()
                us = kernel_us([functools.partial(decode_attention_fwd, **c, tiles=t, splits=splits) for c in calls],
                               device)
            except Exception as err:  # noqa: BLE001 - e.g. a tile past the shared memory: its row says so
                rows.append(failed_row(row, err))
                continue
            rows.append(timed_row(row, us, nbytes, bandwidth, max_diff_vs_default=diff))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (needs TRITON_INTERPRET=1)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of " + ", ".join(SHAPES))
    parser.add_argument("--no-sweep", action="store_true", help="only the kernel's default tiles")
    parser.add_argument("--tiles", help="instead of the sweep: comma-separated block_n/num_warps/num_stages, "
                        "optionally /maxnreg (registers per thread at most), e.g. 64/2/2,128/4/2,128/4/2/168")
    parser.add_argument("--caches", default=",".join(CACHES), help="comma-separated, of " + ", ".join(CACHES))
    parser.add_argument("--layouts", default="plain", help="comma-separated, of " + ", ".join(LAYOUTS))
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS,
                        help="the rollout's new tokens: a cache of 256 + N slots filled to its mean context, "
                        "256 + N / 2 (the loop benchmark's C = 4096: 4096)")
    parser.add_argument("--splits", default="auto",
                        help="comma-separated splits per (group, head) to time each tile with; auto: the kernel's")
    args = parser.parse_args(argv)
    cache_names = listed(parser, "--caches", args.caches, CACHES)
    layouts = listed(parser, "--layouts", args.layouts, LAYOUTS)
    try:
        tiles = [parse_tiles(t) for t in args.tiles.split(",")] if args.tiles else None
    except ValueError:
        parser.error(f"--tiles: expected block_n/num_warps/num_stages[/maxnreg], comma-separated; got {args.tiles!r}")
    try:
        split_counts = [None if x == "auto" else int(x) for x in args.splits.split(",")]
    except ValueError:
        parser.error(f"--splits: expected 'auto' or positive integers, comma-separated; got {args.splits!r}")
    if any(x is not None and x < 1 for x in split_counts):
        parser.error(f"--splits: expected 'auto' or positive integers; got {args.splits!r}")
    shapes = listed(parser, "--shapes", args.shapes, SHAPES)
    check_interpreted(parser, args.dry_run)
    if not args.dry_run:
        require_cuda(parser)
    device = "cpu" if args.dry_run else "cuda"
    if args.new_tokens < 2:
        parser.error(f"--new-tokens: expected an integer >= 2; got {args.new_tokens}")
    if args.dry_run and args.new_tokens != NEW_TOKENS:
        parser.error("--new-tokens: the dry run has its own tiny sizes; leave it out there")
    sizes = DRY_SIZES if args.dry_run else rollout_sizes(args.new_tokens)
    bandwidth = None if args.dry_run else _copy_bandwidth()
    if tiles is None:
        sweep = not (args.dry_run or args.no_sweep)
        tiles = [dict(zip(SWEEP, t)) for t in itertools.product(*SWEEP.values())] if sweep else [None]
    rows = []
    for shape in shapes:
        rows += run_shape(shape, sizes, device, bandwidth, tiles, cache_names, layouts, split_counts)
    config = {"sizes": sizes, "copy_bandwidth_bytes_s": bandwidth, "sweep": SWEEP,
              "default_tiles": f"the kernel's own per program size and card (launch_tiles; 16 rows x D 128: {GPU_TILES}, "
                               f"fp8_dots' with {FP8_DOTS_DEEP_SHARED} bytes of shared memory per block or more: "
                               f"{FP8_DOTS_DEEP_TILES})",
              "inputs": "q, K, V normal(0, 1) in bf16; e4m3: quantize_kv of those (one fp32 scale per slot and head)"}
    if not args.dry_run:
        print(f"\nwrote {write_results('decode_attention', rows, config)}")
    print_table(rows, COLUMNS)


if __name__ == "__main__":
    main()
