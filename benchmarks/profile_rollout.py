"""Where one decode step of the built-in rollout engine spends its time: kernels by category, idle gaps, roofline.

    python -m benchmarks.profile_rollout                # GPU: both shapes, ~3.3 min on an H200 (~1 min compiling)
    python -m benchmarks.profile_rollout --dry-run      # CPU check: a tiny model, same code (or FASTGRPO_PROFILE_CPU=1)
    python -m benchmarks.profile_rollout --modes default,triton   # SDPA vs the Triton decode attention
    python -m benchmarks.profile_rollout --modes default,fp8      # bf16 vs FP8 decode weights (EngineConfig.weights)
    python -m benchmarks.profile_rollout --modes model,fused      # q/k/v and gate/up as one GEMM each
    python -m benchmarks.profile_rollout --modes triton,triton-layers   # whole-step vs per-layer compile
    python -m benchmarks.profile_rollout --modes fused,fp8kv,fp8,fp8-fp8kv   # bf16 vs FP8 KV cache (and FP8 weights)
    python -m benchmarks.profile_rollout --modes fused --prompts 4     # 32 rows: what a step costs at fewer rows
    python -m benchmarks.profile_rollout --new-tokens 4096   # the loop benchmark's long rollout (mean context 2304)

The rollout is bench_rollout's: random-weight bf16 models of the Qwen2.5-1.5B and Llama-3.1-8B shapes, 8 prompts x
8 generations = 64 rows, prompt 256, N = 1024 new tokens (--prompts, --new-tokens change them), temperature 1, EOS
ignored. Each shape runs in a subprocess
of its own (its memory goes back before the next; a per-shape timeout under a global deadline) in two engine modes:
`default` (EngineConfig(): torch.compile + a CUDA graph on CUDA, eager on the CPU) and `eager` (compile=False: one
launch per op, so launch gaps show). Per mode, generate calls with the same request, hence the same shapes (the
step compiles once):
  warm-up   stopped after step 32: compile + graph capture; its wall time is first_s
  timed     (default mode only) all the new tokens: tok_s and ms_step as bench_rollout reports them
  profiled  stopped after step 528; torch.profiler (CPU + CUDA activities) records steps 497-528, whose context is
            the mean context of the rollout (256 + 512 = 768), over the cache (1280 slots) the whole rollout uses
            (at --new-tokens N: the 32 steps centred on step N / 2, in a cache of 256 + N slots)
The engine syncs with the host every 16 steps; a stand-in stop_check, called at those syncs, times the steps, steps
the profiler and ends the shorter calls (it reports every row as stopped). Only the engine's own syncs fall inside
the timed windows. The profiled kernels are summed per category (KERNEL_CATEGORIES), per step. Kernels replayed
from the CUDA graph do show in the trace (seen on an H200, torch 2.11); where none show, the row says so.

Table columns (per shape x mode; *_ms are per decode step):
  tok_s, ms_step    timed call: rows x N tokens / wall; wall / N (prefill and decoding of the texts included)
  decode_ms         decode steps only, unprofiled: the timed call's steps 17-N; eager: the profiled call's
                    17-(N / 2 - 32)
  first_s           the warm-up call's wall seconds (compile + capture in default mode)
  prof_ms           profiled steps' wall (under the profiler: in eager mode its host overhead inflates the gaps)
  busy_ms, idle_ms  GPU busy (union of kernel/copy intervals) and prof_ms - busy_ms (launch and host gaps)
  attention .. other  busy ms per category; kernels: kernels and copies per step
  roof_ms           (every weight a step multiplies, lm_head included, + the K/V of the mean context per row) / measured
                    device copy bandwidth: bench_rollout's roofline; roof_share = roof_ms / ms_step (its roofline
                    share), prof_roof = roof_ms / prof_ms, busy_roof = roof_ms / busy_ms
The JSON rows also carry the top kernels and roof_cache_ms: the same bytes with the K/V of all the cache's slots,
which the masked attention reads whatever the context. Writes benchmarks/results/rollout_profile-<card>.json
(dry run: the trace dir) and, in a temp dir printed first (--trace-dir to choose), each profile's key_averages
table and gzipped chrome trace.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path
from unittest import mock

import torch

from benchmarks import common
from benchmarks.bench_rollout import _copy_bandwidth, build_model, kv_bytes_per_token, weight_bytes
from benchmarks.common import RolloutSizes, card_name, listed, print_table, require_cuda, write_results
from benchmarks.trace_gaps import union
from fastgrpo.rollout.decode import EngineConfig
from fastgrpo.rollout.decode_weights import copy_bytes

SHAPES = ("qwen2.5-1.5b", "llama-3.1-8b")
DRY_SHAPE = "tiny-qwen2"
DEADLINE_S = 540  # the whole GPU run, inside the device's 10-minute call
MODE_TIMEOUT_S = 80  # one mode of one shape: its first call compiles and captures for ~30-50 s
# mode -> (engine config, whether it gets the timed call: eager's would take ~30 s per shape at N = 1024); the modes
# that NOTES' D2 measured keep the model's own weights, as then
MODEL = dict(weights="model")
MODES = {"default": (EngineConfig(), True), "eager": (EngineConfig(compile=False), False),
         # the engine's default until 2026-11-26: SDPA over the padded cache, the whole step compiled
         "sdpa-step": (EngineConfig(attention="sdpa", compile_scope="step", **MODEL), True),
         # the Triton flash-decoding attention (EngineConfig.attention), the whole step compiled (as in NOTES' D2)
         "triton": (EngineConfig(attention="triton", compile_scope="step", **MODEL), True),
         # and each prompt's K/V stored once per group, read once per group by the kernel (EngineConfig.shared_prefix)
         "triton-shared": (EngineConfig(attention="triton", shared_prefix=True, compile_scope="step", **MODEL), True),
         # the decode steps on an e4m3 copy of the weights (EngineConfig.weights; rollout/decode_weights.py): its
         # roofline counts the copy's bytes
         "fp8": (EngineConfig(weights="fp8"), True),
         # the model's own weights, one GEMM per linear (weights "auto" takes "fused" on a GPU when it fits)
         "model": (EngineConfig(**MODEL), True),
         # a copy of q/k/v and gate/up stacked (EngineConfig.weights="fused"): one GEMM per group, as a LoRA model's
         # "dense" copy runs them; the same bytes a step reads as "model"
         "fused": (EngineConfig(weights="fused"), True),
         # the engine's defaults with each prompt's K/V stored and read once per group (its combine step rewritten
         # since "triton-shared" was measured)
         "shared": (EngineConfig(shared_prefix=True), True),
         # one decoder layer compiled for all layers, the step still one CUDA graph (EngineConfig.compile_scope): its
         # per-step cost next to "triton"'s; its first_s is warm after an earlier mode (shared kernels, caches), so
         # compare first calls with benchmarks/bench_warmup.py, which starts a process per measurement
         "triton-layers": (EngineConfig(attention="triton", compile_scope="layers", **MODEL), True),
         # "fused" and "fp8" with the KV cache in e4m3 + an fp32 scale per vector (EngineConfig.kv_cache): the decode
         # attention reads (D + 4) / 2D of the bytes; their rooflines count the e4m3 cache
         "fp8kv": (EngineConfig(weights="fused", kv_cache="fp8"), True),
         "fp8-fp8kv": (EngineConfig(weights="fp8", kv_cache="fp8"), True),
         # the e4m3 copy multiplied on the FP8 tensor cores, each step's activations quantized per row
         "w8a8": (EngineConfig(weights="w8a8"), True),
         "w8a8-fp8kv": (EngineConfig(weights="w8a8", kv_cache="fp8"), True)}
DEFAULT_MODES = "default,eager"
TOP_KERNELS = 12

# Kernel (GPU) or aten op (CPU dry run) name -> category: the first pattern that matches, case-insensitive.
# Names seen on an H200 with torch 2.11: cuBLAS nvjet_* / cublasLt::splitKreduce_kernel, cuDNN SDPA
# cudnn_generated_*_sdpa_*, Inductor triton_{poi,red,per}_fused_<aten ops>, eager at::native::*_kernel<...Functor>.
KERNEL_CATEGORIES = (
    # SDPA (cuDNN, flash, memory-efficient fmha_cutlassF_*: before gemm, it is cutlass too) and the Inductor
    # kernel named after it, which builds its inputs (mask, RoPE)
    ("attention", r"fmha|flash|attention|sdpa|mha_"),
    ("gemm", r"gemm|gemv|nvjet|cutlass|cublas|splitk|xmma|triton_tem_|matmul|fp8_linear|aten::(mm|addmm|bmm)$"),
    # W8A8's per-row activation quantizer (Inductor's fused abs / amax / divide / cast; its clamp is not sampling),
    # and in the fp8kv modes the cache write's quantize_kv (an amax too)
    ("quantize", r"amax|fp8_rows_linear"),
    # logits -> token: (log-)softmax, argmax, top-k / sort, the log-prob gather, the keyed-exponential noise (an
    # int64 hash: xor, shifts; in eager mode also its <long> Functors, log and clamp; the other int64 ops, the mask
    # comparisons and position updates, are [N, M] and [N, 1], small next to the hash's [N, V])
    ("sampling", r"softmax|argmax|topk|top_k|sort|gather|exponential|xor|shift|<long|log_kernel|clamp"),
    # the other Inductor kernels: norms, RoPE, SwiGLU, residual adds, the KV-cache write, fused
    ("elementwise", r"triton_(poi|red|per)_"),
    # eager copies: dtype casts (*copy_kernel*), KV-cache writes (index_copy), cat, fills; copies and memsets
    ("copy", r"memcpy|memset|copy_kernel|index_copy|fill|catarraybatchedcopy|aten::(copy_|index_copy_|fill_|cat)$"),
    ("elementwise", r"elementwise_kernel|reduce_kernel|aten::"),
)
CATEGORIES = [*dict.fromkeys(name for name, _ in KERNEL_CATEGORIES), "other"]
_PATTERNS = [(name, re.compile(pattern, re.IGNORECASE)) for name, pattern in KERNEL_CATEGORIES]
COLUMNS = ["shape", "rows", "mode", "tok_s", "ms_step", "decode_ms", "first_s", "prof_ms", "busy_ms", "idle_ms",
           *CATEGORIES, "kernels", "roof_ms", "roof_share", "prof_roof", "busy_roof"]


@dataclasses.dataclass(frozen=True)
class Sizes(RolloutSizes):
    warmup_steps: int = 32  # the warm-up call's length: past the graph capture (EngineConfig.warmup_steps + 1)
    profile_steps: int = 32

    @property
    def mean_context(self) -> int:
        return self.prompt_len + self.new_tokens // 2

    @property
    def profile_from(self) -> int:
        """The step after which the profiled window starts: the window is centred on the mean context."""
        return self.new_tokens // 2 - self.profile_steps // 2


GPU_SIZES = Sizes()
DRY_SIZES = Sizes(prompts=4, generations=2, prompt_len=16, new_tokens=128)


def sizes_for(dry: bool, prompts: int | None, new_tokens: int | None = None) -> Sizes:
    """The run's sizes; --prompts changes the rows (prompts x 8 generations), --new-tokens the rollout's length."""
    sizes = DRY_SIZES if dry else GPU_SIZES
    changed = {"prompts": prompts, "new_tokens": new_tokens}
    return dataclasses.replace(sizes, **{name: value for name, value in changed.items() if value is not None})


class StepClock:
    """A stop_check for the engine, called at its host syncs (every check_every steps) with the tokens so far.

    Records when each sync began and ended (so that the profiler's own work stays out of the windows), steps the
    profiler at `profile_marks` (start it, start recording, stop) and stops every row at step `stop_at`.
    """

    def __init__(self, stop_at: int | None = None, profiler=None, profile_marks: tuple[int, ...] = ()):
        self.stop_at = stop_at
        self.profiler = profiler
        self.profile_marks = profile_marks
        self.began: dict[int, float] = {}
        self.ended: dict[int, float] = {}

    def __call__(self, tokens: torch.Tensor, running: list[int], call_rows: list[int]) -> list[int]:
        steps = tokens.shape[1]
        self.began[steps] = time.perf_counter()
        if steps in self.profile_marks:
            # the first mark is the profiler's warm-up step (CUPTI set up, events dropped); then it records
            self.profiler.start() if steps == self.profile_marks[0] else self.profiler.step()
        self.ended[steps] = time.perf_counter()
        return running if steps == self.stop_at else []

    def ms_per_step(self, start: int, end: int) -> float:
        """Wall ms per step of steps start+1 .. end (from the end of sync `start` to the start of sync `end`)."""
        return (self.began[end] - self.ended[start]) / (end - start) * 1e3


def build(shape: str, sizes: Sizes, device: str) -> dict:
    """The model (random weights, bf16), a fast tokenizer over its vocabulary and random prompts, as bench_rollout."""
    model, tokenizer = build_model(shape, device)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, model.config.vocab_size, (sizes.prompts, sizes.prompt_len), generator=g).tolist()
    return {"model": model, "tokenizer": tokenizer, "prompts": prompts, "device": device}


def rollout(setup: dict, sizes: Sizes, config: EngineConfig, clock: StepClock) -> tuple[float, object]:
    """One generate call of the benchmark's request, with `clock` as the engine's stop_check: (wall s, result)."""
    from fastgrpo.rollout.sampling import SamplingParams

    # the module, not the package's `generate` function of the same name
    generate_module = importlib.import_module("fastgrpo.rollout.generate")
    engine_rollout = generate_module.rollout

    def with_clock(*args, stop_check=None, **kwargs):
        assert stop_check is None  # the request has no stop strings
        return engine_rollout(*args, stop_check=clock, **kwargs)

    params = SamplingParams(max_new_tokens=sizes.new_tokens, temperature=1.0)
    _sync(setup["device"])
    start = time.perf_counter()
    # generate_with_config hands the engine its stop_check: the seam to reach the engine's syncs from outside
    with mock.patch.object(generate_module, "rollout", with_clock):
        result = generate_module.generate_with_config(
            setup["model"], setup["tokenizer"], setup["prompts"], sizes.generations, params, seed=0, config=config
        )
    _sync(setup["device"])
    return time.perf_counter() - start, result


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def profile_mode(setup: dict, sizes: Sizes, mode: str, config: EngineConfig, timed: bool, bandwidth: float,
                 trace_dir: Path) -> dict:
    """Warm-up, timed (if `timed`) and profiled calls in one engine mode -> the row of (shape, mode)."""
    every = config.check_every
    start, end = sizes.profile_from, sizes.profile_from + sizes.profile_steps
    marks = (start - every, start, end)
    assert all(m % every == 0 and m >= every for m in (*marks, sizes.warmup_steps, sizes.new_tokens)), marks

    first_s, _ = rollout(setup, sizes, config, StepClock(stop_at=sizes.warmup_steps))
    row = {"mode": mode, "first_s": first_s}
    if timed:
        clock = StepClock()
        seconds, result = rollout(setup, sizes, config, clock)
        assert result.completion_ids.shape == (sizes.rows, sizes.new_tokens), result.completion_ids.shape
        row.update(tok_s=sizes.rows * sizes.new_tokens / seconds, ms_step=seconds / sizes.new_tokens * 1e3,
                   decode_ms=clock.ms_per_step(every, sizes.new_tokens), decode_steps=f"{every + 1}-{sizes.new_tokens}")

    profiler = _profiler(setup["device"])
    window = StepClock(stop_at=end, profiler=profiler, profile_marks=marks)
    rollout(setup, sizes, config, window)
    profiler.stop()
    if not timed:  # the steps before the profiler started, unprofiled
        row.update(decode_ms=window.ms_per_step(every, marks[0]), decode_steps=f"{every + 1}-{marks[0]}")
    row.update(prof_ms=window.ms_per_step(start, end), profiled_steps=f"{start + 1}-{end}")
    row.update(summarise(*_work(profiler, setup["device"]), sizes.profile_steps, row["prof_ms"]))
    copy = copy_bytes(setup["model"], config.weights) if config.weights in ("fp8", "w8a8") else None
    row.update(roofline(setup["model"], sizes, bandwidth, row, copy, config.kv_cache))
    _save(profiler, trace_dir / f"{setup['shape']}-{mode}", setup["device"])
    return row


def _profiler(device: str):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)
    return torch.profiler.profile(activities=activities, schedule=schedule)


def _work(profiler, device: str) -> tuple[list[tuple[str, float]], float]:
    """(name, us) of each piece of work in the window, and the busy us. GPU: kernels, copies and memsets, busy being
    the union of their intervals (streams may overlap); CPU (dry run): the aten ops' self times, busy their sum."""
    from torch.autograd import DeviceType

    events = profiler.events()
    if device == "cuda":
        # not the GPU side of record_function ranges (ProfilerStep#N spans the whole window)
        gpu = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
        busy = sum(end - start for start, end in union([(e.time_range.start, e.time_range.end) for e in gpu]))
        return [(e.name, e.time_range.elapsed_us()) for e in gpu], busy
    cpu = [(e.name, e.self_cpu_time_total) for e in events
           if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]
    return cpu, sum(us for _, us in cpu)


def category(name: str) -> str:
    return next((cat for cat, pattern in _PATTERNS if pattern.search(name)), "other")


def summarise(work: list[tuple[str, float]], busy_us: float, steps: int, wall_ms: float) -> dict:
    """Per-step busy ms (total and per category), idle ms, kernel count and the top kernels of the window."""
    if not work:
        # e.g. kernels replayed from a CUDA graph not reported by the profiler: only the wall time is known
        return {"trace_note": "no kernels in the profiled window: busy and category columns unavailable"}
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, us in work:
        per_kernel[name][0] += us
        per_kernel[name][1] += 1
    busy_ms = busy_us / steps / 1e3
    out = {"busy_ms": busy_ms, "idle_ms": wall_ms - busy_ms, "kernels": len(work) / steps}
    out.update({cat: 0.0 for cat in CATEGORIES})
    for name, (us, _) in per_kernel.items():
        out[category(name)] += us / steps / 1e3
    total_us = sum(us for us, _ in per_kernel.values())
    top = sorted(per_kernel.items(), key=lambda item: -item[1][0])[:TOP_KERNELS]
    out["top_kernels"] = [
        {"name": name, "category": category(name), "ms_per_step": us / steps / 1e3, "share": us / total_us,
         "calls_per_step": n / steps}
        for name, (us, n) in top
    ]
    return out


def roofline(model, sizes: Sizes, bandwidth: float, row: dict, weights: int | None = None,
             kv_cache: str = "model") -> dict:
    """bench_rollout's roofline at the mean context (that of the profiled steps too) and its shares; `weights`: the
    bytes of the weights a step multiplies when not the model's own (an FP8 copy); kv_cache "fp8": each bf16 K/V
    vector of D (2D bytes) is cached as D e4m3 bytes + a 4-byte scale."""
    weights = weight_bytes(model) if weights is None else weights
    kv = kv_bytes_per_token(model.config, kv_cache == "fp8") * sizes.rows
    bucket = EngineConfig().length_bucket
    cache_len = -(-(sizes.prompt_len + sizes.new_tokens) // bucket) * bucket  # the engine's M
    roof_ms = (weights + kv * sizes.mean_context) / bandwidth * 1e3
    out = {"roof_ms": roof_ms, "roof_cache_ms": (weights + kv * cache_len) / bandwidth * 1e3}
    for share, column in (("roof_share", "ms_step"), ("prof_roof", "prof_ms"), ("busy_roof", "busy_ms")):
        if row.get(column):
            out[share] = roof_ms / row[column]
    return out


def _cpu_copy_bandwidth() -> float:
    """The dry run's stand-in for bench_rollout's device copy bandwidth: bytes/s of a 64 MiB host copy."""
    src = torch.ones(2**25, dtype=torch.int16)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    dst.copy_(src)
    return 2 * src.numel() * 2 / (time.perf_counter() - start)


def _save(profiler, stem: Path, device: str) -> None:
    sort_by = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    table = profiler.key_averages().table(sort_by=sort_by, row_limit=60, max_name_column_width=120)
    Path(f"{stem}.key_averages.txt").write_text(table + "\n")
    profiler.export_chrome_trace(f"{stem}.trace.json.gz")


def print_top(row: dict) -> None:
    print(f"\n== {row['shape']} / {row['mode']}: top kernels of steps {row['profiled_steps']}, per step ==")
    for k in row.get("top_kernels", []):
        print(f"  {k['ms_per_step']:8.4f} ms  {k['share']:6.1%}  {k['calls_per_step']:6.1f}x  {k['category']:<11}  "
              f"{k['name'][:110]}")
    if "trace_note" in row:
        print(f"  {row['trace_note']}")


def child(shape: str, dry: bool, trace_dir: Path, modes: list[str], sizes: Sizes) -> None:
    """One shape, each of `modes`; rows go to <trace_dir>/<shape>.rows.json after each mode (a timeout keeps them)."""
    began = time.perf_counter()
    device = "cpu" if dry else "cuda"
    setup = build(shape, sizes, device) | {"shape": shape}
    bandwidth = _copy_bandwidth() if device == "cuda" else _cpu_copy_bandwidth()
    print(f"{shape} on {device}: built in {time.perf_counter() - began:.0f} s, copy bandwidth "
          f"{bandwidth / 1e12:.3f} TB/s", flush=True)
    rows = []
    for mode in modes:
        config, timed = MODES[mode]
        began = time.perf_counter()
        try:
            row = {"shape": shape, "rows": sizes.rows} | profile_mode(setup, sizes, mode, config, timed, bandwidth,
                                                                      trace_dir)
            print_top(row)
            print(f"{shape} / {mode}: {time.perf_counter() - began:.0f} s")
        except Exception as err:  # noqa: BLE001 - a failed mode is reported; the other mode still runs
            traceback.print_exc()
            row = {"shape": shape, "mode": mode, "error": repr(err)[:300]}
        rows.append(row)
        (trace_dir / f"{shape}.rows.json").write_text(json.dumps(rows, indent=1))
        sys.stdout.flush()


def run_shape(shape: str, dry: bool, trace_dir: Path, timeout: float, modes: list[str],
              sizes_args: list[str]) -> list[dict]:
    """Run `child` for one shape in a fresh process (its own session, so a timeout kills its compile workers)."""
    rows_file = trace_dir / f"{shape}.rows.json"
    rows_file.unlink(missing_ok=True)  # a reused trace dir: no rows of an earlier run
    if timeout < 30:
        return [{"shape": shape, "error": "skipped: global deadline reached"}]
    cmd = [sys.executable, "-m", "benchmarks.profile_rollout", "--child", shape, "--trace-dir", str(trace_dir),
           "--modes", ",".join(modes), *sizes_args]
    proc = subprocess.Popen(cmd + (["--dry-run"] if dry else []), cwd=Path(__file__).parents[1],
                            start_new_session=True)
    error = None
    try:
        proc.wait(timeout=timeout)
        if proc.returncode:
            error = f"subprocess exited with {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        error = f"timed out after {timeout:.0f} s"
    rows = json.loads(rows_file.read_text()) if rows_file.exists() else []
    return rows + ([{"shape": shape, "error": error}] if error else [])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU (also FASTGRPO_PROFILE_CPU=1)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of " + ", ".join(SHAPES))
    parser.add_argument("--trace-dir", help="where key_averages tables and traces go (default: a new temp dir)")
    parser.add_argument("--modes", default=DEFAULT_MODES, help="comma-separated, of " + ", ".join(MODES))
    parser.add_argument("--prompts", type=int, help="prompts per call, each with 8 generations (default 8: 64 rows)")
    parser.add_argument("--new-tokens", type=int, help="tokens each row decodes (default 1024; a multiple of 16, "
                                                       ">= 128: the profiled window sits at its middle)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: profile this one shape in this process
    args = parser.parse_args(argv)
    dry = args.dry_run or os.environ.get("FASTGRPO_PROFILE_CPU") == "1"
    modes = listed(parser, "--modes", args.modes, MODES)
    if args.prompts is not None and args.prompts < 1:
        parser.error(f"--prompts: expected >= 1, got {args.prompts}")
    if args.new_tokens is not None and (args.new_tokens < 128 or args.new_tokens % 16):
        parser.error(f"--new-tokens: expected a multiple of 16 (the engine's host-sync interval) >= 128, "
                     f"got {args.new_tokens}")
    shapes = [DRY_SHAPE] if dry else listed(parser, "--shapes", args.shapes, SHAPES)
    if not dry:
        require_cuda(parser)
    sizes = sizes_for(dry, args.prompts, args.new_tokens)
    sizes_args = [arg for flag, value in (("--prompts", args.prompts), ("--new-tokens", args.new_tokens))
                  if value is not None for arg in (flag, str(value))]
    trace_dir = Path(args.trace_dir or tempfile.mkdtemp(prefix="rollout_profile_"))
    trace_dir.mkdir(parents=True, exist_ok=True)
    if args.child:
        child(args.child, dry, trace_dir, modes, sizes)
        return
    print(f"key_averages tables, chrome traces and per-shape rows: {trace_dir}", flush=True)
    deadline = time.monotonic() + DEADLINE_S
    rows: list[dict] = []
    for shape in shapes:
        # a longer rollout decodes longer in each call (MODE_TIMEOUT_S is for 1024 tokens)
        timeout = min(MODE_TIMEOUT_S * len(modes) * max(1.0, sizes.new_tokens / 1024), deadline - time.monotonic())
        rows += run_shape(shape, dry, trace_dir, timeout, modes, sizes_args)
    config = {"model": "random weights, bf16", "card": card_name(), **dataclasses.asdict(sizes),
              "mean_context": sizes.mean_context, "sampling": "temperature 1, top_k 0, top_p 1, EOS ignored",
              "categories": dict(KERNEL_CATEGORIES), "trace_dir": str(trace_dir)}
    results_dir = trace_dir if dry else common.RESULTS_DIR  # the dry run's results stay out of benchmarks/results/
    path = write_results("rollout_profile", rows, config, results_dir)
    print(f"\nwrote {path}")
    for row in rows:
        if "error" in row:
            print(f"{row['shape']} {row.get('mode', '')}: {row['error']}")
    print_table(rows, COLUMNS)


if __name__ == "__main__":
    main()
